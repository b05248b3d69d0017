"""Which checkpoint tensors a layer needs, at which shapes, and how they become LayerWeights.

The same map serves every weight source (a checkpoint folder, random weights of
a preset): a source only answers `has(name)` and `get(name, shape)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from attrs import frozen

from flowmoe.core.errors import CheckpointError
from flowmoe.core.families import TensorNames, family_named
from flowmoe.core.spec import ModelSpec
from flowmoe.model.mla_weights import load_mla, mla_tensors
from flowmoe.model.weights import AttentionWeights, FFNWeights, LayerWeights, ModelWeights

Shape = tuple[int, ...]
# how a layer's stacked tensors (q k v, gate up) are joined along their rows: torch.cat, or a cat
# written straight into the place the caller keeps the result in (model/arena.py's plan)
Stack = Callable[[list[torch.Tensor]], torch.Tensor]


class TensorSource(Protocol):
    def has(self, name: str) -> bool: ...

    def get(self, name: str, shape: Shape) -> torch.Tensor: ...


@frozen
class MoELayout:
    """How one layer's MoE block is stored: its name prefix and per-expert or fused experts."""

    prefix: str
    fused: bool


@frozen
class TensorMap:
    spec: ModelSpec
    names: TensorNames

    @classmethod
    def for_spec(cls, spec: ModelSpec) -> TensorMap:
        return cls(spec, family_named(spec.family).names)

    # ---- names and shapes

    def top_level(self) -> dict[str, Shape]:
        s = self.spec
        out: dict[str, Shape] = {
            "model.embed_tokens.weight": (s.vocab, s.hidden),
            "model.norm.weight": (s.hidden,),
        }
        if not s.tie_embeddings:
            out["lm_head.weight"] = (s.vocab, s.hidden)
        if s.norm == "layer":
            out["model.norm.bias"] = (s.hidden,)
        if s.lm_head_bias:
            out["lm_head.bias"] = (s.vocab,)
        return out

    def moe_layout(self, layer: int, has: Callable[[str], bool]) -> MoELayout:
        base = f"model.layers.{layer}."
        for prefix in self.names.moe_prefixes:
            if has(f"{base}{prefix}.{self.names.router}.weight"):
                return MoELayout(prefix, has(f"{base}{prefix}.{self.names.fused[0]}"))
        wanted = f"{base}{self.names.moe_prefixes[0]}.{self.names.router}.weight"
        raise CheckpointError(f"tensor {wanted} is missing (the router of layer {layer})")

    def layer_tensors(self, layer: int, has: Callable[[str], bool]) -> dict[str, Shape]:
        """Every tensor layer `layer` needs, with its expected shape."""
        s, a = self.spec, self.spec.attention
        base = f"model.layers.{layer}."
        q, kv, hidden = a.heads * a.head_dim, a.kv_heads * a.head_dim, s.hidden
        out: dict[str, Shape] = {
            f"{base}input_layernorm.weight": (hidden,),
            f"{base}post_attention_layernorm.weight": (hidden,),
            f"{base}self_attn.q_proj.weight": (q, hidden),
            f"{base}self_attn.k_proj.weight": (kv, hidden),
            f"{base}self_attn.v_proj.weight": (kv, hidden),
            f"{base}self_attn.o_proj.weight": (hidden, q),
        }
        if a.mla is not None:  # no q/k/v projections: the latent attention's own
            out = mla_tensors(s, base)
        if a.qkv_bias:
            out |= {f"{base}self_attn.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv))}
        if a.o_bias:
            out[f"{base}self_attn.o_proj.bias"] = (hidden,)
        if a.qk_norm in ("head", "full"):  # "l2" has no weight
            head = a.qk_norm == "head"
            out[f"{base}self_attn.q_norm.weight"] = (a.head_dim,) if head else (q,)
            out[f"{base}self_attn.k_norm.weight"] = (a.head_dim,) if head else (kv,)
        if a.sinks:
            out[f"{base}self_attn.sinks"] = (a.heads,)
        if s.norm == "layer":
            out |= {f"{base}{n}_layernorm.bias": (hidden,) for n in ("input", "post_attention")}
        if not s.is_moe_layer(layer):
            return out | self._ffn(f"{base}{self.names.dense_mlp}.", s.moe.dense_intermediate)
        return out | self._moe_tensors(layer, self.moe_layout(layer, has))

    def _ffn(self, prefix: str, inter: int) -> dict[str, Shape]:
        h = self.spec.hidden
        return {
            f"{prefix}gate_proj.weight": (inter, h),
            f"{prefix}up_proj.weight": (inter, h),
            f"{prefix}down_proj.weight": (h, inter),
        }

    def _moe_tensors(self, layer: int, layout: MoELayout) -> dict[str, Shape]:
        m, h = self.spec.moe, self.spec.hidden
        p = f"model.layers.{layer}.{layout.prefix}."
        out: dict[str, Shape] = {f"{p}{self.names.router}.weight": (m.experts, h)}
        if m.router_bias:
            out[f"{p}{self.names.router}.bias"] = (m.experts,)
        if m.selection_bias:
            rows = self.names.selection_bias_rows
            out[f"{p}{self.names.selection_bias}"] = (1, m.experts) if rows else (m.experts,)
        inter = m.intermediate
        if layout.fused:
            gate_up, down = self.names.fused
            by_columns = self.names.fused_gate_up != "rows"
            out[f"{p}{gate_up}"] = (m.experts, h, 2 * inter) if by_columns else (m.experts, 2 * inter, h)
            out[f"{p}{down}"] = (m.experts, inter, h) if by_columns else (m.experts, h, inter)
            if m.expert_bias:
                out[f"{p}experts.gate_up_proj_bias"] = (m.experts, 2 * inter)
                out[f"{p}experts.down_proj_bias"] = (m.experts, h)
        else:
            gate, up, down = self.names.expert_proj
            for e in range(m.experts):
                out |= {
                    f"{p}experts.{e}.{gate}.weight": (inter, h),
                    f"{p}experts.{e}.{up}.weight": (inter, h),
                    f"{p}experts.{e}.{down}.weight": (h, inter),
                }
        if m.has_shared:
            out |= self._ffn(f"{p}{self.names.shared_expert}.", m.shared_intermediate)
            if m.shared_gate:
                out[f"{p}{self.names.shared_gate}.weight"] = (1, h)
        return out

    # ---- assembly

    def load_top(self, source: TensorSource, layers: list[LayerWeights]) -> ModelWeights:
        shapes = self.top_level()
        embed = source.get("model.embed_tokens.weight", shapes["model.embed_tokens.weight"])
        head = embed if self.spec.tie_embeddings else source.get("lm_head.weight", shapes["lm_head.weight"])
        if self.spec.lm_head_bias:  # [vocab, hidden + 1]: the bias as a last column, in the model's dtype
            bias = source.get("lm_head.bias", shapes["lm_head.bias"])[:, None]  # [vocab, 1]
            joined = head.new_empty((head.shape[0], head.shape[1] + 1), dtype=getattr(torch, self.spec.dtype))
            head = torch.cat([head, bias], dim=1, out=joined)
        norm = _norm_from(lambda name: source.get(name, shapes[name]), "model.norm.", self.spec.norm)
        return ModelWeights(embed, norm, head, layers)

    def load_layer(self, layer: int, source: TensorSource, stack: Stack = torch.cat) -> LayerWeights:
        """Layer `layer` from `source`; q k v and each FFN's gate and up are joined by `stack`."""
        shapes = self.layer_tensors(layer, source.has)

        def get(name: str) -> torch.Tensor:
            return source.get(name, shapes[name])

        def opt(name: str) -> torch.Tensor | None:
            return get(name) if name in shapes else None

        base = f"model.layers.{layer}."
        mla = self.spec.attention.mla
        attn = load_mla(get, base, self.spec, stack) if mla else self._attention(get, opt, base, stack)
        proj = ("gate_proj", "up_proj", "down_proj")
        if not self.spec.is_moe_layer(layer):
            dense = _ffn_from(get, f"{base}{self.names.dense_mlp}.", proj, stack)
            return LayerWeights(attn=attn, dense=dense)
        layout = self.moe_layout(layer, source.has)
        p = f"{base}{layout.prefix}."
        m = self.spec.moe
        experts = self._fused_experts(p, get, opt) if layout.fused else [
            _ffn_from(get, f"{p}experts.{e}.", self.names.expert_proj, stack) for e in range(m.experts)
        ]  # fmt: skip
        shared = _ffn_from(get, f"{p}{self.names.shared_expert}.", proj, stack) if m.has_shared else None
        return LayerWeights(
            attn=attn,
            router=get(f"{p}{self.names.router}.weight"),
            router_bias=opt(f"{p}{self.names.router}.bias"),
            experts=experts,
            shared=shared,
            shared_gate=opt(f"{p}{self.names.shared_gate}.weight"),
            selection_bias=opt(f"{p}{self.names.selection_bias}") if m.selection_bias else None,
        )

    def _attention(
        self,
        get: Callable[[str], torch.Tensor],
        opt: Callable[[str], torch.Tensor | None],
        base: str,
        stack: Stack,
    ) -> AttentionWeights:
        sa = f"{base}self_attn."
        qkv = stack([self._rope_rows(p, get(f"{sa}{p}_proj.weight")) for p in "qkv"])
        qkv_bias = (
            stack([self._rope_rows(p, get(f"{sa}{p}_proj.bias")) for p in "qkv"])
            if self.spec.attention.qkv_bias
            else None
        )
        return AttentionWeights(
            input_norm=_norm_from(get, f"{base}input_layernorm.", self.spec.norm, stack),
            qkv=qkv,
            o=get(f"{sa}o_proj.weight"),
            post_norm=_norm_from(get, f"{base}post_attention_layernorm.", self.spec.norm, stack),
            qkv_bias=qkv_bias,
            o_bias=opt(f"{sa}o_proj.bias"),
            q_norm=opt(f"{sa}q_norm.weight"),
            k_norm=opt(f"{sa}k_norm.weight"),
            sinks=opt(f"{sa}sinks"),
        )

    def _rope_rows(self, proj: str, tensor: torch.Tensor) -> torch.Tensor:
        """q or k rows (or bias) of a family whose rope rotates (x0, x1), (x2, x3)... pairs, reordered
        per head to x0 x2 ... x1 x3 ...: the rotate-half rope then computes the same rotation, and
        q·k is unchanged because q and k are reordered alike."""
        a = self.spec.attention
        if not self.names.rope_pairs or proj == "v":
            return tensor
        heads = tensor.reshape(-1, a.head_dim // 2, 2, *tensor.shape[1:])  # [heads, D/2, 2, ...]
        return heads.transpose(1, 2).reshape(tensor.shape).contiguous()

    def _fused_experts(
        self,
        p: str,
        get: Callable[[str], torch.Tensor],
        opt: Callable[[str], torch.Tensor | None],
    ) -> list[FFNWeights]:
        gate_up, down = (get(f"{p}{name}") for name in self.names.fused)
        gate_up_bias, down_bias = opt(f"{p}experts.gate_up_proj_bias"), opt(f"{p}experts.down_proj_bias")
        interleaved = self.names.fused_gate_up == "interleaved_columns"
        experts = []
        for e in range(self.spec.moe.experts):
            gu, dn = gate_up[e], down[e]
            gub = gate_up_bias[e] if gate_up_bias is not None else None
            if interleaved:  # [H, 2I] columns g0 u0 g1 u1 ... -> [2I, H] gate rows then up rows
                # through [H, I, 2] -> [H, 2, I] (bias [I, 2] -> [2, I]): one copy each, no torch.cat,
                # which on the meta tensors arena.plan_layer builds from imports torch's meta kernels
                gu = gu.reshape(gu.shape[0], -1, 2).transpose(1, 2).reshape(gu.shape).t()
                dn = dn.t()  # [I, H] -> [H, I]
                gub = gub.reshape(-1, 2).t().reshape(gub.shape) if gub is not None else None
            elif self.names.fused_gate_up == "columns":  # [H, 2I] gate columns then up columns
                gu, dn = gu.t(), dn.t()  # -> [2I, H], [H, I]
            experts.append(
                FFNWeights(
                    gu.contiguous(),
                    dn.contiguous(),
                    gub.contiguous() if gub is not None else None,
                    down_bias[e].contiguous() if down_bias is not None else None,
                )
            )
        return experts


def _norm_from(
    get: Callable[[str], torch.Tensor], prefix: str, kind: str, stack: Stack = torch.cat
) -> torch.Tensor:
    """An RMSNorm weight [dim], or a LayerNorm's weight and bias stacked by `stack` as [2, dim]."""
    weight = get(f"{prefix}weight")
    return stack([weight[None], get(f"{prefix}bias")[None]]) if kind == "layer" else weight


def _ffn_from(
    get: Callable[[str], torch.Tensor], prefix: str, proj: tuple[str, str, str], stack: Stack
) -> FFNWeights:
    gate, up, down = (get(f"{prefix}{n}.weight") for n in proj)
    return FFNWeights(stack([gate, up]), down)
