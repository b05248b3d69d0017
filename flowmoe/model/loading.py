"""Turn a checkpoint folder or a preset name into a ready MoEModel, its experts (and attention)
packed or quantized as each layer is read (`Packing`)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from attrs import frozen

from flowmoe.core.errors import CheckpointError, ConfigError
from flowmoe.core.expert_formats import attention_projections
from flowmoe.core.jsonfile import read_json_object
from flowmoe.core.policy import QUANTIZED_ON_LOAD, AttentionFormat, ExpertFormat
from flowmoe.core.presets import PRESETS, preset
from flowmoe.core.spec import ModelSpec
from flowmoe.model.arena import layer_arena, plan_layer, top_arena
from flowmoe.model.checkpoint import TORCH_DTYPES, Checkpoint
from flowmoe.model.int4_checkpoints import Int4Format
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.quantize import quantize_expert, quantize_layer_attention, quantize_lm_head
from flowmoe.model.quantized import QuantizedExpert
from flowmoe.model.random_weights import RandomSource
from flowmoe.model.tensor_map import Shape, TensorMap, TensorSource
from flowmoe.model.weights import LayerWeights, ModelWeights

Progress = Callable[[int, int], None]
LayerPacker = Callable[[int, LayerWeights], None]  # packs layer `layer`, just read, in place
ExpertPacker = Callable[[int, LayerWeights], list[QuantizedExpert]]  # an MoE layer's routed experts, packed
_LIBC = ctypes.CDLL(None)  # the C library this process runs on


@frozen
class Packing:
    """How a load keeps each layer: its routed experts in `expert_format` (model/quantized.py), its
    attention projections in `attention_format` (model/quantize.py, `quantize_layer_attention`), the
    LM head in `lm_head_format` (`quantize_lm_head`), what is quantized computed on `device` (None: the
    CPU). Each layer is packed as it is read, and its
    weights in the model's dtype let go before the next is: a load holds the packed layers and one
    layer in the model's dtype, never the whole model so."""

    expert_format: ExpertFormat = "native"
    attention_format: AttentionFormat = "native"
    device: torch.device | None = None
    lm_head_format: AttentionFormat = "native"

    @property
    def quantizes(self) -> bool:
        """Whether weights in the model's dtype are quantized on load (not fp8: kept as stored)."""
        return (
            self.expert_format in QUANTIZED_ON_LOAD
            or self.attention_format != "native"
            or self.lm_head_format != "native"
        )


def load_model(
    source: str | Path,
    dtype: str | None = None,
    layers: int | None = None,
    progress: Progress | None = None,
    packing: Packing = Packing(),
) -> MoEModel:
    """`source` is a checkpoint folder or a preset name (random weights at the real shapes), its
    layers packed as `packing` says; a format the source cannot take is refused before any weight is
    read.

    `layers` cuts a preset to its first layers; `progress(done, total)` is called per layer."""
    path = Path(source)
    if path.exists() or path.is_symlink():  # a folder, or something in its place to name
        if layers is not None:
            raise ConfigError("--layers applies to presets only; a checkpoint loads all its layers")
        ckpt = Checkpoint.open(path, dtype)
        head = head_packer(source, ckpt, ckpt.spec, packing)
        return _assemble(ckpt, ckpt.spec, progress, layer_packer(source, ckpt, ckpt.spec, packing), head)
    if str(source) in PRESETS:
        spec = preset(str(source), layers=layers, dtype=dtype)
        random = RandomSource(spec)
        head = head_packer(source, random, spec, packing)
        return _assemble(random, spec, progress, layer_packer(source, random, spec, packing), head)
    raise ConfigError(f"{source}: neither a checkpoint folder nor a preset (presets: {', '.join(PRESETS)})")


@contextlib.contextmanager
def opened(source: str | Path, spec: ModelSpec) -> Iterator[TensorSource]:
    """The weights of `source` (a checkpoint folder, else a preset) in `spec`'s dtype, for reading
    layers again (`read_layer`)."""
    if not Path(source).is_dir():
        yield RandomSource(spec)
        return
    ckpt = Checkpoint.open(source, spec.dtype)
    try:
        yield ckpt
    finally:
        ckpt.close()


