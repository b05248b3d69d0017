"""Multi-head latent attention's checkpoint tensors (DeepSeek-V2/V3) and their canonical layout.

The down-projections that read the hidden state (q_a_proj or q_proj, and kv_a_proj_with_mqa) are
stacked into `AttentionWeights.qkv`, one matmul like the q/k/v projections of grouped-query attention;
the LoRA norms and up-projections keep their own fields.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flowmoe.core.spec import ModelSpec
from flowmoe.model.weights import AttentionWeights

Shape = tuple[int, ...]


def mla_tensors(spec: ModelSpec, base: str) -> dict[str, Shape]:
    """The tensors of layer `base`'s attention and its two norms, with their shapes."""
    a, hidden = spec.attention, spec.hidden
    m = a.mla
    assert m is not None
    sa = f"{base}self_attn."
    q = a.heads * m.qk_head_dim
    out: dict[str, Shape] = {
        f"{base}input_layernorm.weight": (hidden,),
        f"{base}post_attention_layernorm.weight": (hidden,),
        f"{sa}kv_a_proj_with_mqa.weight": (m.cache_dim, hidden),
        f"{sa}kv_a_layernorm.weight": (m.kv_lora_rank,),
        f"{sa}kv_b_proj.weight": (a.heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        f"{sa}o_proj.weight": (hidden, a.heads * m.v_head_dim),
    }
    if m.q_lora_rank:
        out |= {
            f"{sa}q_a_proj.weight": (m.q_lora_rank, hidden),
            f"{sa}q_a_layernorm.weight": (m.q_lora_rank,),
            f"{sa}q_b_proj.weight": (q, m.q_lora_rank),
        }
    else:
        out[f"{sa}q_proj.weight"] = (q, hidden)
    return out


def load_mla(
    get: Callable[[str], torch.Tensor],
    base: str,
    spec: ModelSpec,
    stack: Callable[[list[torch.Tensor]], torch.Tensor] = torch.cat,
) -> AttentionWeights:
    """Layer `base`'s attention; its two down-projections joined into `qkv` by `stack`."""
    m = spec.attention.mla
    assert m is not None
    sa = f"{base}self_attn."
    q_down = get(f"{sa}q_a_proj.weight") if m.q_lora_rank else get(f"{sa}q_proj.weight")
    return AttentionWeights(
        input_norm=get(f"{base}input_layernorm.weight"),
        qkv=stack([q_down, get(f"{sa}kv_a_proj_with_mqa.weight")]),
        o=get(f"{sa}o_proj.weight"),
        post_norm=get(f"{base}post_attention_layernorm.weight"),
        q_a_norm=get(f"{sa}q_a_layernorm.weight") if m.q_lora_rank else None,
        q_b=get(f"{sa}q_b_proj.weight") if m.q_lora_rank else None,
        kv_a_norm=get(f"{sa}kv_a_layernorm.weight"),
        kv_b=get(f"{sa}kv_b_proj.weight"),
    )
