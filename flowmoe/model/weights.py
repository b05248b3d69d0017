"""Weight containers in flowmoe's canonical layout, whatever layout the checkpoint used.

Projections keep the nn.Linear convention ([out, in]). q, k and v are stacked
into one [q + 2kv, hidden] matrix; an expert's gate and up projections are
stacked into one [2I, hidden] matrix (gate rows first), so each costs one matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from attrs import define, field

if TYPE_CHECKING:
    from flowmoe.model.quantized import PackedWeight, QuantizedExpert


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@define
class FFNWeights:
    """One SwiGLU FFN: a routed expert, a shared expert or a dense MLP."""

    gate_up: torch.Tensor  # [2I, hidden]
    down: torch.Tensor  # [hidden, I]
    gate_up_bias: torch.Tensor | None = None  # [2I]
    down_bias: torch.Tensor | None = None  # [hidden]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.gate_up, self.down, self.gate_up_bias, self.down_bias)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.gate_up, self.down, self.gate_up_bias, self.down_bias) if t is not None]

    def mapped(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> FFNWeights:
        """The same FFN with `fn` applied to each of its tensors (the biases it has)."""
        up_bias, down_bias = self.gate_up_bias, self.down_bias
        return FFNWeights(
            fn(self.gate_up),
            fn(self.down),
            None if up_bias is None else fn(up_bias),
            None if down_bias is None else fn(down_bias),
        )


@define
class AttentionWeights:
    input_norm: torch.Tensor  # [hidden]; [2, hidden] (weight; bias) for a LayerNorm
    qkv: torch.Tensor  # [(H + 2 KVH) * D, hidden]
    o: torch.Tensor  # [hidden, H * D]
    post_norm: torch.Tensor  # [hidden]
    qkv_bias: torch.Tensor | None = None  # [(H + 2 KVH) * D]
    o_bias: torch.Tensor | None = None  # [hidden]
    q_norm: torch.Tensor | None = None  # [D] per head, or [H * D] over the projection
    k_norm: torch.Tensor | None = None  # [D] or [KVH * D]
    sinks: torch.Tensor | None = None  # [H]
    # multi-head latent attention: `qkv` is then the down-projection [(q LoRA rank or H * qk) + r + R, hidden]
    q_a_norm: torch.Tensor | None = None  # [q LoRA rank]
    q_b: torch.Tensor | None = None  # [H * qk_head_dim, q LoRA rank]
    kv_a_norm: torch.Tensor | None = None  # [r]
    kv_b: torch.Tensor | None = None  # [H * (qk_nope_head_dim + v_head_dim), r]

    @property
    def nbytes(self) -> int:
        return _nbytes(
            self.input_norm, self.qkv, self.o, self.post_norm, self.qkv_bias, self.o_bias,
            self.q_norm, self.k_norm, self.sinks, self.q_a_norm, self.q_b, self.kv_a_norm, self.kv_b,
        )  # fmt: skip


@define
class LayerWeights:
    attn: AttentionWeights
    router: torch.Tensor | None = None  # [E, hidden]; None on a dense layer
    router_bias: torch.Tensor | None = None  # [E]
    experts: list[FFNWeights] = field(factory=list)  # empty where the experts are kept `packed`
    shared: FFNWeights | None = None
    shared_gate: torch.Tensor | None = None  # [1, hidden]
    dense: FFNWeights | None = None
    # a packed expert format (fp8, int8, int4, hqq4: model/quantized.py): the routed experts as kept
    packed: list[QuantizedExpert] = field(factory=list)
    selection_bias: torch.Tensor | None = None  # [1, E] added to the scores for the choice only
    # a packed attention format (int8, int4, hqq4: model/quantize.py): (q/k/v [q + 2kv, hidden],
    # o [hidden, q]) as kept in host memory, which the CPU's packed kernels read; `attn` holds them
    # dequantized (what the GPU copies)
    attention_packed: tuple[PackedWeight, PackedWeight] | None = None

    def expert(self, expert: int) -> FFNWeights:
        """Routed expert `expert`: as loaded, or its packed copy where only that is kept (a PackedFFN:
        the CPU's packed kernels read it as it is, other readers get its tensors dequantized)."""
        return self.experts[expert] if self.experts else self.packed[expert].as_ffn()

    def expert_nbytes(self, expert: int) -> int:
        """Bytes of routed expert `expert` in the model's dtype (as the GPU holds it)."""
        return self.experts[expert].nbytes if self.experts else self.packed[expert].ffn_nbytes

    @property
    def dense_nbytes(self) -> int:
        """Bytes of everything but the routed experts."""
        extra = [f.nbytes for f in (self.shared, self.dense) if f is not None]
        router = _nbytes(self.router, self.router_bias, self.shared_gate, self.selection_bias)
        return self.attn.nbytes + router + sum(extra)


@define
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    final_norm: torch.Tensor  # [hidden]; [2, hidden] for a LayerNorm
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied; [vocab, hidden + 1] with a bias
    layers: list[LayerWeights]
    # --lm-head-format (int8, int4, hqq4: model/quantize.py): the head's [vocab, hidden] as kept in host
    # memory, which the CPU's packed kernel reads; `lm_head` holds it dequantized (what the GPU copies)
    lm_head_packed: PackedWeight | None = None
