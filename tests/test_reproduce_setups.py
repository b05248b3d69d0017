"""`flowmoe reproduce` runs each paper's systems the way the paper ran them: MoE-Lightning's and its
FlexGen's CPU weights pageable (DeepSpeed's pinned, its experts fetched as ZeRO-3 gathers modules),
Pre-gated's Switch stand-in with experts every other layer predicted one MoE block ahead, Fiddler
at the CPU threads its code sets, Klotski's weights kept on the GPU where memory is left (§6.1)."""

from __future__ import annotations

from attrs import evolve

from flowmoe.core.executor import Span
from flowmoe.core.plan import Op
from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.schedulers.klotski import KlotskiOptions
from flowmoe.study.reproduce import paper_numbers as P
from flowmoe.study.reproduce import settings
from flowmoe.study.reproduce.lru_cache import FIDDLER_THREADS, threads_host
from flowmoe.study.reproduce.moe_lightning import DEEPSPEED, TRITON_ON_TURING
from flowmoe.study.reproduce.pre_gated import switch_standin
from flowmoe.study.reproduce.setting import paper_setup
from flowmoe.study.simulate import Setup, Simulation, simulate


def _spans(setup: Setup, name: str, step: int = 1) -> list[Span]:
    """One step of the setup's batch (default: its first decode step) simulated with scheduler
    `name`, on the setup's synthetic routing and the cost model of its hardware."""
    simulation = Simulation(setup)
    scheduler = simulation.scheduler(name)
    return simulate(scheduler, [simulation.steps[step]], simulation.trace, simulation.cost)


def test_moe_lightning_and_flexgen_weights_are_pageable_deepspeeds_pinned() -> None:
    systems = [s for setting in settings("moe-lightning", quick=True) for s in setting.systems]
    assert {s.scheduler for s in systems} >= {"cgopipe", "flexgen", DEEPSPEED}
    for system in systems:
        assert system.setup.weights_pinned is (system.name == "DeepSpeed"), system.name
    deepspeed = [s for s in systems if s.name == "DeepSpeed"]
    assert deepspeed and all(s.scheduler == "on-demand" for s in deepspeed)


def test_flexgen_copies_pageable_weights_at_the_pageable_rate() -> None:
    """The artifact's FlexGen builds its policy with pin_weight=False: every PAGE_COPY of an expert
    is pageable, and the cost model prices it at the pageable bandwidth (slower than pinned)."""
    base = paper_setup(preset("mixtral-8x7b", layers=2), "moe-lightning-s1", "fixed:64:2", 2)
    base = evolve(base, policy=Policy(8, 2, weights_gpu_share=0.25, kv_gpu_share=0.0))
    seconds = {}
    for pinned in (True, False):
        copies = [
            s for s in _spans(evolve(base, weights_pinned=pinned), "flexgen") if s.node.op is Op.PAGE_COPY
        ]
        assert copies and all(c.node.pageable is not pinned for c in copies)
        seconds[pinned] = sum(c.end - c.start for c in copies)
    assert seconds[False] > seconds[True]


def test_flexgen_c_attention_moves_the_cache_seven_times() -> None:
    """FlexGen's CPU attention copies the cached k, v (permute + reshape), casts them to float32 and
    reads them in bmm: 14 bytes per cached 2-byte element."""
    spec = preset("mixtral-8x7b", layers=2)
    setup = paper_setup(spec, "moe-lightning-s1", "fixed:64:2", 2)
    setup = evolve(setup, policy=Policy(8, 2, "cpu", weights_gpu_share=0.25, kv_gpu_share=0.0))
    for span in (s for s in _spans(setup, "flexgen") if s.node.op is Op.CPU_ATTN):
        node = span.node
        cache = 8 * 65 * 2 * spec.attention.kv_width * spec.dtype_bytes  # 8 sequences, 65 keys each
        rest = node.rows * (spec.attention.q_width + spec.attention.out_width) * spec.dtype_bytes
        assert node.bytes == 7 * cache + rest


