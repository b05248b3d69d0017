"""The error a quantize-on-load expert format introduces, measured on the run's own prompts: the
last-token logits of the job's first prompts (the first micro-batch's worth, at most
`MAX_PROMPTS`), computed eagerly on the host before the experts are packed and after, compared per
prompt as the relative error ||quantized - reference|| / ||reference|| (2-norms over the vocabulary).
A run reports its largest and its mean (cli/run.py: the printed report, --json, the run record).

A checkpoint quantized before flowmoe read it (GPTQ, AWQ, compressed-tensors) is reported as such
instead, whatever the expert format: its quantization, and that its error against the unquantized
model is not measured (the checkpoint holds no unquantized weights)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from attrs import frozen

from flowmoe.core.policy import QUANTIZED_ON_LOAD, ExpertFormat
from flowmoe.kernels.layout import TokenLayout
from flowmoe.model.loading import pack_experts, stored_quantization
from flowmoe.model.moe_model import MoEModel

MAX_PROMPTS = 8  # bounds the two eager passes' cost; a sample, not the job


@frozen
class QuantError:
    expert_format: ExpertFormat
    prompts: int  # prompts measured
    max_rel: float | None  # largest relative error of a prompt's last-token logits
    mean_rel: float | None  # mean over the prompts
    checkpoint: str | None = None  # the checkpoint's own quantization, where it came quantized

    @classmethod
    def between(
        cls, expert_format: ExpertFormat, reference: torch.Tensor, quantized: torch.Tensor
    ) -> QuantError:
        """reference, quantized: [B, vocab] logits of the same prompts."""
        ref, ours = reference.float(), quantized.float()
        tiny = torch.finfo(torch.float32).tiny
        rel = (ours - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(tiny)  # [B]
        return cls(expert_format, rel.numel(), float(rel.max()), float(rel.mean()))

    def as_json(self) -> dict[str, Any]:
        return {"expert_format": self.expert_format, "quantized_on_load": self.checkpoint is None,
                "prompts": self.prompts, "logits_rel_err_max": self.max_rel,
                "logits_rel_err_mean": self.mean_rel, "checkpoint": self.checkpoint}  # fmt: skip

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
            f"experts quantized to {self.expert_format} on load: last-token logits of the first "
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
) -> QuantError | None:
    """`pack_experts`, and for a format quantized on load (not fp8, which keeps what the checkpoint
    stores) with prompts to measure on, the error it introduced on the first of them."""
    stored = stored_quantization(source)
    if stored is not None:  # quantized before flowmoe read it: nothing to measure against
        pack_experts(model, source, expert_format, device)
        return QuantError(expert_format, 0, None, None, stored.describe())
    sample = list(prompts[:MAX_PROMPTS])
    measured = expert_format in QUANTIZED_ON_LOAD and bool(sample)
    reference = last_logits(model, sample) if measured else None
    pack_experts(model, source, expert_format, device)
    if reference is None:
        return None
    return QuantError.between(expert_format, reference, last_logits(model, sample))
