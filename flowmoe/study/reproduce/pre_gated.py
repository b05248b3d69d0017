"""Pre-gated MoE's settings: Switch-Base and Switch-Large against on-demand fetch, prefetch-all and
GPU-only, on a decoder-only stand-in for Switch."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from attrs import evolve

from flowmoe.core.policy import Policy
from flowmoe.core.spec import ModelSpec
from flowmoe.study.reproduce import paper_numbers as P
from flowmoe.study.reproduce.setting import ROUTING, Mean, Setting, Speedup, System, paper_setup
from flowmoe.study.simulate import Setup

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
        paper_setup(switch_standin(name), "pregated-a100", PREGATED_WORK, samples=6), routing=PREGATED_ROUTING
    )