def test_switch_standin_has_experts_every_other_layer_and_the_artifacts_lengths() -> None:
    """Switch-Base: 12 layers, 6 with experts (the artifact's num_layer), each expert 18,874,368 bytes
    (its size_per_expert); the runs are 256 tokens in, 256 out at batch 1."""
    spec = switch_standin("switch-base-8")
    assert [layer for layer in range(spec.layers) if spec.is_moe_layer(layer)] == [1, 3, 5, 7, 9, 11]
    assert spec.expert_bytes == 18874368
    large = switch_standin("switch-large-128")
    assert sum(large.is_moe_layer(layer) for layer in range(large.layers)) == 12
    (setting, *_) = settings("pre-gated", quick=True)
    setup = setting.systems[0].setup
    assert (setup.workload.gen_len, setup.routing.pregate_accuracy) == (256, 1.0)


def test_pre_gated_prefetches_the_next_moe_block_during_this_one() -> None:
    """Pre-gated MoE §IV-B: block N's pre-gate picks block N + 1's experts, so on Switch's layout the
    PREGATE of MoE layer 3 reads layer 1's state, and its copies are issued before the dense layer 2."""
    spec = switch_standin("switch-base-8")
    assert [spec.pregate_source(m) for m in (1, 3, 5)] == [0, 1, 3]
    setup = evolve(
        paper_setup(spec, "pregated-a100", "fixed:4:2", 2), policy=Policy(1, 1, weights_gpu_share=0.0)
    )
    spans = _spans(setup, "pre-gated")
    by_id = {s.node.id: s.node for s in spans}
    pregates = [s.node for s in spans if s.node.op is Op.PREGATE]
    assert sorted(p.layer for p in pregates) == [1, 3, 5, 7, 9, 11]
    for pregate in pregates:
        (post,) = [by_id[d] for d in pregate.deps]
        assert post.op is Op.POST_ATTN and post.layer == spec.pregate_source(pregate.layer)
    copies = [s.node for s in spans if s.node.op is Op.PAGE_COPY and s.node.layer == 3]
    dense = next(s.node for s in spans if s.node.op is Op.POST_ATTN and s.node.layer == 2)
    assert copies and all(by_id[c.deps[0]].op is Op.PREGATE and c.id < dense.id for c in copies)


def test_fiddler_runs_at_the_sixteen_threads_its_code_sets() -> None:
    (setting,) = [s for s in settings("lru-cache", quick=True) if s.name.startswith("mixtral-8x7b, 24")]
    by_name = {s.name: s for s in setting.systems}
    fiddler, ours = by_name["Fiddler"], by_name["Ours (best cache)"]
    assert fiddler.policy is not None and fiddler.policy.cpu_threads == FIDDLER_THREADS == 16
    sixteen = threads_host(16, preset("mixtral-8x7b"), P.COLLAB_MODELS["mixtral-8x7b"])
    assert fiddler.setup.hardware == sixteen
    assert fiddler.setup.hardware.cpu_gemm_efficiency < ours.setup.hardware.cpu_gemm_efficiency


def test_klotski_places_weights_by_the_search_without_quantization() -> None:
    """§6.1: the multi-batch rows keep what fits of the weights on the GPU (the search's shares), not
    quantized; §9.5's simple pipeline is klotski with one batch prefetching every expert."""
    (setting,) = settings("klotski", quick=True)
    simple, *multi, quantized = setting.systems
    assert simple.scheduler == "klotski" and simple.policy is not None
    assert (simple.policy.micro_batches, simple.policy.options_for(KlotskiOptions).hot_experts) == (1, 8)
    assert [s.scheduler for s in multi] == ["klotski", "klotski"]
    for system in multi:
        assert system.policy is None and system.given.expert_format == "native"
        assert system.given.weights_gpu_share is None and system.given.options["group_size"] == 15
    # Klotski (q): the last row's policy with experts and attention in HQQ 4-bit (§7, Compression)
    assert quantized.name == "Klotski (q)" and quantized.given.options == multi[-1].given.options
    assert (quantized.given.expert_format, quantized.given.attention_format) == ("hqq4", "hqq4")


