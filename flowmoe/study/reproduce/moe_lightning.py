"""MoE-Lightning's settings: MTBench per generation length and HELM tasks on S1 and S2 against
FlexGen and DeepSpeed, Table 5's policies, and §5.3's scaling from two GPUs to four."""

from __future__ import annotations

from collections.abc import Iterator

from attrs import evolve

from flowmoe.core.plan import Op
from flowmoe.core.policy import Place, Policy
from flowmoe.core.policy_search import search
from flowmoe.core.presets import preset
from flowmoe.study.best_policy import Given
from flowmoe.study.reproduce import paper_numbers as P
from flowmoe.study.reproduce.setting import Setting, Speedup, System, pageable, paper_setup, ratios_from
from flowmoe.study.simulate import Setup, Simulation

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


def _flexgen(mu: int, count: int, percent: int, attention: Place = "gpu") -> Policy:
    return Policy(mu, count, attention, "gpu", weights_gpu_share=percent / 100, kv_gpu_share=0.0)


def _moe_lightning(setup: Setup, machine: str) -> Setup:
    """The setup of MoE-Lightning's own runs on `machine`: pageable weights staged through pinned
    buffers, its KV cache in SGLang's token pool (the artifact's `token_to_kv_pool`: each request's
    own tokens, not its micro-batch's longest), and its Triton kernels' rate on a Turing GPU
    (TRITON_ON_TURING)."""
    setup = evolve(pageable(setup), kv_pool=True)
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
            real, padded = (
                paper_setup(spec, hw, "mtbench", gen),
                paper_setup(spec, hw, f"fixed:418:{gen}", gen),
            )
            ml, ml_padded = _moe_lightning(real, machine), _moe_lightning(padded, machine)
            unpinned = pageable(padded)
            mu, count, percent = P.ML_FLEXGEN_POLICY[(machine, gen)]
            n, n_padded = (P.ML_ARTIFACT_N[(machine, ml_name)][i] for ml_name in P.ML_SYSTEMS)
            # One server per setting runs every generation length (the artifact's launch_server.sh plans
            # once, at --gen-len 256): S1's logs hold Table 5's N = 504 at each, so its μ = 36 too.
            ml_mu = P.ML_TABLE5["MoE-Lightning(p)"][1] if machine == "S1" else None
            systems: tuple[System, ...] = (
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
                ratios_from(systems, ML_PAIRS),
                "MoE-Lightning's policy: N as its artifact ran it, μ the HRM plan's (Table 5's 36 for "
                f"MoE-Lightning(p) on S1); DeepSpeed (Zero-Inference): {DEEPSPEED} at "
                "its best single-batch policy; padded systems run every prompt at 418 tokens",
            )
        for task, gen, prompt in (("reasoning", 50, 256), ("summarization", 64, 1984)):
            if quick:
                continue
            table = P.ML_TABLE4[(machine, task)]
            padded = paper_setup(spec, hw, f"fixed:{prompt}:{gen}", gen)
            unpinned, ml_padded = pageable(padded), _moe_lightning(padded, machine)
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
                ratios_from(systems, ML_PAIRS),
                "μ and N/μ as Table 4 states; the fields it does not state from each scheduler's search",
            )
    s1 = paper_setup(spec, ML_MACHINE["S1"], "fixed:418:128", 128)
    rows = [(name, *figures) for name, figures in P.ML_TABLE5.items()]
    systems = tuple(
        System(
            name,
            "cgopipe" if name.startswith("MoE") else "flexgen",
            _moe_lightning(s1, "S1") if name.startswith("MoE") else pageable(s1),
            tps,
            given=Given(mu * -(-n // mu), -(-n // mu)) if name.startswith("MoE") else Given(),
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
        ratios_from(systems, pairs),
        "FlexGen's weight share: 8% as its S1 gen-128 script",
    )
    for (small, large), (low, high) in P.ML_SCALING.items():
        if quick:
            continue
        model = preset("mixtral-8x22b" if small == "S6" else "dbrx")
        work = "fixed:418:128" if small == "S6" else "mtbench"
        name = "MoE-Lightning(p)" if small == "S6" else "MoE-Lightning"
        two, four = (_moe_lightning(paper_setup(model, ML_MACHINE[m], work, 128), m) for m in (small, large))
        at_128, runs = P.ML_SCALING_GEN128, P.ML_SCALING_N
        systems = (
            System(f"{name} {large}", "cgopipe", four, at_128[large], _as_run(four, runs[large])),
            System(f"{name} {small}", "cgopipe", two, at_128[small], _as_run(two, runs[small])),
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
