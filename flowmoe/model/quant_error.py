"""The error a quantize-on-load expert format introduces, measured on the run's own prompts: the
last-token logits of the job's first prompts (the first micro-batch's worth, at most
`MAX_PROMPTS`), computed eagerly on the host before the experts are packed and after, compared per
prompt as the relative error ||quantized - reference|| / ||reference|| (2-norms over the vocabulary).
A run reports its largest and its mean (cli/run.py: the printed report, --json, the run record), and
what was quantized: the routed experts (--expert-format), the attention projections
(--attention-format: model/quantize.py, `quantize_attention`), or both, measured together.

A checkpoint quantized before flowmoe read it (GPTQ, AWQ, compressed-tensors) is reported as such
instead, whatever the expert format: its quantization, and that its error against the unquantized
model is not measured (the checkpoint holds no unquantized weights)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from attrs import frozen

from flowmoe.core.errors import ConfigError
from flowmoe.core.expert_formats import attention_projections
from flowmoe.core.policy import QUANTIZED_ON_LOAD, AttentionFormat, ExpertFormat
from flowmoe.kernels.layout import TokenLayout
from flowmoe.model.checkpoint import Checkpoint
from flowmoe.model.loading import pack_experts, stored_quantization
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.quantize import quantize_attention

MAX_PROMPTS = 8  # bounds the two eager passes' cost; a sample, not the job


@frozen
class QuantError:
    expert_format: ExpertFormat
    prompts: int  # prompts measured
    max_rel: float | None  # largest relative error of a prompt's last-token logits
    mean_rel: float | None  # mean over the prompts
    checkpoint: str | None = None  # the checkpoint's own quantization, where it came quantized
    attention_format: AttentionFormat = "native"  # the attention projections' (q/k/v, o)

    @classmethod
    def between(
        cls,
        expert_format: ExpertFormat,
        reference: torch.Tensor,
        quantized: torch.Tensor,
        attention_format: AttentionFormat = "native",
    ) -> QuantError:
        """reference, quantized: [B, vocab] logits of the same prompts."""
        ref, ours = reference.float(), quantized.float()
        tiny = torch.finfo(torch.float32).tiny
        rel = (ours - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(tiny)  # [B]
        return cls(expert_format, rel.numel(), float(rel.max()), float(rel.mean()), None, attention_format)

    def as_json(self) -> dict[str, Any]:
        return {"expert_format": self.expert_format, "attention_format": self.attention_format,
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
    lengths = tuple(len(p) for p in prompts)
    cache = model.new_cache(len(prompts), max(lengths))
    layout = TokenLayout(tuple(range(len(prompts))), lengths, (0,) * len(prompts))
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)  # [T]
    with torch.inference_mode():
        return model.forward(ids, cache, layout)


def pack_measured(
    model: MoEModel,
    source: str | Path,
    expert_format: ExpertFormat,
    prompts: Sequence[Sequence[int]],
    device: torch.device | None = None,
    attention_format: AttentionFormat = "native",
) -> QuantError | None:
    """`pack_experts` and, with an attention format, `quantize_attention`; for what was quantized on
    load (not fp8, which keeps what the checkpoint stores) with prompts to measure on, the error it
    introduced on the first of them."""
    stored = stored_quantization(source)
    if attention_format != "native":
        attention_projections(model.spec)  # multi-head latent attention is refused before any work
        check_attention_source(source, attention_format, stored is not None)
    if stored is not None:  # quantized before flowmoe read it: nothing to measure against
        pack_experts(model, source, expert_format, device)
        return QuantError(expert_format, 0, None, None, stored.describe())
    sample = list(prompts[:MAX_PROMPTS])
    on_load = expert_format in QUANTIZED_ON_LOAD or attention_format != "native"
    reference = last_logits(model, sample) if on_load and sample else None
    pack_experts(model, source, expert_format, device)
    if attention_format != "native":
        quantize_attention(model.spec, model.weights, attention_format, device or torch.device("cpu"))
    if reference is None:
        return None
    return QuantError.between(expert_format, reference, last_logits(model, sample), attention_format)


def check_attention_source(source: str | Path, attention_format: AttentionFormat, stored: bool) -> None:
    """--attention-format quantizes weights in the model's own dtype: not a checkpoint quantized
    before (GPTQ, AWQ, compressed-tensors: `stored`; FP8)."""
    path = Path(source)
    if not path.is_dir():  # a preset: random weights in its dtype
        return
    if not stored:
        ckpt = Checkpoint.open(path)
        stored = ckpt.fp8 is not None
        ckpt.close()
    if stored:
        raise ConfigError(
            f"--attention-format {attention_format} quantizes a checkpoint in bfloat16, float16 or float32 "
            f"as it loads, and {path} is stored quantized already: leave --attention-format out"
        )
