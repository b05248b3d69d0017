"""FP8 checkpoints in the DeepSeek-V3 / Qwen3-FP8 release layout load dequantized, exactly as plain
torch dequantizes them, and every scheduler gives eager's tokens on them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from attrs import evolve
from safetensors import safe_open
from safetensors.torch import save_file

from flowmoe.cli import main
from flowmoe.core.errors import CheckpointError, ConfigError, FlowmoeError
from flowmoe.core.policy import Policy
from flowmoe.kernels.layout import TokenLayout
from flowmoe.model.checkpoint import Checkpoint
from flowmoe.model.loading import Packing, load_model
from flowmoe.model.moe_model import MoEModel
from flowmoe.runtime.runner import Runtime
from flowmoe.schedulers.lru_cache import LRUCacheOptions
from flowmoe.schedulers.shared_options import PagedOptions
from tests.helpers import rel_err
from tests.hf_models import COMMON, hf_model, save_hf
from tests.schedule_fixtures import run_eager, run_scheduler

BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK],
         "activation_scheme": "dynamic", "modules_to_not_convert": ["lm_head", "mlp.gate"]}  # fmt: skip
# Qwen3-MoE wide enough for several 128-blocks with partial ones at both edges: hidden 160 and
# q 4 x 40 = 160 ([2, 2] grids), kv 2 x 40 = 80 (one partial row block), experts [136, 160] and
# [160, 136]; Mixtral's tiny shapes are each one partial block.
WIDE = {**COMMON, "hidden_size": 160, "head_dim": 40, "num_hidden_layers": 2, "intermediate_size": 80,
        "moe_intermediate_size": 136, "num_experts": 6, "num_experts_per_tok": 2,
        "norm_topk_prob": True}  # fmt: skip


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] -> (float8_e4m3fn [R, C], float32 scale_inv [ceil(R/128), ceil(C/128)]), block by block
    (max |w| of the block maps to 448), the ragged edge blocks included."""
    rows, cols = weight.shape
    grid = (-(-rows // BLOCK), -(-cols // BLOCK))
    q, scales = torch.empty(rows, cols, dtype=torch.float8_e4m3fn), torch.ones(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = weight[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK].float()
            amax = float(block.abs().max())
            scales[i, j] = amax / FP8_MAX if amax > 0 else 1.0
            q[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = (
                (block / scales[i, j]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            )
    return q, scales


def plain_dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The reference: every block's float32 values times its scale, one block at a time."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            out[rows, cols] = q[rows, cols].float() * scales[i, j]
    return out


def quantized(name: str, tensor: torch.Tensor) -> bool:
    """The release's choice: every linear weight of a layer but the router."""
    return tensor.ndim == 2 and name.startswith("model.layers.") and not name.endswith("mlp.gate.weight")


def write_pair(model, fp8_folder: Path, ref_folder: Path, quant: dict[str, Any] = QUANT) -> None:
    """The model as an FP8 checkpoint, and the same weights dequantized by plain torch (float32),
    both in the per-expert layout `save_pretrained` writes (the releases' layout)."""
    plain = save_hf(model, fp8_folder.parent / "saved")
    with safe_open(str(plain / "model.safetensors"), "pt") as f:
        state = {name: f.get_tensor(name).float() for name in f.keys()}  # noqa: SIM118 (safe_open)
    fp8_state, ref_state = {}, {}
    for name, tensor in state.items():
        if quantized(name, tensor):
            q, scales = quantize(tensor)
            fp8_state[name], fp8_state[f"{name}_scale_inv"] = q, scales
            ref_state[name] = plain_dequantize(q, scales)
        else:
            fp8_state[name] = ref_state[name] = tensor
    config = json.loads((plain / "config.json").read_text())
    for folder, tensors, extra in (
        (fp8_folder, fp8_state, {"quantization_config": quant}),
        (ref_folder, ref_state, {}),
    ):
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, **extra}, default=str))


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    import transformers

    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**WIDE)).eval()
    root = tmp_path_factory.mktemp("fp8")
    write_pair(hf, root / "fp8", root / "ref")
    return root / "fp8", root / "ref"