def stored_quantization(source: str | Path) -> Int4Format | None:
    """The quantization of a GPTQ, AWQ or compressed-tensors checkpoint folder (None for another
    checkpoint or a preset), read from its config alone."""
    path = Path(source)
    if not path.is_dir():
        return None
    config = path / "config.json"
    return Int4Format.from_config(read_json_object(config, CheckpointError), str(config))


def layer_packer(source: str | Path, tensors: TensorSource, spec: ModelSpec, packing: Packing) -> LayerPacker:
    """What packs each layer read from `tensors` (the weights of `source`) as `packing` says; a format
    they cannot take is refused here, before any layer is."""
    where = packing.device or torch.device("cpu")
    attention = packing.attention_format
    if attention != "native":
        attention_projections(spec)  # multi-head latent attention is refused
        _check_unquantized_source(source, tensors, "--attention-format", attention)
    experts = _expert_packer(source, tensors, packing.expert_format, where)

    def pack(layer: int, lw: LayerWeights) -> None:
        if experts is None and attention == "native":
            return
        if experts is not None and lw.router is not None:
            lw.packed, lw.experts = experts(layer, lw), []
            layer_arena(lw)  # into a buffer of its packed size; the one it was read into is let go
        if attention != "native":
            quantize_layer_attention(spec, lw, attention, where)
        _trim_heap()

    return pack


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing).
    Quantizing a layer allocates and frees tens of MiB of float32 temporaries and packed results on
    the heap, and glibc gives back only its free top: without this, the holes later small
    allocations leave below stay resident, 0.5-0.7 GiB on an 8-layer 0.8B-parameter model."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def _expert_packer(
    source: str | Path, tensors: TensorSource, expert_format: ExpertFormat, where: torch.device
) -> ExpertPacker | None:
    """How an MoE layer's routed experts are kept in `expert_format`, and only so: fp8 as the FP8
    checkpoint stores them; int4 (int8) as a GPTQ, AWQ or compressed-tensors checkpoint of that many
    bits stores them (model/int4_checkpoints.py); else int8, int4 and hqq4 quantized on `where` from
    the experts read in the model's own dtype (a checkpoint or a preset). None for native."""
    if expert_format == "native":
        return None
    ckpt = tensors if isinstance(tensors, Checkpoint) else None
    if expert_format == "fp8":
        if ckpt is None:
            raise ConfigError(f"--expert-format fp8 needs an FP8 checkpoint folder, and {source} is not one")
        if ckpt.fp8 is None:
            raise ConfigError(
                f"--expert-format fp8 needs an FP8 checkpoint; {ckpt.folder / 'config.json'} has no "
                'quantization_config of quant_method "fp8"'
            )
        fp8_experts = ckpt.fp8_experts
        return lambda layer, _lw: fp8_experts(layer)
    if ckpt is not None and ckpt.int4 is not None:
        if expert_format != ckpt.int4.expert_format:
            raise ConfigError(
                f"--expert-format {expert_format}: {source} is a {ckpt.int4.describe()} checkpoint; run it "
                f"with --expert-format {ckpt.int4.expert_format} (its experts as stored) or native "
                "(dequantized on load)"
            )
        int4_experts = ckpt.int4_experts
        return lambda layer, _lw: int4_experts(layer)
    if ckpt is not None and ckpt.fp8 is not None:
        raise ConfigError(
            f"--expert-format {expert_format} quantizes a checkpoint in bfloat16, float16 or float32 as it "
            f"loads, and {source} is an FP8 checkpoint: run it with --expert-format fp8 (or native)"
        )

    return lambda _layer, lw: [quantize_expert(ffn, expert_format, where) for ffn in lw.experts]


