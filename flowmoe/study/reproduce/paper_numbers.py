"""Every published number `flowmoe reproduce` checks, each with the paper and the table / figure /
section it comes from (the papers' text: shared/papers/*.txt). Numbers only, no simulator settings.

Throughputs are generated tokens per second (prefill + decode), the papers' metric. Where a paper
gives a figure only as a bar, the number comes from its artifact, cited by path. Derived numbers say
how they were derived (the collaborative-inference paper's tokens/s = its Table IV power / its
Table V energy per token, which reproduces its quoted 4.8 and 10.4 tokens/s and its 4.4x).
"""

from __future__ import annotations

from attrs import frozen

GENS = (32, 64, 128, 256)

ML = "MoE-Lightning (Cao et al., ASPLOS 2025)"
ML_FIG7 = "Fig. 7 (bars: artifact plots/main_results/plot_e2e_bar_all.py, github.com/caoshiyi/artifacts)"
# MTBench, Mixtral-8x7B, tokens/s per generation length 32/64/128/256 (ML_FIG7).
ML_MTBENCH: dict[str, dict[str, tuple[float, ...]]] = {
    "S1": {"FlexGen": (12.1, 12.3, 9.5, 9.6), "FlexGen(c)": (9.8, 9.4, 7.2, 6.8),
           "DeepSpeed": (7.1, 7.6, 7.8, 6.7), "MoE-Lightning(p)": (15.6, 24.0, 30.1, 33.9),
           "MoE-Lightning": (63.0, 101.3, 97.73, 96.7)},
    "S2": {"FlexGen": (29.2, 34.9, 37.2, 28.8), "FlexGen(c)": (17.5, 18.9, 20.0, 15.9),
           "DeepSpeed": (12.7, 13.3, 12.1, 11.8), "MoE-Lightning(p)": (53.7, 67.4, 79.0, 78.6),
           "MoE-Lightning": (203.0, 294.5, 217.5, 167.9)},
}  # fmt: skip
# The batch N each MoE-Lightning run held, per generation length 32/64/128/256: the artifact's logs
# (benchmarks/mtbench/mtbench_moel{,_p}_{t4,L4}.jsonl) give each run's time and tokens/s, and N =
# time x tokens/s / max_new_tokens (S1 MoE-Lightning(p): 504, Table 5's N).
ML_SYSTEMS = ("MoE-Lightning", "MoE-Lightning(p)")
ML_ARTIFACT_N: dict[tuple[str, str], tuple[int, ...]] = {
    ("S1", "MoE-Lightning(p)"): (504, 504, 504, 504), ("S1", "MoE-Lightning"): (3097, 3097, 2296, 1485),
    ("S2", "MoE-Lightning(p)"): (1088, 1020, 884, 748), ("S2", "MoE-Lightning"): (4494, 3616, 2608, 1560),
}  # fmt: skip
# FlexGen's policies in the artifact (benchmarks/flexgen/{T4,L4}/*.sh): (gbs = μ, num-gb, weight % on GPU).
ML_FLEXGEN_POLICY = {
    ("S1", 32): (32, 40, 7), ("S1", 64): (16, 78, 8), ("S1", 128): (8, 139, 8), ("S1", 256): (8, 113, 8),
    ("S2", 32): (64, 21, 12), ("S2", 64): (64, 20, 12), ("S2", 128): (64, 18, 12), ("S2", 256): (32, 30, 14),
    ("S1", "reasoning"): (32, 61, 7), ("S1", "summarization"): (3, 92, 7),
    ("S2", "reasoning"): (64, 33, 14), ("S2", "summarization"): (8, 36, 12),
}  # fmt: skip


@frozen
class Chosen:
    """A system's published throughput with the policy the paper states it ran (μ, N/μ)."""

    throughput: float
    micro_batch: int
    micro_batches: int


