"""`flowmoe reproduce`: the five papers' published numbers next to the simulator's, setting by setting.

A setting is one published configuration (machine, model, workload) and the systems the paper ran
on it, each mapped to the flowmoe scheduler that stands in for it and to the policy the paper states
(μ, N/μ, weight share) or, where it states none, the best policy that fits that scheduler
(`best_policy`, the search `flowmoe simulate` runs). Every number compared is in
`paper_numbers` with its table or figure. For each setting the report gives the paper's and the
simulated figure per system with their ratio and the lane that bounds the run, the speedups between
systems (paper vs simulated), and whether the simulated ranking equals the paper's. Nothing here is
tuned to a published end-to-end number; machines are the hardware presets of the papers' hosts, and
the collaborative-inference host per thread count takes its CPU expert time from that paper's own
microbenchmark (Table III), not from its end-to-end results.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from attrs import Factory, evolve, frozen

from flowmoe.core.errors import FlowmoeError
from flowmoe.core.hardware import HardwareSpec, hardware
from flowmoe.core.plan import Op
from flowmoe.core.policy import Policy
from flowmoe.core.policy_search import search
from flowmoe.core.presets import preset
from flowmoe.core.spec import ModelSpec
from flowmoe.core.synthetic_routing import RoutingModel
from flowmoe.core.workloads import workload
from flowmoe.study import paper_numbers as P
from flowmoe.study.best_policy import Given, best_policy, describe_policy
from flowmoe.study.sim_report import SimulationResult
from flowmoe.study.simulate import Setup, Simulation

SUCCESSORS = ("moe-gen", "hybrimoe", "ktransformers", "fate")  # their settings: reproduce_successors
PAPERS = ("moe-lightning", "klotski", "lru-cache", "pre-gated", "fiddler", *SUCCESSORS)
ROUTING = RoutingModel(skew=0.5, correlation=0.3)  # flowmoe's defaults (`flowmoe simulate`)


@frozen
class System:
    """One system of a setting: the flowmoe scheduler standing in for it, on which setup, the policy
    (None: the scheduler's best that fits `given`), and its published figure (None: none given)."""

    name: str
    scheduler: str
    setup: Setup
    published: float | None
    policy: Policy | None = None
    given: Given = Factory(Given)
    metric: str = "tok/s"  # or "hit rate"
    profile: bool = True  # False: the scheduler gets no routing profile (popularity)
    cache_sweep: bool = False  # lru-cache: the fastest of `cache_configs`, as the paper picks
    implied: float | None = None  # a figure the paper gives only as a ratio to another: ranking only


@frozen
class Speedup:
    """A published ratio between two systems of a setting (faster / slower); with `over`, a
    statistic ("mean" or "max") of the ratios of those (faster, slower) pairs, as a paper averages
    a speedup over its configurations (`faster` and `slower` then only label it)."""

    faster: str
    slower: str
    published: float
    low: float | None = None  # where the paper gives a range
    high: float | None = None
    over: tuple[tuple[str, str], ...] = ()
    statistic: Literal["mean", "max"] = "mean"


@frozen
class Mean:
    """A published average of several systems' figures (a paper's "average over all
    configurations"), compared with the mean of their simulated figures."""

    name: str
    of: tuple[str, ...]
    published: float


@frozen
class Setting:
    paper: str
    name: str
    where: str
    systems: tuple[System, ...]
    speedups: tuple[Speedup, ...] = ()
    note: str = ""
    means: tuple[Mean, ...] = ()


def _setup(
    spec: ModelSpec, hw: HardwareSpec | str, work: str, gen: int | None = None, samples: int = 2
) -> Setup:
    w = workload(work)
    hw = hardware(hw) if isinstance(hw, str) else hw
    return Setup(spec, hw, w.with_gen_len(gen) if gen else w, Policy(), ROUTING, decode_samples=samples)


def _unpinned(setup: Setup) -> Setup:
    """The setup for a system whose CPU weights are pageable: MoE-Lightning stages its pages through
    pinned buffers (Appendix A: "weights are first moved from CPU memory to pinned memory"), and its
    FlexGen port builds its policy with `pin_weight=False` (artifact
    benchmarks/flexgen/mtbench_run_8x7b_moe.py). DeepSpeed Zero-Inference pins them (§5.1)."""
    return evolve(setup, weights_pinned=False)


def _ratios_from(systems: Sequence[System], pairs: Sequence[tuple[str, str]]) -> tuple[Speedup, ...]:
    figure = {s.name: s.published for s in systems}
    return tuple(Speedup(a, b, figure[a] / figure[b]) for a, b in pairs if figure.get(a) and figure.get(b))


# MoE-Lightning ------------------------------------------------------------------------------------

ML_MACHINE = {
    "S1": "moe-lightning-s1",
    "S2": "moe-lightning-s2",
    "S6": "moe-lightning-s6",
    "S7": "moe-lightning-s7",
    "S8": "moe-lightning-s6",
    "S9": "moe-lightning-s7",
}
ML_TURING = ("S1", "S6", "S7", "S8", "S9")  # Table 2: T4s (compute capability 7.5); S2's L4 is 8.9
# MoE-Lightning's experts run vLLM's fused_moe (fastmoe/layers/stacked_fused_moe.py) and its prefill
# attention lightllm's context_flashattention_nopad: Triton kernels, under the torch 2.1.2 its
# pyproject.toml pins (Triton 2.1). Triton 2.x lowers tl.dot below compute capability 8.0 to Volta's
# MMA (computeCapabilityToMMAVersion: < 80 -> version 1; lib/Dialect/TritonGPU/Transforms/
# AccelerateMatmul.cpp), and on an RTX 2080 (sm_75, Turing like the T4) Triton's fp16 matmul reached
# 24 of cuBLAS's 45-46 TFLOPS from 3072^3 to 6016^3 (triton-lang/triton#189): 0.53 of what the
# preset's GEMM efficiency (a cuBLAS figure) gives. Its projections are cuBLAS (torch) and stay at 1.
TRITON_ON_TURING = ((Op.EXPERT_FFN, 0.53), (Op.GPU_ATTN, 0.53))
ML_PAIRS = (
    ("MoE-Lightning", "FlexGen"),
    ("MoE-Lightning(p)", "FlexGen"),
    ("MoE-Lightning(p)", "FlexGen(c)"),
    ("MoE-Lightning(p)", "DeepSpeed"),
    ("FlexGen", "FlexGen(c)"),
)


# DeepSpeed Zero-Inference (ZeRO stage 3, parameters offloaded to pinned CPU memory): each module's
# parameters are gathered to the GPU by a pre-forward hook and released after its forward, fetching
# ahead at most stage3_prefetch_bucket_size = 5e7 elements by default (deepspeed/runtime/zero/
# config.py: "maximum number of parameter elements to fetch ahead of use ... ZeRO-Inference"), less
# than one Mixtral expert (176M): an expert is fetched once the gate has called it, the next one's
# copy under its compute, not two whole layers held (Table 4 runs it at μ = 102 on a 16 GB T4).
DEEPSPEED = "on-demand"


def _flexgen(mu: int, count: int, percent: int, attention: str = "gpu") -> Policy:
    return Policy(mu, count, attention, "gpu", weights_gpu_share=percent / 100, kv_gpu_share=0.0)  # type: ignore[arg-type]


def _moe_lightning(setup: Setup, machine: str) -> Setup:
    """The setup of MoE-Lightning's own runs on `machine`: pageable weights staged through pinned
    buffers, its KV cache in SGLang's token pool (the artifact's `token_to_kv_pool`: each request's
    own tokens, not its micro-batch's longest), and its Triton kernels' rate on a Turing GPU
    (TRITON_ON_TURING)."""
    setup = evolve(_unpinned(setup), kv_pool=True)
    return evolve(setup, kernel_share=TRITON_ON_TURING) if machine in ML_TURING else setup


def _as_run(setup: Setup, n: int, mu: int | None = None) -> Policy:
    """MoE-Lightning's policy at the batch N its artifact ran (P.ML_ARTIFACT_N): μ as the paper
    states it or else the HRM plan's, N/μ micro-batches; the plan at that cap (`_planned`) where
    cgopipe's own accounting does not take N."""
    plan = search(setup.spec, setup.hardware, setup.workload, max_batch=n).best.policy
    count = -(-n // (mu or plan.micro_batch_size))
    policy = evolve(plan, micro_batch_size=-(-n // count), micro_batches=count)
    if Simulation(evolve(setup, policy=policy, decode_samples=1)).refusal("cgopipe") is None:
        return policy
    return _planned(setup, n)


def _planned(setup: Setup, cap: int) -> Policy:
    """MoE-Lightning's policy: its HRM planner's best, N capped at `cap` and halved until cgopipe's
    own accounting (GPU and host memory of the sampled batch) takes it."""
    while True:
        policy = search(setup.spec, setup.hardware, setup.workload, max_batch=cap).best.policy
        if cap == 1 or Simulation(evolve(setup, policy=policy, decode_samples=1)).refusal("cgopipe") is None:
            return policy
        cap = max(1, policy.batch_size // 2)


def moe_lightning(quick: bool) -> Iterator[Setting]:
    spec = preset("mixtral-8x7b")
    for machine in ("S1", "S2"):
        hw = ML_MACHINE[machine]
        for i, gen in enumerate(P.GENS):
            if quick and gen != 128:
                continue
            paper = {name: figures[i] for name, figures in P.ML_MTBENCH[machine].items()}
            real, padded = _setup(spec, hw, "mtbench", gen), _setup(spec, hw, f"fixed:418:{gen}", gen)
            ml, ml_padded = _moe_lightning(real, machine), _moe_lightning(padded, machine)
            unpinned = _unpinned(padded)
            mu, count, percent = P.ML_FLEXGEN_POLICY[(machine, gen)]
            n, n_padded = (P.ML_ARTIFACT_N[(machine, ml_name)][i] for ml_name in P.ML_SYSTEMS)
            # One server per setting runs every generation length (the artifact's launch_server.sh plans
            # once, at --gen-len 256): S1's logs hold Table 5's N = 504 at each, so its μ = 36 too.
            ml_mu = P.ML_TABLE5["MoE-Lightning(p)"][1] if machine == "S1" else None
            systems = (
                System("MoE-Lightning", "cgopipe", ml, paper["MoE-Lightning"], _as_run(ml, n)),
                System(
                    "MoE-Lightning(p)",
                    "cgopipe",
                    ml_padded,
                    paper["MoE-Lightning(p)"],
                    _as_run(ml_padded, n_padded, ml_mu),
                ),
                System("FlexGen", "flexgen", unpinned, paper["FlexGen"], _flexgen(mu, count, percent)),
                System(
                    "FlexGen(c)",
                    "flexgen",
                    unpinned,
                    paper["FlexGen(c)"],
                    _flexgen(mu, count, percent, "cpu"),
                ),
                System("DeepSpeed", DEEPSPEED, padded, paper["DeepSpeed"], given=Given(micro_batches=1)),
            )
            yield Setting(
                "moe-lightning",
                f"MTBench gen {gen} @ {machine}",
                f"{P.ML}, {P.ML_FIG7}",
                systems,
                _ratios_from(systems, ML_PAIRS),
                "MoE-Lightning's policy: N as its artifact ran it, μ the HRM plan's (Table 5's 36 for "
                f"MoE-Lightning(p) on S1); DeepSpeed (Zero-Inference): {DEEPSPEED} at "
                "its best single-batch policy; padded systems run every prompt at 418 tokens",
            )
        for task, gen, prompt in (("reasoning", 50, 256), ("summarization", 64, 1984)):
            if quick:
                continue
            table = P.ML_TABLE4[(machine, task)]
            padded = _setup(spec, hw, f"fixed:{prompt}:{gen}", gen)
            unpinned, ml_padded = _unpinned(padded), _moe_lightning(padded, machine)
            percent = P.ML_FLEXGEN_POLICY[(machine, task)][2]

            mlp, flexgen, flexgen_c, deepspeed = (
                table[name] for name in ("MoE-Lightning(p)", "FlexGen", "FlexGen(c)", "DeepSpeed")
            )
            systems = (
                System(
                    "MoE-Lightning(p)",
                    "cgopipe",
                    ml_padded,
                    mlp.throughput,
                    given=Given(mlp.micro_batch * mlp.micro_batches, mlp.micro_batches),
                ),
                System(
                    "FlexGen",
                    "flexgen",
                    unpinned,
                    flexgen.throughput,
                    _flexgen(flexgen.micro_batch, flexgen.micro_batches, percent),
                ),
                System(
                    "FlexGen(c)",
                    "flexgen",
                    unpinned,
                    flexgen_c.throughput,
                    _flexgen(flexgen_c.micro_batch, flexgen_c.micro_batches, percent, "cpu"),
                ),
                System(
                    "DeepSpeed",
                    DEEPSPEED,
                    padded,
                    deepspeed.throughput,
                    given=Given(deepspeed.micro_batch, 1),
                ),
            )
            yield Setting(
                "moe-lightning",
                f"HELM {task} @ {machine}",
                f"{P.ML}, Table 4",
                systems,
                _ratios_from(systems, ML_PAIRS),
                "μ and N/μ as Table 4 states; the fields it does not state from each scheduler's search",
            )
    s1 = _setup(spec, ML_MACHINE["S1"], "fixed:418:128", 128)
    rows = [(name, *figures) for name, figures in P.ML_TABLE5.items()]
    systems = tuple(
        System(
            name,
            "cgopipe" if name.startswith("MoE") else "flexgen",
            _moe_lightning(s1, "S1") if name.startswith("MoE") else _unpinned(s1),
            tps,
            given=Given(mu * -(-n // mu), -(-n // mu)) if name.startswith("MoE") else None,
            policy=None if name.startswith("MoE") else _flexgen(mu, -(-n // mu), 8),
        )
        for name, tps, mu, n in rows
    )
    pairs = [(name, "FlexGen w/ their policy") for name, *_ in rows[1:]]
    yield Setting(
        "moe-lightning",
        "MTBench gen 128 @ S1, policies",
        f"{P.ML}, Table 5",
        systems,
        _ratios_from(systems, pairs),
        "FlexGen's weight share: 8% as its S1 gen-128 script",
    )
    for (small, large), (low, high) in P.ML_SCALING.items():
        if quick:
            continue
        model = preset("mixtral-8x22b" if small == "S6" else "dbrx")
        work = "fixed:418:128" if small == "S6" else "mtbench"
        name = "MoE-Lightning(p)" if small == "S6" else "MoE-Lightning"
        two, four = (_moe_lightning(_setup(model, ML_MACHINE[m], work, 128), m) for m in (small, large))
        at_128, n = P.ML_SCALING_GEN128, P.ML_SCALING_N
        systems = (
            System(f"{name} {large}", "cgopipe", four, at_128[large], _as_run(four, n[large])),
            System(f"{name} {small}", "cgopipe", two, at_128[small], _as_run(two, n[small])),
        )
        ratio = Speedup(systems[0].name, systems[1].name, at_128[large] / at_128[small], low, high)
        yield Setting(
            "moe-lightning",
            f"{model.name} MTBench gen 128, {large} over {small}",
            f"{P.ML}, §5.3 (Fig. 7 S6/S7, Fig. 8 S8/S9)",
            systems,
            (ratio,),
            f"published as a range {low}-{high}x over generation lengths; gen 128 (its bars) simulated",
        )


# Klotski ------------------------------------------------------------------------------------------

KLOTSKI_MACHINE = {"Env1": "klotski-env1", "Env2": "klotski-env2"}
# Per-micro-batch size: Table 3 does not state it (§9.1: batch sizes 4-64; §7: "typically a multiple of
# 4"); 8 is the default of Klotski's public code (mindspore-lab/models research/SYSU/Klotski/main.py,
# --gpu-batch-size 8) and the batch size of its correlation-table warm-up (§8).
KLOTSKI_MICRO_BATCH = 8


def klotski(quick: bool) -> Iterator[Setting]:
    for (env, model), rows in P.KLOTSKI_TABLE3.items():
        if quick and model != "mixtral-8x7b":
            continue
        spec, n = preset(model), P.KLOTSKI_GROUP[(env, model)]
        setup = _setup(spec, KLOTSKI_MACHINE[env], "fixed:512:32", 32)
        # §6.1: "when sufficient CPU memory is available, we use pin_memory"; where the model does not
        # fit host memory (Env1, Mixtral-8x22B) the CPU weights stay pageable.
        if spec.total_bytes > setup.hardware.cpu_memory:
            setup = _unpinned(setup)
        # §9.5's simple pipeline, the ablation's first step in Klotski's own framework (its disk tier
        # included): one batch, the whole next MoE layer prefetched while the current one computes.
        one = Policy(KLOTSKI_MICRO_BATCH, 1, weights_gpu_share=0.0, kv_gpu_share=0.0, group_size=1)
        one = evolve(one, hot_experts=spec.moe.experts)
        # §6.1's adaptive placement: the GPU memory the pipeline leaves free keeps weights (and KV)
        # there, so the weight and KV shares are the search's largest that fit; no quantization.
        many = Given(KLOTSKI_MICRO_BATCH * n, n, group_size=n, expert_format="native")
        systems = (
            System("Simple pipeline", "klotski", setup, rows["Simple pipeline"], one),
            System(
                "+ Multi batches",
                "klotski",
                setup,
                rows["+ Multi batches"],
                given=evolve(many, hot_experts=spec.moe.experts),
            ),
            System(
                "Klotski (+ adjust order)", "klotski", setup, rows["Klotski (+ adjust order)"], given=many
            ),
        )
        pairs = [
            ("Klotski (+ adjust order)", "Simple pipeline"),
            ("+ Multi batches", "Simple pipeline"),
            ("Klotski (+ adjust order)", "+ Multi batches"),
        ]
        yield Setting(
            "klotski",
            f"Table 3 {env} {model}",
            f"{P.KLOTSKI}, Table 3",
            systems,
            _ratios_from(systems, pairs),
            f"n = {n} micro-batches of {KLOTSKI_MICRO_BATCH} (assumed: the public code's default), "
            "prompt 512, gen 32; klotski's expert share on the GPU: the largest that fits (§6.1 "
            "adaptive placement), CPU weights pinned where the model fits host memory (§6.1); "
            "'Simple pipeline' = klotski with one batch (n = 1) prefetching every expert, "
            "'+ Multi batches' = klotski prefetching every expert (K = E); the rows '+ Only "
            "prefetch hot experts' (klotski always reorders) and 'Klotski (q)' (no quantization) "
            "are not expressible",
        )


# CPU-GPU collaborative inference (lru-cache) -------------------------------------------------------

COLLAB_WORK = "fixed:32:64"  # assumed: the paper runs single requests and states no lengths
FIDDLER_THREADS = 16  # the CPU threads Fiddler's code sets (efeslab/fiddler, torch.set_num_threads(16))
WAYS = (2, 4, 8)  # the cache configurations tried: (indexes, ways) of the slots (§III-B, Fig. 5)


def cache_configs(spec: ModelSpec) -> tuple[tuple[int, int], ...]:
    """(indexes, ways) for each of WAYS: the slots of §III-B's formula, S = available GPU memory /
    expert size, with the memory that holds 56 Mixtral-8x7B experts; at most one index per layer."""
    slots = P.COLLAB_SLOTS * preset("mixtral-8x7b").expert_bytes // spec.expert_bytes
    return tuple((min(spec.layers, slots // ways), ways) for ways in WAYS)


def threads_host(threads: int, spec: ModelSpec, model: P.CollabModel) -> HardwareSpec:
    """The collaborative-inference host with its CPU at `threads` OpenMP threads: the bytes of a
    layer's top-k experts over the paper's measured CPU time (Table III, "Mixtral 8x7B FFN" in its
    Table I). Read per expert instead, its own §IV-B statements could not hold (CPU-only ahead of
    prefetching at 2-4 threads, its cache 15-35% over CPU-only), so the time is read per layer."""
    hw = hardware("collab-4090")
    rate = spec.moe.top_k * spec.expert_bytes / (model.expert_ms[threads] / 1e3)
    return evolve(hw, name=f"collab-4090 ({threads} threads)", cpu_gemm_efficiency=rate / hw.cpu_bandwidth)


def collab_specs() -> tuple[list[tuple[str, ModelSpec]], str]:
    """The paper's models flowmoe can express, and a note on the one it cannot (no model family)."""
    specs = [("mixtral-8x7b", preset("mixtral-8x7b"))]
    try:
        specs.append(("phi-3.5-moe", preset("phi-3.5-moe")))
    except FlowmoeError as exc:
        return specs, f"Phi-3.5-MoE (Fig. 5b, Tables III-V) not run: {exc}"
    return specs, "Phi-3.5-MoE's slots from §III-B's formula (the memory of 56 Mixtral experts)"


def lru_cache(quick: bool) -> Iterator[Setting]:
    specs, phi = collab_specs()
    for key, spec in specs[:1] if quick else specs:
        model, mixtral = P.COLLAB_MODELS[key], key == "mixtral-8x7b"
        for threads in (24,) if quick else P.THREADS:
            yield _collab_setting(key, spec, model, threads, mixtral, phi)


def _collab_setting(
    key: str, spec: ModelSpec, model: P.CollabModel, threads: int, mixtral: bool, phi: str
) -> Setting:
    setup = _setup(spec, threads_host(threads, spec, model), COLLAB_WORK, samples=8)
    one = Policy(1, 1, weights_gpu_share=0.0, cpu_threads=threads)
    ours = model.ours(threads)
    systems = [
        System("Ours (best cache)", "lru-cache", setup, ours, one, cache_sweep=True),
        System("Prefetching (Pre-gated)", "pre-gated", setup, model.prefetch_tps, one),
    ]
    speedups = [Speedup("Ours (best cache)", "Prefetching (Pre-gated)", ours / model.prefetch_tps)]
    if mixtral:  # §IV-B's CPU-only, Fiddler and (29, 2) figures are Mixtral-8x7B's
        middle = sum(P.COLLAB_OVER_CPU_ONLY) / 2
        cpu_only = evolve(one, ffn_on="cpu")
        systems.append(System("CPU only", "fiddler", setup, None, cpu_only, implied=ours / middle))
        speedups.append(Speedup("Ours (best cache)", "CPU only", middle, *P.COLLAB_OVER_CPU_ONLY))
    if mixtral and threads == 24:
        # Fiddler's generate() fixes PyTorch's CPU threads at 16 whatever the host offers, and computes
        # its CPU experts with PyTorch as the paper's own framework does (efeslab/fiddler,
        # src/fiddler/mixtral.py: torch.set_num_threads(16), run_expert_at_cpu): Table III at 16.
        at = FIDDLER_THREADS
        host = evolve(setup, hardware=threads_host(at, spec, model))
        fiddler = evolve(one, weights_gpu_share=56 / 256, cpu_threads=at)
        systems.append(System("Fiddler", "fiddler", host, ours / P.COLLAB_OVER_FIDDLER, fiddler))
        speedups.append(Speedup("Ours (best cache)", "Fiddler", P.COLLAB_OVER_FIDDLER))
        cache = evolve(one, expert_cache_slots=58, cache_ways=2)
        systems.append(System("Ours (29, 2)", "lru-cache", setup, P.COLLAB_29_2_CAP, cache))
    configs = ", ".join(map(str, cache_configs(spec)))
    return Setting(
        "lru-cache",
        f"{key}, {threads} CPU threads",
        f"{P.COLLAB}, Tables III-V, §IV-B",
        tuple(systems),
        tuple(speedups),
        f"batch 1, {COLLAB_WORK} (assumed); ours = the best of the cache configurations {configs} as "
        f"the paper picks per thread count; {phi}",
    )


# Pre-gated MoE ------------------------------------------------------------------------------------

# The artifact's runs (github.com/ranggihwang/Pregated_MoE, scripts/eval_all.py): FasterTransformer's
# examples/pytorch/t5/perf_benchmark.py at --batch_size 1, --seq_len 256 (input length = output
# length), fp32, --test_time 3 (sampling, beam 1, top-1); tokens/s = 256 generated / the whole run.
PREGATED_WORK = "fixed:256:256"
# The paper's pre-gate is trained and its choice is the decision (§IV-B): no expert is fetched on a
# miss, as flowmoe's speculative pre-gate does for a wrong prediction; so its predictions are exact.
PREGATED_ROUTING = evolve(ROUTING, pregate_accuracy=1.0)
SWITCH_SPARSE_STEP = 2  # Switch replaces every other FFN with experts (HF config: decoder_sparse_step=2)


def switch_standin(name: str) -> ModelSpec:
    """A decoder-only stand-in for SwitchTransformer (an encoder-decoder flowmoe has no family for):
    Table I's experts and layers, Switch's widths, top-1 routing, float32 as its checkpoints, and as in
    Switch every other layer's FFN experts (layers 1, 3, ...: 6 MoE layers in Switch-Base, 12 in
    Switch-Large, the artifact's `num_layer`), the others a dense FFN of d_ff. Switch's experts are two
    d x d_ff matrices; the stand-in's gated experts (three matrices) take 2/3 d_ff so each expert has
    Switch's bytes (the artifact's `size_per_expert`; Table I's capacities follow)."""
    experts, layers, hidden, ffn, heads = P.PREGATED_SWITCH[name]
    config = {
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": 32128,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": 64,
        "num_local_experts": experts,
        "num_experts_per_tok": 1,
        "intermediate_size": ffn * 2 // 3,
        "dtype": "float32",
        "max_position_embeddings": 2048,
    }
    spec = ModelSpec.from_hf(config)
    dense = tuple(i for i in range(layers) if i % SWITCH_SPARSE_STEP == 0)
    moe = evolve(spec.moe, dense_layers=dense, dense_intermediate=ffn * 2 // 3)
    return evolve(spec, name=f"{name} (decoder-only stand-in)", moe=moe)


PREGATED_NOTE = (
    f"batch 1, {PREGATED_WORK} as the artifact runs it; a decoder-only stand-in for Switch (flowmoe has no "
    "encoder-decoder family: the prompt's prefill stands in for the encoder, cross-attention is not modelled)"
)


def _pregated_systems(
    setup: Setup, paper: dict[str, float], suffix: str = "", own: bool = True
) -> tuple[System, ...]:
    """Pre-gated MoE and its three baselines on one Switch configuration. `own`: the paper's figures
    are this configuration's (Pre-gated's published, the baselines' implied by its speedups); else
    they are averages over configurations, so they only rank these (all implied); with `suffix`
    (the configuration's name in an averaged setting) none."""
    one = Policy(1, 1, weights_gpu_share=0.0)
    implied = {
        "Pre-gated MoE": paper["Pre-gated"],
        "MoE-OnDemand": paper["Pre-gated"] / paper["over MoE-OnDemand"],
        "MoE-Prefetch": paper["Pre-gated"] / paper["over MoE-Prefetch"],
        "GPU-only": paper["Pre-gated"] / paper["of GPU-only"] if "of GPU-only" in paper else None,
    }
    systems = (("Pre-gated MoE", "pre-gated", one), ("MoE-OnDemand", "on-demand", one),
               ("MoE-Prefetch", "prefetch-all", one),
               ("GPU-only", "eager", evolve(one, weights_gpu_share=1.0)))  # fmt: skip
    published = own and not suffix
    return tuple(
        System(
            f"{name}{suffix}",
            scheduler,
            setup,
            paper["Pre-gated"] if published and name == "Pre-gated MoE" else None,
            policy,
            implied=None if suffix or (published and name == "Pre-gated MoE") else implied[name],
        )
        for name, scheduler, policy in systems
    )


def _pregated_speedups(
    paper: dict[str, float], maxima: dict[str, float], names: Sequence[str]
) -> Iterator[Speedup]:
    """The paper's speedups of Pre-gated MoE: for one configuration (`names` empty), or its averages
    (and maxima) over the configurations `names` suffixes."""
    for key in ("over MoE-OnDemand", "over MoE-Prefetch", "of GPU-only"):
        if key not in paper:
            continue
        slower = key.split(" ", 1)[1]
        if not names:
            yield Speedup("Pre-gated MoE", slower, paper[key])
            continue
        pairs = tuple((f"Pre-gated MoE{n}", f"{slower}{n}") for n in names)
        yield Speedup("Pre-gated MoE", f"{slower} (mean over {len(names)})", paper[key], over=pairs)
        if key in maxima:
            yield Speedup("Pre-gated MoE", f"{slower} (max over {len(names)})", maxima[key], over=pairs,
                          statistic="max")  # fmt: skip


def pre_gated(quick: bool) -> Iterator[Setting]:
    """Switch-Large-128's figures are its own; Switch-Base's are the paper's averages (and maxima) over
    its configurations (§VI-A: "an average 111 tokens/sec throughput over all Switch-Base model
    configurations, an average 1.5x (max 1.6x) and 27x (max 55x) improvement"), so they are compared
    with the mean (and max) over the simulated configurations, each of which keeps its ranking."""
    base = ("switch-base-8",) if quick else ("switch-base-8", "switch-base-64", "switch-base-128")
    configurations = {name: _pregated_setup(name) for name in base}
    for name, setup in configurations.items():
        yield Setting(
            "pre-gated",
            f"Switch-Base: {name} (ranking)",
            f"{P.PREGATED}, §VI-A Fig. 11",
            _pregated_systems(setup, P.PREGATED_BASE, own=False),
            note=f"{PREGATED_NOTE}; the paper's figures are averages over the configurations: each "
            "configuration checks the ranking they imply, the averages are compared below",
        )
    suffixes = [f" ({name})" for name in configurations]
    systems = tuple(
        system
        for (name, setup), suffix in zip(configurations.items(), suffixes, strict=True)
        for system in _pregated_systems(setup, P.PREGATED_BASE, suffix)
    )
    yield Setting(
        "pre-gated",
        f"Switch-Base, mean over {len(suffixes)} configurations",
        f"{P.PREGATED}, §VI-A Fig. 11",
        systems,
        tuple(_pregated_speedups(P.PREGATED_BASE, P.PREGATED_BASE_MAX, suffixes)),
        PREGATED_NOTE,
        (
            Mean(
                "Pre-gated MoE (mean)",
                tuple(f"Pre-gated MoE{s}" for s in suffixes),
                P.PREGATED_BASE["Pre-gated"],
            ),
        ),
    )
    if quick:
        return
    large = _pregated_setup("switch-large-128")
    yield Setting(
        "pre-gated",
        "Switch-Large-128",
        f"{P.PREGATED}, §VI-A Fig. 11",
        _pregated_systems(large, P.PREGATED_LARGE),
        tuple(_pregated_speedups(P.PREGATED_LARGE, {}, ())),
        PREGATED_NOTE,
    )


def _pregated_setup(name: str) -> Setup:
    return evolve(
        _setup(switch_standin(name), "pregated-a100", PREGATED_WORK, samples=6), routing=PREGATED_ROUTING
    )


# Fiddler ------------------------------------------------------------------------------------------


def fiddler(quick: bool) -> Iterator[Setting]:
    spec = preset("mixtral-8x7b")
    for env, (kept, best, random) in P.FIDDLER_HIT.items():
        if quick and env != "Env1":
            continue
        setup = _setup(spec, f"fiddler-{env.lower()}", "fixed:128:64", samples=8)
        policy = Policy(1, 1, weights_gpu_share=kept / 256)
        systems = (
            System("popular experts (profiled)", "fiddler", setup, best, policy, metric="hit rate"),
            System("random experts", "fiddler", setup, random, policy, metric="hit rate", profile=False),
        )
        yield Setting(
            "fiddler",
            f"hit rate, {env} ({kept} of 256 experts on the GPU)",
            f"{P.FIDDLER}, Appendix C",
            systems,
            (),
            "synthetic routing (flowmoe's default skew 0.5); 'random' = no routing profile",
        )


BUILDERS: dict[str, Callable[[bool], Iterator[Setting]]] = {
    "moe-lightning": moe_lightning,
    "klotski": klotski,
    "lru-cache": lru_cache,
    "pre-gated": pre_gated,
    "fiddler": fiddler,
}


def settings(paper: str, quick: bool = False) -> list[Setting]:
    from flowmoe.study.reproduce_successors import SUCCESSOR_BUILDERS  # builds on this module's types

    builders = {**BUILDERS, **SUCCESSOR_BUILDERS}
    names = PAPERS if paper == "all" else (paper,)
    return [s for name in names for s in builders[name](quick)]


# Running ------------------------------------------------------------------------------------------


_RECENT: dict[tuple[Any, ...], SimulationResult] = {}  # the last runs, for a setting that asks for one again
RECENT = 12  # runs kept (their traces dropped): a setting's systems and the next setting's


def run_system(system: System) -> SimulationResult:
    """The system's run, or the same run an earlier setting made (MoE-Gen's Table 7 prefill and its
    Table 6 decode are one run of each system, read twice)."""
    key = (system.scheduler, system.setup, system.policy, system.given, system.profile)
    if key not in _RECENT:
        _RECENT[key] = evolve(_run_system(system), trace=None)
        for old in list(_RECENT)[:-RECENT]:
            del _RECENT[old]
    return _RECENT[key]


def _run_system(system: System) -> SimulationResult:
    if system.policy is None:
        return best_policy(system.setup, system.scheduler, system.given)
    simulation = Simulation(evolve(system.setup, policy=system.policy))
    if not system.profile:
        simulation.popularity = None
    try:
        return simulation.run(system.scheduler)
    except FlowmoeError as exc:  # the scheduler refuses the policy (e.g. a placement its paper lacks)
        return simulation.failed(system.scheduler, str(exc))


def _best_cache(system: System) -> SimulationResult:
    """lru-cache at each cache configuration of the setting, the fastest (the paper's choice)."""
    base = system.policy
    assert base is not None
    results = [
        run_system(evolve(system, policy=evolve(base, expert_cache_slots=i * w, cache_ways=w)))
        for i, w in cache_configs(system.setup.spec)
    ]
    return max(results, key=lambda r: r.throughput)


def measured(system: System, result: SimulationResult) -> float | None:
    if result.error is not None:
        return None
    if system.metric == "hit rate":
        return result.stats.expert_cache_hit_rate if result.stats is not None else None
    if system.metric == "decode tok/s":  # the decode steps' tokens over their time
        decoded = result.generated - result.sequences
        return decoded / result.decode_seconds if result.decode_seconds else None
    if system.metric == "prefill tok/s":  # prompt tokens over the prefill time
        return result.prompt_tokens / result.prefill_seconds if result.prefill_seconds else None
    return result.throughput


def run_setting(setting: Setting) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for system in setting.systems:
        result = _best_cache(system) if system.cache_sweep else run_system(system)
        value = measured(system, result)
        busiest = max(result.lanes, key=lambda lane: lane.busy_seconds).lane if result.lanes else "-"
        rows.append(
            {
                "system": system.name,
                "scheduler": system.scheduler,
                "metric": system.metric,
                "published": system.published,
                "implied": system.implied,
                "simulated": value,
                "ratio": value / system.published if value is not None and system.published else None,
                "bound": busiest,
                "error": result.error,
                "policy": describe_policy(result.policy, system.scheduler),
            }
        )
    value = {r["system"]: r["simulated"] for r in rows}
    bound = {r["system"]: r["bound"] for r in rows}
    rows.extend(_mean_row(mean, value, bound) for mean in setting.means)
    speedups = []
    for s in setting.speedups:
        sim = _speedup(s, value)
        speedups.append(
            {
                "faster": s.faster,
                "slower": s.slower,
                "published": s.published,
                "low": s.low,
                "high": s.high,
                "simulated": sim,
                "ratio": sim / s.published if sim else None,
            }
        )
    return {
        "paper": setting.paper,
        "setting": setting.name,
        "where": setting.where,
        "note": setting.note,
        "rows": rows,
        "speedups": speedups,
        "ranking": ranking(rows),
    }


def _speedup(s: Speedup, value: dict[str, float | None]) -> float | None:
    """The simulated ratio of `s`: faster / slower, or the statistic of its pairs' ratios."""
    ratios = [(value.get(a), value.get(b)) for a, b in s.over or ((s.faster, s.slower),)]
    if not all(a and b for a, b in ratios):
        return None
    each = [a / b for a, b in ratios]  # type: ignore[operator]
    return max(each) if s.statistic == "max" else statistics.mean(each)


def _mean_row(mean: Mean, value: dict[str, float | None], bound: dict[str, str]) -> dict[str, Any]:
    """The row of a published average: the mean of its systems' figures, bound by what bounds them."""
    figures = [value.get(name) for name in mean.of]
    sim = statistics.mean(figures) if all(figures) else None  # type: ignore[type-var]
    return {
        "system": mean.name,
        "scheduler": "-",
        "metric": "tok/s",
        "published": mean.published,
        "implied": None,
        "simulated": sim,
        "ratio": sim / mean.published if sim else None,
        "bound": "/".join(sorted({bound.get(name, "-") for name in mean.of})),
        "error": None if sim else "a system it averages did not run",
        "policy": f"mean of {len(mean.of)}",
    }


def ranking(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The systems with a published (or implied) throughput, ordered by the paper and the simulator."""
    ranked = [r for r in rows if (r["published"] or r.get("implied")) and r["metric"] != "hit rate"]
    paper = [r["system"] for r in sorted(ranked, key=lambda r: -(r["published"] or r["implied"]))]
    sim = [r["system"] for r in sorted(ranked, key=lambda r: -(r["simulated"] or 0.0))]
    return {"paper": paper, "simulated": sim, "holds": paper == sim if len(paper) > 1 else None}


def summary(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians and worst cases over every compared number, against the issue's targets."""
    absolute = [r["ratio"] for s in results for r in s["rows"] if r["ratio"] and r["metric"] != "hit rate"]
    hits = [r["ratio"] for s in results for r in s["rows"] if r["ratio"] and r["metric"] == "hit rate"]
    speed = [x["ratio"] for s in results for x in s["speedups"] if x["ratio"]]
    rankings = [s["ranking"]["holds"] for s in results if s["ranking"]["holds"] is not None]
    missing = sum(
        1 for s in results for r in s["rows"] if r["published"] is not None and r["simulated"] is None
    )

    def spread(values: list[float]) -> dict[str, Any]:
        if not values:
            return {"count": 0}
        off = [max(v, 1 / v) for v in values]
        return {
            "count": len(values),
            "median": statistics.median(values),
            "median_off": statistics.median(off),
            "worst_off": max(off),
            "within_25": sum(o <= 1.25 for o in off),
            "within_35": sum(o <= 1.35 for o in off),
            "within_2x": sum(o <= 2 for o in off),
        }

    return {
        "absolute": spread(absolute),
        "speedups": spread(speed),
        "hit_rates": spread(hits),
        "rankings_held": sum(rankings),
        "rankings": len(rankings),
        "not_run": missing,
    }
