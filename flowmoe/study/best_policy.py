"""The best policy for one scheduler on one setup: a search constrained by the fields the user fixed.

`Given` holds the policy fields a user set (None: let the search choose) and the
scheduler options set, by field name. The candidates are the scheduler's own
planner's policies where it has one (`Scheduler.own_policies`: MoE-Gen's batch
sizes), the HRM plan's best policy per placement (`policy_search.search`,
restricted to the given placements and batch size) and a grid of batch sizes
and micro-batch counts at the largest resident weight share that fits; every
given field overrides the candidate's. Each candidate takes the scheduler's
options (its `Options` class, `core.options`): those given, and for each one not
given every value its field's search candidates list (its default where they
list none). Each candidate's memory is checked with
the scheduler's own accounting (cheap: no simulation); the few fitting ones
with the largest batches are simulated quickly (two decode steps) and the
fastest is simulated at the setup's full sampling. A scheduler no candidate
fits gets its smallest candidate's memory error, so the reason is one line.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from attrs import asdict, evolve, field, frozen

from flowmoe.core.errors import FlowmoeError
from flowmoe.core.memory import fitting_expert_format, gib
from flowmoe.core.options import knob, knobs
from flowmoe.core.policy import AttentionFormat, ExpertFormat, Place, Policy
from flowmoe.core.policy_search import search
from flowmoe.core.ranges import ByteSize
from flowmoe.core.scheduling import PolicyRequest
from flowmoe.schedulers.registry import load
from flowmoe.study.sim_report import SimulationResult
from flowmoe.study.simulate import Setup, Simulation

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
COUNTS = (1, 8)  # micro-batches per batch tried when not given (8: Klotski's released default)
SHARES = tuple(i / 20 for i in range(20, -1, -1))  # resident weight shares tried, largest first
KV_SHARES = (1.0, 0.0)  # the KV cache on the GPU, or in host memory where the scheduler can keep it there
PER_GROUP = 2  # fitting batch sizes simulated per (placement, micro-batch count)


@frozen
class Given:
    """Policy fields fixed by the user; None leaves a field to the search. `options`: the scheduler
    options fixed, by field name (an options class takes those it has fields of)."""

    batch_size: int | None = None
    micro_batches: int | None = None
    attention_on: Place | None = None
    ffn_on: Place | None = None
    weights_gpu_share: float | None = None
    kv_gpu_share: float | None = None
    gpu_memory: int | None = None
    cpu_threads: int | None = None
    max_batch: int | None = None  # a cap on N where N is not given (e.g. the requests a job has)
    expert_format: ExpertFormat | None = None
    attention_format: AttentionFormat | None = None
    options: dict[str, Any] = field(factory=dict, hash=False)

    def apply(self, policy: Policy) -> Policy:
        """`policy` with every given field (options: `_with_options`); N and the micro-batch count fix
        μ = ceil(N / count)."""
        n = self.batch_size or policy.batch_size
        count = min(n, self.micro_batches or policy.micro_batches)
        fields = {
            k: v
            for k, v in asdict(self, recurse=False).items()
            if v is not None and k not in ("batch_size", "micro_batches", "max_batch", "options")
        }
        return evolve(policy, micro_batch_size=-(-n // count), micro_batches=count, **fields)

    @property
    def complete(self) -> bool:
        """Every field the search would choose is given: one candidate only."""
        fields = (self.batch_size, self.micro_batches, self.attention_on, self.ffn_on,
                  self.weights_gpu_share, self.kv_gpu_share)  # fmt: skip
        return all(f is not None for f in fields)


def best_policy(setup: Setup, name: str, given: Given, quick_samples: int = 2) -> SimulationResult:
    """The fastest fitting policy for scheduler `name`, simulated at the setup's sampling."""
    given = _stored_format(setup, given)
    fitting, smallest = _fitting(setup, name, given)
    if not fitting:
        return smallest
    quick = [Simulation(evolve(setup, policy=p, decode_samples=quick_samples)).run(name) for p in fitting]
    ran = [r for r in quick if r.error is None]
    if not ran:
        return quick[0]
    choice = max(ran, key=lambda r: r.throughput).policy
    if setup.decode_samples == quick_samples:
        return next(r for r in ran if r.policy == choice)
    return Simulation(evolve(setup, policy=choice)).run(name)


def _stored_format(setup: Setup, given: Given) -> Given:
    """Experts kept in FP8 in host memory where the model's weights fit it only so, unless a format
    was given: DeepSeek-V3 is 1.34 TB in bfloat16 and ships as FP8 (0.69 TB)."""
    if given.expert_format is not None:
        return given
    return evolve(given, expert_format=fitting_expert_format(setup.spec, setup.hardware))


def _fitting(setup: Setup, name: str, given: Given) -> tuple[list[Policy], SimulationResult]:
    """Candidates that fit the scheduler's memory accounting (largest batches first per group), and
    the memory refusal of the smallest candidate, reported when none fits."""
    chosen: list[Policy] = []
    groups: dict[tuple[str, str, int, tuple[Any, ...]], int] = {}
    smallest: SimulationResult | None = None
    options = load(name).Options
    candidates = itertools.chain(_own(setup, name, given), _candidates(setup, given))
    for policy in (p for c in candidates for p in _with_options(c, options, given)):
        key = (policy.attention_on, policy.ffn_on, policy.micro_batches, policy.options)
        if groups.get(key, 0) >= PER_GROUP or policy in chosen:
            continue
        refusal = _refusal(setup, name, policy)
        if refusal is None:
            kept = _unused_share(setup, name, policy, given)
            if kept not in chosen:
                chosen.append(kept)
                groups[key] = groups.get(key, 0) + 1
        elif smallest is None or refusal.policy.batch_size <= smallest.policy.batch_size:
            smallest = refusal
    if smallest is None:  # every candidate fitted
        smallest = Simulation(evolve(setup, policy=chosen[0], decode_samples=1)).run(name)
    return chosen, smallest