def test_moe_lightning_runs_the_batch_its_artifact_ran() -> None:
    """MoE-Lightning's MTBench rows take N from the artifact's logs (time x tok/s / gen): Table 5's
    504 on S1 for MoE-Lightning(p), at Table 5's μ = 36 at gen 128."""
    for setting in settings("moe-lightning", quick=True):
        if not setting.name.startswith("MTBench gen 128 @ S") or "," in setting.name:
            continue
        machine = setting.name.rsplit("@ ", 1)[1]
        for system in (s for s in setting.systems if s.name in P.ML_SYSTEMS):
            n = P.ML_ARTIFACT_N[(machine, system.name)][P.GENS.index(128)]
            assert system.policy is not None
            assert n <= system.policy.batch_size < n + system.policy.micro_batches, (machine, system.name)
            if (machine, system.name) == ("S1", "MoE-Lightning(p)"):  # every gen: one server, one plan
                assert (system.policy.micro_batch_size, system.policy.micro_batches) == (36, 14)


def test_moe_lightning_on_turing_runs_its_triton_kernels_slower() -> None:
    """On the T4 machines MoE-Lightning's Triton kernels (experts, prefill attention) reach
    TRITON_ON_TURING of the GEMM rate; its FlexGen (cuBLAS) and S2's L4 keep the preset's rate."""
    kernels = {}
    for setting in settings("moe-lightning", quick=True):
        machine = setting.name.rsplit("@ ", 1)[1].split(",")[0]
        for system in setting.systems:
            kernels[(machine, system.name)] = system.setup.kernel_share
            assert system.setup.kv_pool is (system.name in P.ML_SYSTEMS), system.name
    assert kernels[("S1", "MoE-Lightning(p)")] == TRITON_ON_TURING
    assert kernels[("S2", "MoE-Lightning(p)")] == () and kernels[("S1", "FlexGen")] == ()
    setup = paper_setup(preset("mixtral-8x7b", layers=2), "moe-lightning-s1", "fixed:256:2", 2)
    setup = evolve(setup, policy=Policy(64, 1, "cpu", weights_gpu_share=0.0, kv_gpu_share=0.0))
    prefill = {}
    for share in ((), TRITON_ON_TURING):
        spans = _spans(evolve(setup, kernel_share=share), "cgopipe", step=0)
        prefill[share] = {
            op: sum(s.end - s.start for s in spans if s.node.op is op) for op in (Op.EXPERT_FFN, Op.PRE_ATTN)
        }
    slow = prefill[TRITON_ON_TURING]
    assert slow[Op.EXPERT_FFN] > 1.5 * prefill[()][Op.EXPERT_FFN]
    assert slow[Op.PRE_ATTN] == prefill[()][Op.PRE_ATTN]


def test_a_token_pool_holds_each_sequences_own_tokens() -> None:
    """flowmoe's engine sizes a micro-batch's cache for its longest prompt; MoE-Lightning's SGLang
    pool (`kv_pool`) holds each request's own tokens, so the host holds a larger batch."""
    setup = paper_setup(preset("mixtral-8x7b", layers=2), "moe-lightning-s1", "mtbench", 8)
    setup = evolve(setup, policy=Policy(16, 2, "cpu", weights_gpu_share=0.0, kv_gpu_share=0.0))
    rectangular, pool = Simulation(setup), Simulation(evolve(setup, kv_pool=True))
    assert pool.batch().total_slots == sum(pool.prompts) + 8 * len(pool.prompts)
    assert pool.batch().total_slots < rectangular.batch().total_slots
