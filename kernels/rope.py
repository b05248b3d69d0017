"""Rotary position embeddings (default, linear and YaRN frequencies), rotate-half convention."""

from __future__ import annotations

import math

import torch
from attrs import Factory, field, frozen

from flowmoe.core.spec import RopeSpec
from flowmoe.kernels import cpu_rope


def inverse_frequencies(rope: RopeSpec, head_dim: int) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [head_dim/2] float32, attention scaling applied to cos/sin)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    pos_freqs = rope.theta**exponents  # [head_dim/2]
    if rope.kind == "default":
        return 1.0 / pos_freqs, 1.0
    if rope.kind == "linear":
        return 1.0 / (pos_freqs * rope.factor), 1.0
    if rope.kind == "llama3":
        return _llama3(rope, 1.0 / pos_freqs), 1.0
    if rope.kind == "longrope":  # as transformers' Phi-3.5-MoE: the short factors at every length
        return 1.0 / (torch.tensor(rope.short_factor, dtype=torch.float32) * pos_freqs), rope.short_mscale
    return _yarn(rope, head_dim, pos_freqs)


def _llama3(rope: RopeSpec, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1 / Llama 4: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    context = rope.original_max_positions
    wavelen = 2 * math.pi / inv_freq  # [head_dim/2]
    scaled = torch.where(wavelen > context / rope.low_freq_factor, inv_freq / rope.factor, inv_freq)
    smooth = (context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= context / rope.high_freq_factor) & (wavelen <= context / rope.low_freq_factor)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeSpec, dim: int, pos_freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    factor = rope.factor
    scaling = rope.attention_factor
    if scaling is None:
        scaling = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(rope.original_max_positions / (rotations * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # [dim/2]
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(scaling)


def longrope_scaling(rope: RopeSpec, lengths: torch.Tensor) -> torch.Tensor:
    """longrope's cos/sin scale per token as transformers applies it: long_mscale for every token of a
    call whose sequence reaches past the original context (a prefill of such a prompt included).
    lengths: [T] each token's sequence length after this step -> [T, 1]."""
    beyond = lengths[:, None] > rope.original_max_positions
    return torch.where(beyond, rope.long_mscale, rope.short_mscale).to(torch.float32)


@frozen
class Rotary:
    """A step's rotary embedding, shaped once for every layer that applies it: cos and sin [T, 1, R]
    broadcast over the heads (R: the rotated dims, head_dim or fewer for a partial rope), sin with its
    first half negated, so rotate-half's (-x2, x1) * sin is (x2, x1) * signed_sin: the same floats
    (a negation is exact) from one roll instead of two slices, a negation and a cat per use."""

    cos: torch.Tensor  # [T, 1, R]
    signed_sin: torch.Tensor  # [T, 1, R]
    # the two as the C kernels take them (None: they do not), checked once for the step's layers
    tables: cpu_rope.Tables | None = field(
        init=False, default=Factory(lambda self: cpu_rope.tables(self.cos, self.signed_sin), takes_self=True)
    )

    @classmethod
    def at(
        cls,
        inv_freq: torch.Tensor,
        scaling: float | torch.Tensor,
        positions: torch.Tensor,
        dtype: torch.dtype,
    ) -> Rotary:
        """positions: [T] int64 (`scaling`: a number or [T, 1])."""
        freqs = positions[:, None].to(torch.float32) * inv_freq[None, :].to(positions.device)  # [T, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, R]
        cos, sin = emb.cos(), emb.sin()  # [T, R] each
        if not isinstance(scaling, float) or scaling != 1.0:  # a product by 1.0 is the same floats
            cos, sin = cos * scaling, sin * scaling
        cos, sin = cos.to(dtype), sin.to(dtype)
        half = sin.shape[-1] // 2
        return cls(cos[:, None], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None])

    def rows(self, positions: torch.Tensor) -> Rotary:
        """The rotary embedding of `positions` [T] (int64, on this one's device), where this one is a
        table's (row p: position p)."""
        return Rotary(self.cos[positions], self.signed_sin[positions])  # [T, 1, R] each, contiguous

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] -> [T, heads, D], its first R dimensions rotated (rotate-half convention)."""
        rotary = self.cos.shape[-1]
        if rotary < x.shape[-1]:
            return torch.cat((self(x[..., :rotary]), x[..., rotary:]), dim=-1)
        tables = self.tables
        out = None if tables is None else cpu_rope.rotated(x, tables)  # one C call, the same floats
        if out is not None:
            return out
        return x * self.cos + x.roll(rotary // 2, dims=-1) * self.signed_sin

    def rotate_(self, x: torch.Tensor, heads: int) -> bool:
        """x [T, heads', D]'s first `heads` heads rotated in place, the first R dims of each, where one
        C call on the host takes x (-> True, else False: see cpu_rope.rotate_): the floats of
        `self(x[:, :heads])`, no new tensor. For a tensor of the caller's own (a projection's fresh
        output)."""
        tables = self.tables
        return tables is not None and cpu_rope.rotate_(x, heads, tables)