def _check_unquantized_source(
    source: str | Path, tensors: TensorSource, flag: str, form: AttentionFormat
) -> None:
    """`flag` (--attention-format, --lm-head-format) quantizes weights in the model's own dtype: not a
    checkpoint quantized before (GPTQ, AWQ, compressed-tensors, FP8)."""
    if isinstance(tensors, Checkpoint) and (tensors.int4 is not None or tensors.fp8 is not None):
        raise ConfigError(
            f"{flag} {form} quantizes a checkpoint in bfloat16, float16 or float32 "
            f"as it loads, and {source} is stored quantized already: leave {flag} out"
        )


def head_packer(
    source: str | Path, tensors: TensorSource, spec: ModelSpec, packing: Packing
) -> Callable[[ModelWeights], None] | None:
    """What quantizes the LM head once read, as `packing.lm_head_format` says (None: nothing to do);
    a head it cannot take (tied to the embedding, stored quantized) is refused here, before any
    layer is read."""
    form = packing.lm_head_format
    if form == "native":
        return None
    _check_unquantized_source(source, tensors, "--lm-head-format", form)
    if spec.tie_embeddings:
        raise ConfigError(
            f"--lm-head-format {form} quantizes an LM head of its own, and this model's is its embedding "
            "(tied): leave --lm-head-format out"
        )
    where = packing.device or torch.device("cpu")
    return lambda weights: quantize_lm_head(spec, weights, form, where)


@frozen
class _Shapes:
    """`source`'s tensors as meta tensors of the model's dtype: shapes, no data (a TensorSource)."""

    source: TensorSource
    dtype: torch.dtype

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def get(self, name: str, shape: Shape) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device="meta")


@frozen
class _AsStored:
    """A checkpoint's tensors as stored where they can be mapped (`Checkpoint.read`): each converted
    to the model's dtype as it is copied into its arena, a chunk at a time, never whole beside it.
    A fused experts tensor [experts, ...] is cut into its experts, each copied out of it before any
    is copied in: it is read converted (`Checkpoint.get`, its pages let go as they are converted)."""

    ckpt: Checkpoint

    def has(self, name: str) -> bool:
        return self.ckpt.has(name)

    def get(self, name: str, shape: Shape) -> torch.Tensor:
        return self.ckpt.get(name, shape) if len(shape) > 2 else self.ckpt.read(name, shape)


def _into_arena(source: TensorSource) -> TensorSource:
    """`source` for reading tensors that are copied into an arena next."""
    return _AsStored(source) if isinstance(source, Checkpoint) else source


def read_layer(source: TensorSource, spec: ModelSpec, layer: int) -> LayerWeights:
    """Layer `layer` of `source` into its arena as it is read: laid out from its shapes first, so its
    stacked tensors are written in place and the rest copied in one by one (model/arena.py)."""
    tensor_map = TensorMap.for_spec(spec)
    shapes = _Shapes(source, TORCH_DTYPES[spec.dtype])
    plan = plan_layer(functools.partial(tensor_map.load_layer, layer, shapes))
    lw = tensor_map.load_layer(layer, _into_arena(source), plan.stack)
    layer_arena(lw, plan)  # each loaded tensor is let go as its copy takes its place
    return lw


def _assemble(
    source: TensorSource,
    spec: ModelSpec,
    progress: Progress | None,
    pack: LayerPacker,
    pack_head: Callable[[ModelWeights], None] | None,
) -> MoEModel:
    """Each layer read and packed in turn (the one before let go of all but its packed form), then the
    embedding, final norm and LM head (packed by `pack_head`, if given)."""
    layers = []
    for layer in range(spec.layers):
        lw = read_layer(source, spec, layer)
        pack(layer, lw)
        layers.append(lw)
        if progress is not None:
            progress(layer + 1, spec.layers)
    weights = TensorMap.for_spec(spec).load_top(_into_arena(source), layers)
    top_arena(weights, TORCH_DTYPES[spec.dtype])
    if pack_head is not None:
        pack_head(weights)
    return MoEModel.build(spec, weights)