# Table 4: HELM synthetic reasoning (gen 50) and summarization (gen 64), S1 and S2, with μ and N/μ.
ML_TABLE4: dict[tuple[str, str], dict[str, Chosen]] = {
    ("S1", "reasoning"): {"FlexGen(c)": Chosen(16.903, 32, 61), "FlexGen": Chosen(22.691, 32, 61),
                          "DeepSpeed": Chosen(11.832, 102, 1), "MoE-Lightning(p)": Chosen(26.349, 36, 26)},
    ("S2", "reasoning"): {"FlexGen(c)": Chosen(20.015, 64, 33), "FlexGen": Chosen(50.138, 64, 33),
                          "DeepSpeed": Chosen(18.589, 156, 1), "MoE-Lightning(p)": Chosen(105.29, 100, 15)},
    ("S1", "summarization"): {"FlexGen(c)": Chosen(2.614, 3, 92), "FlexGen": Chosen(3.868, 3, 92),
                              "DeepSpeed": Chosen(0.965, 8, 1), "MoE-Lightning(p)": Chosen(4.52, 4, 19)},
    ("S2", "summarization"): {"FlexGen(c)": Chosen(4.307, 8, 36), "FlexGen": Chosen(7.14, 8, 36),
                              "DeepSpeed": Chosen(1.447, 12, 1), "MoE-Lightning(p)": Chosen(12.393, 8, 36)},
}  # fmt: skip
# Table 5: MTBench on S1, gen 128: FlexGen under its own and under MoE-Lightning's policy (μ, N).
ML_TABLE5: dict[str, tuple[float, int, int]] = {
    "FlexGen w/ their policy": (9.5, 8, 1112),
    "FlexGen w/ our policy": (16.816, 36, 504),
    "FlexGen w/ our policy + larger N": (20.654, 36, 1116),
    "MoE-Lightning(p)": (30.12, 36, 504),
}
# §5.3: MoE-Lightning(p) 4xT4 over 2xT4 (S7 / S6, Mixtral-8x22B, MTBench), and MoE-Lightning on DBRX
# 4xT4 over 2xT4 (S9 / S8, Fig. 8): published as ranges over the generation lengths.
ML_SCALING = {("S6", "S7"): (2.77, 3.38), ("S8", "S9"): (2.1, 2.8)}
# The absolute figures behind them at gen 128 (tokens/s): Fig. 7's S6/S7 bars for MoE-Lightning(p)
# (ML_FIG7's source) and the Fig. 8 runs on S8/S9 (artifact benchmarks/mtbench/mtbench_moel_S8.jsonl,
# mtbench_moel_S9.jsonl, max_new_tokens 128).
ML_SCALING_GEN128 = {"S6": 7.75, "S7": 26.2, "S8": 29.67, "S9": 82.98}
# The batch N of those gen-128 runs, as ML_ARTIFACT_N derives it (mtbench_moel_p_S6.jsonl,
# mtbench_moel_p_S7.jsonl, mtbench_moel_S8.jsonl, mtbench_moel_S9.jsonl).
ML_SCALING_N = {"S6": 252, "S7": 540, "S8": 2244, "S9": 2440}

KLOTSKI = "Klotski (Fang et al., ASPLOS 2025)"
# Table 3 (ablation, tokens/s): environment / model -> row -> throughput. Prompt 512, gen 32 (§9.1);
# n = 15 (n = 10 for Mixtral-8x22B on Env1) as §9.2 runs the end-to-end comparison.
KLOTSKI_TABLE3: dict[tuple[str, str], dict[str, float]] = {
    ("Env1", "mixtral-8x7b"): {"Simple pipeline": 5.721, "+ Multi batches": 18.24,
                               "+ Only prefetch hot experts": 19.074, "Klotski (+ adjust order)": 22.414,
                               "Klotski (q)": 22.604},
    ("Env1", "mixtral-8x22b"): {"Simple pipeline": 0.01, "+ Multi batches": 0.97,
                                "+ Only prefetch hot experts": 1.127, "Klotski (+ adjust order)": 1.325,
                                "Klotski (q)": 1.366},
    ("Env2", "mixtral-8x22b"): {"Simple pipeline": 1.149, "+ Multi batches": 34.07,
                                "+ Only prefetch hot experts": 44.17, "Klotski (+ adjust order)": 52.85,
                                "Klotski (q)": 53.125},
}  # fmt: skip
KLOTSKI_GROUP = {("Env1", "mixtral-8x7b"): 15, ("Env1", "mixtral-8x22b"): 10, ("Env2", "mixtral-8x22b"): 15}

COLLAB = "CPU-GPU collaborative inference with an LRU expert cache (RTX 4090 + Threadripper 7960X)"
THREADS = (1, 2, 4, 8, 16, 24)