def _refusal(setup: Setup, name: str, policy: Policy) -> SimulationResult | None:
    """None where `policy` fits scheduler `name`; else the result that says why not."""
    try:
        return Simulation(evolve(setup, policy=policy, decode_samples=1)).refusal(name)
    except FlowmoeError as exc:
        return Simulation(evolve(setup, policy=policy, decode_samples=1)).failed(name, str(exc))


def _unused_share(setup: Setup, name: str, policy: Policy, given: Given) -> Policy:
    """`policy` with no resident weight share where the scheduler keeps none for it (its memory need
    is the same without), so the row does not show a share the run never used."""
    if given.weights_gpu_share is not None or policy.weights_gpu_share == 0.0:
        return policy
    bare = evolve(policy, weights_gpu_share=0.0)
    need = (Simulation(evolve(setup, policy=p, decode_samples=1)).need(name) for p in (policy, bare))
    return bare if next(need) == next(need) else policy


def _with_options(policy: Policy, options: type, given: Given) -> Iterator[Policy]:
    """`policy` with scheduler options `options`: the values given, and each combination of the
    search candidates of the fields not given (a field without candidates keeps its default)."""
    fields = knobs(options)
    choices = [
        (given.options[a.name],) if a.name in given.options else knob(a).candidates or (a.default,)
        for a in fields
    ]
    for values in itertools.product(*choices):
        yield policy.with_options(options(**{a.name: v for a, v in zip(fields, values, strict=True)}))


def _own(setup: Setup, name: str, given: Given) -> Iterator[Policy]:
    """The scheduler's own planner's policy per placement, where it has one (`own_policies`)."""
    if given.complete:
        return
    attention: tuple[Place, ...] = (given.attention_on,) if given.attention_on else ("gpu", "cpu")
    cap, budget = given.batch_size or given.max_batch, setup.policy.gpu_memory
    request = PolicyRequest(setup.spec, setup.hardware, setup.workload, attention, cap, budget)
    yield from (given.apply(policy) for policy in load(name).own_policies(request))


def _candidates(setup: Setup, given: Given) -> Iterator[Policy]:
    if given.complete:
        yield given.apply(Policy())
        return
    yield from _planned(setup, given)
    for attention in (given.attention_on,) if given.attention_on else ("gpu",):
        for ffn in (given.ffn_on,) if given.ffn_on else ("gpu",):
            for count in (given.micro_batches,) if given.micro_batches else COUNTS:
                for n in _batches(given, count):
                    for kv in (given.kv_gpu_share,) if given.kv_gpu_share is not None else KV_SHARES:
                        base = Policy(max(1, n // count), count, attention, ffn, kv_gpu_share=kv)
                        yield from (given.apply(evolve(base, weights_gpu_share=s)) for s in _shares(given))


def _planned(setup: Setup, given: Given) -> Iterator[Policy]:
    """The HRM plan's best policy per placement, within the given placements and batch size, then
    again with N capped at half the last plan's, and so on: the plan does not know each scheduler's
    own memory accounting, so its smaller plans are the next candidates where its best does not fit."""
    attention: Sequence[Place] = (given.attention_on,) if given.attention_on else ("gpu", "cpu")
    ffn: Sequence[Place] = (given.ffn_on,) if given.ffn_on else ("gpu", "cpu")
    cap = given.batch_size or given.max_batch or 8192
    while cap >= 1:
        try:
            plan = search(setup.spec, setup.hardware, setup.workload, attention, ffn, max_batch=cap)
        except FlowmoeError:
            return
        yield from (given.apply(c.policy) for c in plan.per_placement)
        if given.batch_size is not None:
            return
        cap = plan.best.policy.batch_size // 2


def _batches(given: Given, count: int) -> list[int]:
    if given.batch_size is not None:
        return [given.batch_size]
    cap = given.max_batch or BATCHES[-1]
    return sorted({cap, *(n for n in BATCHES if count <= n <= cap)}, reverse=True)


def _shares(given: Given) -> Sequence[float]:
    return (given.weights_gpu_share,) if given.weights_gpu_share is not None else SHARES


def describe_policy(p: Policy, scheduler: str = "") -> str:
    """The policy a result ran, in one cell: N (μ x count), placements, shares, and the scheduler's
    own options where set (each by its label; sizes in MiB or GiB)."""
    text = (f"N={p.batch_size} ({p.micro_batch_size}x{p.micro_batches}) attn {p.attention_on} "
            f"ffn {p.ffn_on} w {p.weights_gpu_share:.0%} kv {p.kv_gpu_share:.0%}")  # fmt: skip
    words = [text, *(_described(p.options_for(load(scheduler).Options)) if scheduler else ())]
    if p.cpu_threads:
        words.append(f"threads {p.cpu_threads}")
    if p.expert_format != "native":
        words.append(f"experts {p.expert_format}")
    if p.attention_format != "native":
        words.append(f"attention {p.attention_format}")
    return " ".join(words)


def _described(options: object) -> list[str]:
    words = []
    for attribute in knobs(type(options)):
        if value := getattr(options, attribute.name):
            k = knob(attribute)
            words.append(
                f"{k.label or attribute.name} {gib(value) if isinstance(k.range, ByteSize) else value}"
            )
    return words