def _logits(model: MoEModel, ids: torch.Tensor) -> torch.Tensor:
    """Prefill logits of every position: ids [B, L] -> [B * L, V]."""
    batch, length = ids.shape
    cache = model.new_cache(batch, length)
    layout = TokenLayout(tuple(range(batch)), (length,) * batch, (0,) * batch)
    with torch.inference_mode():
        return model.forward(ids.reshape(-1), cache, layout, all_rows=True)


def test_dequantize_matches_plain_torch_on_ragged_blocks() -> None:
    from flowmoe.model.fp8 import dequantize

    torch.manual_seed(1)
    for shape in ((136, 160), (300, 129), (80, 160), (48, 64)):
        q, scales = quantize(torch.randn(shape))
        assert torch.equal(dequantize(q, scales, (BLOCK, BLOCK), torch.float32), plain_dequantize(q, scales))


def test_wide_fp8_checkpoint_equals_plain_torch_dequantization(wide: tuple[Path, Path]) -> None:
    import transformers

    fp8, ref = wide
    with safe_open(str(fp8 / "model.safetensors"), "pt") as f:  # the layout really is the release's
        assert f.get_tensor("model.layers.0.mlp.experts.0.gate_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_slice("model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv").get_shape() == [2, 2]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight_scale_inv").get_shape() == [1, 2]
    ours, plain = load_model(fp8), load_model(ref)
    for a, b in zip(ours.weights.layers, plain.weights.layers, strict=True):
        assert torch.equal(a.attn.qkv, b.attn.qkv)
        assert all(torch.equal(x.gate_up, y.gate_up) and torch.equal(x.down, y.down)
                   for x, y in zip(a.experts, b.experts, strict=True))  # fmt: skip
    ids = torch.randint(3, COMMON["vocab_size"], (2, 7))
    logits = _logits(ours, ids)
    assert rel_err(logits, _logits(plain, ids)) <= 1e-5
    hf = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf(ids).logits.reshape(-1, COMMON["vocab_size"])
    assert rel_err(logits, reference) <= 1e-5


@pytest.fixture(scope="module")
def mixtral_fp8_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fp8-mixtral")
    write_pair(hf_model("mixtral"), root / "fp8", root / "ref")
    return root / "fp8"


@pytest.fixture(scope="module")
def mixtral_fp8(mixtral_fp8_folder: Path) -> MoEModel:
    return load_model(mixtral_fp8_folder)


@pytest.fixture(scope="module")
def mixtral_fp8_packed(mixtral_fp8_folder: Path) -> MoEModel:
    """The checkpoint with its routed experts kept FP8 as stored (--expert-format fp8)."""
    return load_model(mixtral_fp8_folder, packing=Packing("fp8"))


@pytest.fixture(scope="module")
def eager_reference(mixtral_fp8: MoEModel):
    return run_eager(mixtral_fp8)


@pytest.mark.parametrize("name", ["eager", "cgopipe", "lru-cache", "fiddler"])
def test_schedulers_give_eager_tokens_on_fp8(mixtral_fp8: MoEModel, eager_reference, name: str) -> None:
    (results, logits), _ = run_scheduler(mixtral_fp8, name)
    ref_results, ref_logits = eager_reference
    assert [r.output_ids for r in results] == [r.output_ids for r in ref_results]
    for ours, ref in zip(logits, ref_logits, strict=True):
        assert all(rel_err(a, b) <= 1e-5 for a, b in zip(ours, ref, strict=True))


def _edit(folder: Path, config: dict[str, Any] | None = None, drop: str = "", reshape: str = "") -> Path:
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if drop or reshape:
        file = folder / "model.safetensors"
        with safe_open(str(file), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys() if k != drop}  # noqa: SIM118
        if reshape:
            tensors[reshape] = torch.ones(1, 1)
        save_file(tensors, str(file))
    return folder


