"""NodeFactory's bytes and flops of each op: weights read once, so much per new token, per cached
token, per (query, key) pair and per sequence (`scheduling.Rate`), whatever the micro-batch."""

from __future__ import annotations

import pytest

from flowmoe.core.plan import Lane, Op
from flowmoe.core.presets import preset
from flowmoe.core.scheduling import MicroBatchShape, NodeFactory
from flowmoe.core.spec import ModelSpec

MICRO_BATCHES = [
    MicroBatchShape.from_lengths(0, [1], [100]),  # a decode step
    MicroBatchShape.from_lengths(1, [7, 5, 1], [0, 3, 40]),  # prefills beside a decode
]
SPECS = ["mixtral-8x7b", "deepseek-v2-lite"]  # grouped-query attention; latent attention (MLA)
GPU = Lane.GPU_COMPUTE


def _spec(name: str) -> ModelSpec:
    return preset(name, layers=3)


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("mb", MICRO_BATCHES)
def test_attention_reads_the_cache_and_attends_every_pair(name: str, mb: MicroBatchShape) -> None:
    s = _spec(name)
    a, b = s.attention, s.dtype_bytes
    node = NodeFactory(s).node(Op.CPU_ATTN, Lane.CPU_COMPUTE, 1, mb)
    assert node.bytes == mb.kv_tokens * 2 * a.kv_width * b + mb.tokens * (a.q_width + a.out_width) * b
    assert node.flops == mb.attended * a.pair_flops()


@pytest.mark.parametrize("mb", MICRO_BATCHES)
def test_a_kv_load_moves_the_tokens_cached_before_the_step_and_a_store_its_new_ones(
    mb: MicroBatchShape,
) -> None:
    s = _spec("mixtral-8x7b")
    per_token = 2 * s.attention.kv_width * s.dtype_bytes
    f = NodeFactory(s)
    load, store = f.node(Op.KV_LOAD, Lane.GPU_H2D, 0, mb), f.node(Op.KV_STORE, Lane.GPU_D2H, 0, mb)
    assert (load.bytes, load.flops) == ((mb.kv_tokens - mb.tokens) * per_token, 0)
    assert (store.bytes, store.flops) == (mb.tokens * per_token, 0)


@pytest.mark.parametrize("mb", MICRO_BATCHES)
def test_an_expert_is_priced_by_the_tokens_it_is_given(mb: MicroBatchShape) -> None:
    s = _spec("mixtral-8x7b")
    h, inter, b = s.hidden, s.moe.intermediate, s.dtype_bytes
    f = NodeFactory(s)
    for tokens, n in ((None, mb.tokens), (2, 2)):
        node = f.node(Op.EXPERT_FFN, GPU, 0, mb, 3, tokens=tokens)
        assert (node.bytes, node.flops) == (3 * h * inter * b + 2 * n * h * b, 6 * n * h * inter)
        assert node.rows == n


@pytest.mark.parametrize("mb", MICRO_BATCHES)
def test_other_ops_are_priced_by_their_micro_batchs_tokens(mb: MicroBatchShape) -> None:
    s = _spec("mixtral-8x7b")
    b = s.dtype_bytes
    node = NodeFactory(s).node(Op.GATE, GPU, 0, mb, tokens=1)  # `tokens` prices an FFN alone
    assert node.bytes == s.moe.experts * s.hidden * b + mb.tokens * s.hidden * b
    assert node.flops == 2 * s.moe.experts * s.hidden * mb.tokens


@pytest.mark.parametrize("mb", MICRO_BATCHES)
def test_the_lm_head_reads_its_weights_once_and_each_sequences_last_row(mb: MicroBatchShape) -> None:
    s = _spec("mixtral-8x7b")
    h, v, b = s.hidden, s.vocab, s.dtype_bytes
    node = NodeFactory(s).node(Op.LM_HEAD, GPU, mb=mb)
    assert (node.bytes, node.flops) == (v * h * b + mb.sequences * h * b, 2 * mb.sequences * h * v)
    assert node.rows == mb.sequences


def test_without_a_micro_batch_only_the_weights_count() -> None:
    s = _spec("mixtral-8x7b")
    f = NodeFactory(s)
    head = f.node(Op.LM_HEAD, GPU)
    assert (head.bytes, head.flops) == (s.vocab * s.hidden * s.dtype_bytes, 0)
    assert f.node(Op.GPU_ATTN, GPU, 0).bytes == 0
    copy = f.node(Op.PAGE_COPY, Lane.GPU_H2D, 0, MICRO_BATCHES[1], expert=2)  # a weight: no token counts
    assert (copy.bytes, copy.flops) == (s.expert_bytes, 0)


def test_a_shared_expert_is_priced_by_its_layers_width() -> None:
    s = _spec("deepseek-v2-lite")  # layer 0 dense, then MoE layers with shared experts
    mb, b, f = MICRO_BATCHES[0], s.dtype_bytes, NodeFactory(s)
    for layer, inter in ((0, s.moe.dense_intermediate), (1, s.moe.shared_intermediate)):
        node = f.node(Op.SHARED_FFN, GPU, layer, mb)
        assert node.flops == 6 * mb.tokens * s.hidden * inter
        assert node.bytes == 3 * s.hidden * inter * b + 2 * mb.tokens * s.hidden * b
