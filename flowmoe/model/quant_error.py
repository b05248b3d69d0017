"""The error a quantize-on-load expert format introduces, measured on the run's own prompts: the
last-token logits of the job's first prompts (the first micro-batch's worth, at most
`MAX_PROMPTS`), computed eagerly on the host by the model as loaded and by the unquantized model,
read again from the checkpoint a layer at a time (`reference_logits`: the load never holds the whole
model unquantized, and neither does the measurement), compared per prompt as the relative error
||quantized - reference|| / ||reference|| (2-norms over the vocabulary). A run reports its
largest and its mean (cli/run.py: the printed report, --json, the run record), and what was
quantized: the routed experts (--expert-format), the attention projections (--attention-format:
model/quantize.py, `quantize_layer_attention`), the LM head (--lm-head-format, `quantize_lm_head`),
or several, measured together.

A checkpoint quantized before flowmoe read it (GPTQ, AWQ, compressed-tensors) is reported as such
instead, whatever the expert format: its quantization, and that its error against the unquantized
model is not measured (the checkpoint holds no unquantized weights)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from attrs import evolve, frozen

from flowmoe.core.policy import QUANTIZED_ON_LOAD, AttentionFormat, ExpertFormat
from flowmoe.kernels.kv_cache import KVCache
from flowmoe.kernels.layout import TokenLayout
from flowmoe.kernels.no_copy import on
from flowmoe.model.loading import Packing, opened, read_layer, stored_quantization
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.tensor_map import TensorMap

MAX_PROMPTS = 8  # bounds the two eager passes' cost; a sample, not the job


@frozen
class QuantError:
    expert_format: ExpertFormat
    prompts: int  # prompts measured
    max_rel: float | None  # largest relative error of a prompt's last-token logits
    mean_rel: float | None  # mean over the prompts
    checkpoint: str | None = None  # the checkpoint's own quantization, where it came quantized
    attention_format: AttentionFormat = "native"  # the attention projections' (q/k/v, o)
    lm_head_format: AttentionFormat = "native"  # the LM head's

    @classmethod
    def between(
        cls,
        expert_format: ExpertFormat,
        reference: torch.Tensor,
        quantized: torch.Tensor,
        attention_format: AttentionFormat = "native",
        lm_head_format: AttentionFormat = "native",
    ) -> QuantError:
        """reference, quantized: [B, vocab] logits of the same prompts."""
        ref, ours = reference.float(), quantized.float()
        tiny = torch.finfo(torch.float32).tiny
        rel = (ours - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(tiny)  # [B]
        errors = (float(rel.max()), float(rel.mean()))
        return cls(expert_format, rel.numel(), *errors, None, attention_format, lm_head_format)

    def as_json(self) -> dict[str, Any]:
        return {"expert_format": self.expert_format, "attention_format": self.attention_format,
                "lm_head_format": self.lm_head_format,
                "quantized_on_load": self.checkpoint is None, "prompts": self.prompts,
                "logits_rel_err_max": self.max_rel, "logits_rel_err_mean": self.mean_rel,
                "checkpoint": self.checkpoint}  # fmt: skip

    @property
    def quantized(self) -> str:
        """What was quantized on load, in words."""
        parts = []
        if self.expert_format in QUANTIZED_ON_LOAD:
            parts.append(f"experts quantized to {self.expert_format}")
        if self.attention_format != "native":
            parts.append(f"attention (q/k/v and o projections) quantized to {self.attention_format}")
        if self.lm_head_format != "native":
            parts.append(f"the LM head quantized to {self.lm_head_format}")
        return " and ".join(parts)

    def line(self) -> str:
        if self.checkpoint is not None:
            kept = (
                f"routed experts kept {self.expert_format} as stored, the other quantized tensors dequantized"
                if self.expert_format != "native"
                else "every quantized tensor dequantized (--expert-format int4 / int8 keeps experts packed)"
            )
            return (
                f"weights quantized by the checkpoint ({self.checkpoint}): {kept} on load; its error "
                "against the unquantized model is not measured"
            )
        return (
            f"{self.quantized} on load: last-token logits of the first "
            f"{self.prompts} prompt(s) off the unquantized model's by {self.max_rel:.3g} at most, "
            f"{self.mean_rel:.3g} on average (relative 2-norm)"
        )


def last_logits(model: MoEModel, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """One eager prefill of `prompts` on the host -> [B, vocab] logits of each one's last token."""
    with torch.inference_mode():
        return model.forward(*_prefill(model, prompts))


def reference_logits(model: MoEModel, source: str | Path, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """`last_logits` of the unquantized model `model` was loaded from (`source`, in its dtype), one
    layer at a time: each layer read again from `source` in place of `model`'s for its step, then let
    go, so only one layer is ever held unquantized -> [B, vocab]."""
    ids, cache, layout = _prefill(model, prompts)
    layers = model.weights.layers
    with torch.inference_mode(), opened(source, model.spec) as tensors:
        top = model.weights
        if top.lm_head_packed is not None:  # --lm-head-format: the head as stored
            stored = TensorMap.for_spec(model.spec).load_top(tensors, []).lm_head  # [vocab, hidden (+ 1)]
            top = evolve(top, lm_head=stored, lm_head_packed=None)
        reference = evolve(model, weights=evolve(top, layers=list(layers)))  # its own layer list
        hidden = reference.embed(ids)  # [T, hidden]
        rope = reference.rope(layout, hidden.device)
        for layer in range(model.spec.layers):
            reference.weights.layers[layer] = read_layer(tensors, model.spec, layer)
            hidden, _ = reference.forward_layer(layer, hidden, cache, layout, rope)
            reference.weights.layers[layer] = layers[layer]  # the unquantized layer let go
        return reference.logits(hidden[on(layout.last_rows, hidden.device)])


def _prefill(model: MoEModel, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, KVCache, TokenLayout]:
    """ids [T] of `prompts` one after another, a fresh host cache for them, and their layout."""
    lengths = tuple(len(p) for p in prompts)
    cache = model.new_cache(len(prompts), max(lengths))
    layout = TokenLayout(tuple(range(len(prompts))), lengths, (0,) * len(prompts))
    return torch.tensor([t for p in prompts for t in p], dtype=torch.int64), cache, layout


def measured(
    model: MoEModel, source: str | Path, packing: Packing, prompts: Sequence[Sequence[int]]
) -> QuantError | None:
    """For a model loaded from `source` as `packing` says: the error what it quantized on load
    introduced on the first of `prompts` (None where nothing was, fp8 keeping what the checkpoint
    stores, or there is no prompt to measure on); a checkpoint quantized before flowmoe read it, as
    such, since nothing unquantized is there to measure against."""
    stored = stored_quantization(source)
    if stored is not None:
        return QuantError(packing.expert_format, 0, None, None, stored.describe())
    sample = list(prompts[:MAX_PROMPTS])
    if not sample or not packing.quantizes:
        return None
    quantized = last_logits(model, sample)
    reference = reference_logits(model, source, sample)
    return QuantError.between(
        packing.expert_format, reference, quantized, packing.attention_format, packing.lm_head_format
    )
