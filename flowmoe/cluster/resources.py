"""What one replica asks the Ray cluster for, and whether N of them fit it.

Each replica is one actor with an explicit request: `num_gpus` (1 on a GPU cluster, 0 for a CPU
replica) and `num_cpus` (--replica-cpus, also its torch threads). A replica needs its whole
request on one node, so the check counts, node by node, how many replicas each can hold; a job
that does not fit is refused before anything is written or loaded, instead of waiting forever
for resources that do not exist."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from attrs import frozen

from flowmoe.core.errors import ConfigError


@frozen
class ReplicaResources:
    num_cpus: int
    num_gpus: int  # 0 or 1: a replica is one flowmoe runtime on one device

    @classmethod
    def choose(cls, device: str, cpus: int, nodes: Sequence[Mapping[str, float]]) -> ReplicaResources:
        """--device cuda: a GPU each; cpu: none; auto: a GPU each where the cluster has any."""
        gpus = device == "cuda" or (device == "auto" and any(n.get("GPU", 0) > 0 for n in nodes))
        return cls(cpus, 1 if gpus else 0)

    @property
    def device(self) -> str:
        return "cuda" if self.num_gpus else "cpu"

    def per_node(self, node: Mapping[str, float]) -> int:
        """How many replicas one node's resources hold."""
        fits = int(node.get("CPU", 0) // self.num_cpus)
        if self.num_gpus:
            fits = min(fits, int(node.get("GPU", 0) // self.num_gpus))
        return fits

    def check_fit(self, replicas: int, nodes: Sequence[Mapping[str, float]], cluster: str) -> None:
        """One line, before anything runs, when `replicas` of these do not fit the cluster's nodes."""
        fits = sum(self.per_node(n) for n in nodes)
        if fits >= replicas:
            return
        cpus = sum(int(n.get("CPU", 0)) for n in nodes)
        gpus = sum(int(n.get("GPU", 0)) for n in nodes)
        raise ConfigError(
            f"--replicas {replicas}: each replica asks for {self.num_cpus} CPU(s) and "
            f"{self.num_gpus} GPU(s), and the Ray cluster {cluster} ({len(nodes)} node(s), {cpus} CPUs, "
            f"{gpus} GPUs) holds only "
            f"{fits}; use fewer --replicas or a smaller --replica-cpus"
        )