@frozen
class CollabModel:
    """One model of the collaborative-inference paper: its measured CPU times and end-to-end figures."""

    expert_ms: dict[int, float]  # Table III: CPU time per OMP_NUM_THREADS (ms); see lru_cache.threads_host
    power: dict[int, tuple[float, float]]  # Table IV: (CPU, GPU) watts of "ours" per thread count
    joules: dict[int, float]  # Table V: joules per token of "ours" per thread count
    prefetch: tuple[tuple[float, float], float]  # Tables IV and V: Pre-gated (prefetching) W and J/token
    over_prefetch: float  # §I / §IV-B: the quoted best speedup over prefetching (24 threads)
    best: float  # §I / §V: the quoted best tokens/s

    def ours(self, threads: int) -> float:
        """Tokens/s = power / energy per token (Tables IV and V)."""
        return sum(self.power[threads]) / self.joules[threads]

    @property
    def prefetch_tps(self) -> float:
        return sum(self.prefetch[0]) / self.prefetch[1]


COLLAB_MODELS = {
    "mixtral-8x7b": CollabModel(
        {1: 44.12, 2: 25.53, 4: 18.34, 8: 15.76, 16: 10.96, 24: 7.34},
        {1: (86.1, 91.6), 2: (91.7, 92.8), 4: (100.3, 101.0), 8: (111.0, 103.4), 16: (133.4, 99.6),
         24: (147.5, 97.9)},
        {1: 177.7, 2: 115.3, 4: 95.8, 8: 82.5, 16: 55.5, 24: 51.1},
        ((92.1, 96.3), 171.3), 4.4, 4.8),
    "phi-3.5-moe": CollabModel(
        {1: 22.73, 2: 12.80, 4: 8.58, 8: 6.39, 16: 3.92, 24: 3.36},
        {1: (84.4, 97.4), 2: (88.4, 100.7), 4: (92.0, 105.9), 8: (98.4, 109.2), 16: (110.1, 106.0),
         24: (118.3, 109.2)},
        {1: 49.1, 2: 33.8, 4: 26.7, 8: 25.9, 16: 22.1, 24: 21.9},
        ((88.2, 100.7), 78.7), 4.3, 10.4),
}  # fmt: skip
COLLAB_OVER_FIDDLER = 1.6  # §IV-B: "surpassing Fiddler by approximately 1.6x" (Mixtral-8x7B, 24 cores)
COLLAB_29_2_CAP = 2.2  # §IV-B: "(29,2) caps performance at around 2.2 tokens/second" (8-24 cores)
COLLAB_OVER_CPU_ONLY = (1.15, 1.35)  # §IV-B: "approximately 15% ~ 35%" over CPU only, Mixtral-8x7B
COLLAB_SLOTS = 56  # §III-B: about 56 Mixtral-8x7B expert slots in the RTX 4090's 24 GB

PREGATED = "Pre-gated MoE (Hwang et al., ISCA 2024)"
# §VI-A, Fig. 11: single-request throughput on an A100 (32 GB/s PCIe, §V). Switch-Base = the average
# over its 8/64/128-expert configurations; ratios are Pre-gated over the baseline.
PREGATED_SWITCH = {  # Table I: experts, layers (d_model, d_ff, heads from the SwitchTransformer configs)
    "switch-base-8": (8, 12, 768, 3072, 12),
    "switch-base-64": (64, 12, 768, 3072, 12),
    "switch-base-128": (128, 12, 768, 3072, 12),
    "switch-large-128": (128, 24, 1024, 4096, 16),
}
PREGATED_BASE = {"Pre-gated": 111.0, "over MoE-OnDemand": 1.5, "over MoE-Prefetch": 27.0, "of GPU-only": 0.81}
PREGATED_BASE_MAX = {"over MoE-OnDemand": 1.6, "over MoE-Prefetch": 55.0}  # the maxima §VI-A gives with them
PREGATED_LARGE = {"Pre-gated": 42.0, "over MoE-OnDemand": 1.6, "over MoE-Prefetch": 52.0}

FIDDLER = "Fiddler (Kamahori et al., ICLR 2025)"
# Appendix C: expected hit rate of experts kept on the GPU (56 of 256 on Env1, 125 of 256 on Env2):
# the most popular (profiled) and a random choice.
FIDDLER_HIT = {"Env1": (56, 0.252, 0.219), "Env2": (125, 0.530, 0.488)}