BAD_QUANT = [
    ({"quant_method": "bitsandbytes"}, '"quantization_config.quant_method" must be "fp8", "gptq", "awq"'),
    ({"fmt": "e5m2"}, '"quantization_config.fmt" must be "e4m3"'),
    ({"weight_block_size": [128]}, '"quantization_config.weight_block_size" must be two positive integers'),
    (
        {"weight_block_size": [0, 128]},
        '"quantization_config.weight_block_size" must be two positive integers',
    ),
    ({"activation_scheme": "static"}, '"quantization_config.activation_scheme" must be "dynamic"'),
    (
        {"modules_to_not_convert": ["model.layers.0.self_attn"]},
        "is in quantization_config.modules_to_not_convert",
    ),
]


@pytest.mark.parametrize(("change", "message"), BAD_QUANT)
def test_bad_quantization_config_is_named(wide, tmp_path: Path, change: dict[str, Any], message: str) -> None:
    folder = _copy(wide[0], tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {**QUANT, **change}
    with pytest.raises(CheckpointError, match=_escaped(message)):
        Checkpoint.open(_edit(folder, config))


def test_bad_scales_are_named(wide, tmp_path: Path) -> None:
    missing = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"
    with pytest.raises(CheckpointError, match=f"tensor {_escaped(missing)} .*is missing"):
        Checkpoint.open(_edit(_copy(wide[0], tmp_path / "a"), drop=missing))
    wrong = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    with pytest.raises(
        CheckpointError, match=f"tensor {_escaped(wrong)} has shape \\[1, 1\\], expected \\[2, 2\\]"
    ):
        Checkpoint.open(_edit(_copy(wide[0], tmp_path / "b"), reshape=wrong))
    config = json.loads((wide[0] / "config.json").read_text())
    del config["quantization_config"]
    with pytest.raises(CheckpointError, match=r'is F8_E4M3, but .* has no "quantization_config"'):
        Checkpoint.open(_edit(_copy(wide[0], tmp_path / "c"), config))


def test_cli_bad_fp8_checkpoint_is_one_line_exit_2(
    wide, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    folder = _edit(_copy(wide[0], tmp_path / "ckpt"), drop="model.layers.0.self_attn.q_proj.weight_scale_inv")
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text('{"id": 1, "input_ids": [5, 6, 7]}\n')
    code = main(["run", "--model", str(folder), "--prompts", str(prompts), "--output", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and not out.exists()
    assert err[0].startswith("flowmoe: error: ") and "q_proj.weight_scale_inv" in err[0]


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


def test_fp8_copy_prices_a_byte_per_weight_plus_scales() -> None:
    from flowmoe.core.cost import RooflineCost
    from flowmoe.core.expert_formats import fp8_expert_bytes
    from flowmoe.core.hardware import hardware
    from flowmoe.core.plan import Lane, Op
    from flowmoe.core.presets import preset
    from flowmoe.core.scheduling import NodeFactory

    spec = preset("mixtral-8x7b", layers=2, dtype="bfloat16")  # expert [14336, 4096] x 2 + [4096, 14336]
    params = 3 * 4096 * 14336
    assert fp8_expert_bytes(spec) == params + 4 * 3 * 112 * 32
    native, fp8 = NodeFactory(spec), NodeFactory(spec, expert_format="fp8")
    copy = fp8.node(Op.PAGE_COPY, Lane.GPU_H2D, 0, expert=1)
    assert (copy.bytes, copy.flops) == (fp8_expert_bytes(spec), params)
    pages = [fp8.node(Op.PAGE_COPY, Lane.GPU_H2D, 0, expert=1, part=p, parts=3) for p in range(3)]
    assert sum(p.bytes for p in pages) == copy.bytes and sum(p.flops for p in pages) == params
    assert fp8.node(Op.PAGE_COPY, Lane.GPU_H2D, 0, expert=1, more=(2,)).bytes == 2 * copy.bytes
    for op in (Op.EVICT, Op.PAGE_COPY):  # the GPU holds dequantized experts; dense parts are not FP8
        expert = 1 if op is Op.EVICT else -1
        assert (
            fp8.node(op, Lane.GPU_H2D, 0, expert=expert).bytes
            == native.node(op, Lane.GPU_H2D, 0, expert=expert).bytes
        )
    cost = RooflineCost(hardware("h100"), spec)
    slow = cost(native.node(Op.PAGE_COPY, Lane.GPU_H2D, 0, expert=1))
    fast = cost(copy)
    link_only = cost.fixed(Lane.GPU_H2D, Op.PAGE_COPY) + cost.transfer_seconds(Lane.GPU_H2D, copy.bytes)
    assert fast == pytest.approx(link_only) and cost.dequant_seconds(copy) == 0  # dequantized at first use
    assert 0.45 < fast / slow < 0.55


def test_the_first_gpu_use_after_a_copy_pays_the_dequantization() -> None:
    """An expert's first EXPERT_FFN on the GPU since its copy reads the packed bytes and writes the
    dequantized weights (a flop a weight); later uses, CPU uses and resident experts pay nothing."""
    from flowmoe.core.expert_formats import packed_expert_bytes
    from flowmoe.core.plan import Lane, Op
    from flowmoe.core.presets import preset
    from flowmoe.core.scheduling import MicroBatchShape, NodeFactory

    spec = preset("mixtral-8x7b", layers=2, dtype="bfloat16")
    params = 3 * 4096 * 14336
    mb = MicroBatchShape(0, 4, 4, 40, 40)
    native = NodeFactory(spec)
    plain = native.node(Op.EXPERT_FFN, Lane.GPU_COMPUTE, 0, mb, expert=1)

    def ffn(factory: NodeFactory, lane: Lane, expert: int) -> tuple[int, int]:
        node = factory.node(Op.EXPERT_FFN, lane, 0, mb, expert=expert)
        return node.bytes - plain.bytes, node.flops - plain.flops

    for form in ("fp8", "int4"):
        packed = NodeFactory(spec, expert_format=form)
        packed.node(Op.PAGE_COPY, Lane.GPU_H2D, 0, expert=1, part=0, parts=2, more=(2,))
        assert ffn(packed, Lane.CPU_COMPUTE, 1) == (0, 0)  # the host's own copy
        pass_bytes = packed_expert_bytes(spec, form) + spec.expert_bytes
        assert ffn(packed, Lane.GPU_COMPUTE, 1) == (pass_bytes, params)
        assert ffn(packed, Lane.GPU_COMPUTE, 1) == (0, 0)  # dequantized once per arrival
        assert ffn(packed, Lane.GPU_COMPUTE, 2)[1] == params  # `more`: the run's other expert
        assert ffn(packed, Lane.GPU_COMPUTE, 3) == (0, 0)  # never copied: resident
        assert ffn(native, Lane.GPU_COMPUTE, 1) == (0, 0)


def test_simulation_moves_half_the_bytes_with_fp8_experts() -> None:
    from flowmoe.core.hardware import hardware
    from flowmoe.core.policy import Policy
    from flowmoe.core.presets import preset
    from flowmoe.core.synthetic_routing import RoutingModel
    from flowmoe.core.workloads import workload
    from flowmoe.study.simulate import Setup, Simulation

    spec = preset("mixtral-8x7b", layers=2, dtype="bfloat16")
    policy = Policy(micro_batch_size=4, micro_batches=2, weights_gpu_share=0.0)
    h2d = {}
    for form in ("native", "fp8"):
        setup = Setup(spec, hardware("h100"), workload("mtbench").with_gen_len(3),
                      evolve(policy, expert_format=form), RoutingModel(seed=1), decode_samples=1)  # fmt: skip
        result = Simulation(setup).run("cgopipe")
        assert result.error is None
        h2d[form] = next(lane for lane in result.lanes if lane.lane == "gpu.h2d")
    assert 0.45 < h2d["fp8"].bytes / h2d["native"].bytes < 0.55
    assert h2d["fp8"].busy_seconds < h2d["native"].busy_seconds


PAGES_4K = (PagedOptions(page_bytes=4096),)
SMALL_CACHE = (LRUCacheOptions(expert_cache_slots=4, cache_ways=2),)


@pytest.mark.parametrize(
    ("name", "policy"),
    [
        (
            "eager",
            Policy(micro_batch_size=3, micro_batches=2, expert_format="fp8"),
        ),  # resident: copied at setup
        ("cgopipe", Policy(3, 2, weights_gpu_share=0.0, expert_format="fp8", options=PAGES_4K)),
        ("lru-cache", Policy(3, 2, weights_gpu_share=0.0, expert_format="fp8", options=SMALL_CACHE)),
    ],
)
def test_fp8_experts_cross_and_dequantize_to_eager_tokens(
    mixtral_fp8_packed: MoEModel, eager_reference, name: str, policy: Policy
) -> None:
    lw = mixtral_fp8_packed.weights.layers[0]
    assert lw.packed[0].gate_up[0].values.dtype == torch.float8_e4m3fn and not lw.experts  # only FP8 kept
    assert lw.packed[0].nbytes < lw.packed[0].ffn_nbytes / 3  # float32 model: a quarter, plus scales
    (results, logits), runtime = run_scheduler(mixtral_fp8_packed, name, policy)
    assert runtime.weights.expert_format == "fp8"
    ref_results, ref_logits = eager_reference
    assert [r.output_ids for r in results] == [r.output_ids for r in ref_results]
    for ours, ref in zip(logits, ref_logits, strict=True):
        for a, b in zip(ours, ref, strict=True):  # CUDA's fp32 GEMMs round otherwise; on the CPU only
            # torch's vectorised SiLU may round an element an ulp apart (eager's grouped experts, the
            # runtime's one by one, with the C kernels off)
            assert rel_err(a, b) <= (1e-4 if runtime.devices.cuda else 1e-6)


def test_fp8_expert_format_needs_an_fp8_checkpoint(mixtral_folder: Path) -> None:
    with pytest.raises(ConfigError, match='has no quantization_config of quant_method "fp8"'):
        load_model(mixtral_folder, packing=Packing("fp8"))
    with pytest.raises(FlowmoeError, match="expert format fp8: the experts of layer 0 are not packed"):
        Runtime.create(load_model(mixtral_folder), "eager", Policy(expert_format="fp8"))
    with pytest.raises(ConfigError, match="expert format must be one of native, fp8, int8, int4, hqq4"):
        Policy(expert_format="int3")  # type: ignore[arg-type]


def test_cli_run_and_simulate_take_the_expert_format(
    mixtral_fp8_folder: Path, tmp_path: Path, capsys
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 1, "input_ids": [5, 6, 7]}\n{"id": 2, "input_ids": [8, 9]}\n')
    outputs = {}
    for form in ("native", "fp8"):
        out = tmp_path / f"{form}.jsonl"
        args = ["--scheduler", "cgopipe", "--weights-gpu-share", "0", "--expert-format", form]
        files = ["--model", str(mixtral_fp8_folder), "--prompts", str(prompts), "--output", str(out)]
        code = main(["run", *files, "--max-new-tokens", "4", "--greedy", *args])
        assert code == 0
        outputs[form] = sorted(
            (r["id"], r["output_ids"]) for r in map(json.loads, out.read_text().splitlines())
        )
    assert outputs["fp8"] == outputs["native"]
    capsys.readouterr()
    model = ["--model", "mixtral-8x7b", "--layers", "2", "--dtype", "bfloat16", "--hardware", "h100"]
    policy = ["--scheduler", "cgopipe", "--batch-size", "8", "--weights-gpu-share", "0"]
    base = ["simulate", *model, *policy, "--decode-samples", "1", "--gen-len", "3", "--json"]
    h2d = {}
    for form in ("native", "fp8"):
        assert main([*base, "--expert-format", form]) == 0
        lanes = json.loads(capsys.readouterr().out)["results"][0]["lanes"]
        h2d[form] = next(lane["bytes"] for lane in lanes if lane["lane"] == "gpu.h2d")
    assert 0.45 < h2d["fp8"] / h2d["native"] < 0.55


def test_hrm_planner_streams_fp8_experts(capsys: pytest.CaptureFixture) -> None:
    from flowmoe.core.expert_formats import fp8_expert_bytes
    from flowmoe.core.hrm import Phase, layer_ops
    from flowmoe.core.presets import preset

    spec = preset("mixtral-8x7b", dtype="bfloat16")
    phase, policy = Phase(64, 16, 1, 512), Policy(16, 4, weights_gpu_share=0.25)
    link = {
        form: next(
            op.link_bytes
            for op in layer_ops(spec, phase, evolve(policy, expert_format=form))
            if op.name == "moe ffn"
        )
        for form in ("native", "fp8")
    }
    assert link["native"] == 0.75 * 8 * spec.expert_bytes and link["fp8"] == 0.75 * 8 * fp8_expert_bytes(spec)
    plan = [
        "plan",
        "--model",
        "mixtral-8x7b",
        "--dtype",
        "bfloat16",
        "--hardware",
        "h100",
        "--max-batch",
        "256",
    ]
    best = {}
    for form in ("native", "fp8"):  # every candidate moves fewer bytes: the best is at least as fast
        assert main([*plan, "--expert-format", form, "--json"]) == 0
        best[form] = json.loads(capsys.readouterr().out)["best"]["throughput_tokens_per_second"]
    assert best["fp8"] > best["native"]


def test_fp8_copies_are_pinned_with_their_layer(mixtral_fp8_folder: Path) -> None:
    """On CUDA a layer's arena is page-locked for asynchronous copies: the FP8 copies are in it."""
    from flowmoe.runtime.pinned import pin_layers

    model = load_model(mixtral_fp8_folder, packing=Packing("fp8"))
    before = [t.clone() for x in model.weights.layers[1].packed for t in x.tensors()]
    arenas = pin_layers(model, register=lambda arena: None)
    after = [t for x in model.weights.layers[1].packed for t in x.tensors()]
    assert all(a.arena is arenas[1] for a in after)
    assert all(
        a.dtype == b.dtype and torch.equal(a.float(), b.float()) for a, b in zip(after, before, strict=True)
    )


# DeepSeek-V3, the FP8 release's own architecture: MLA projections, shared expert and the dense first
# layer quantized too, the router and its e_score_correction_bias not; hidden 160 and experts
# [136, 160] span partial blocks.
DEEPSEEK_V3 = {**COMMON, "hidden_size": 160, "num_key_value_heads": 4, "intermediate_size": 200,
               "moe_intermediate_size": 136, "n_routed_experts": 8, "num_experts_per_tok": 3,
               "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 24, "kv_lora_rank": 16,
               "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12, "n_group": 4, "topk_group": 2,
               "routed_scaling_factor": 2.5}  # fmt: skip


def test_deepseek_v3_fp8_checkpoint_equals_plain_torch_dequantization(tmp_path: Path) -> None:
    import transformers

    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DEEPSEEK_V3)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "e_score_correction_bias" in name or name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.3)  # zero-initialised otherwise
    write_pair(hf, tmp_path / "fp8", tmp_path / "ref")
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv").get_shape() == [
            1,
            2,
        ]
        assert f.get_slice("model.layers.0.mlp.gate_proj.weight_scale_inv").get_shape() == [2, 2]
    ours, plain = load_model(tmp_path / "fp8"), load_model(tmp_path / "ref")
    ids = torch.randint(3, COMMON["vocab_size"], (2, 7))
    logits = _logits(ours, ids)
    assert torch.equal(logits, _logits(plain, ids))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ref", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        assert rel_err(logits, reference(ids).logits.reshape(-1, COMMON["vocab_size"])) <= 1e-4
