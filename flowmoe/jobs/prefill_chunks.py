"""A step's tokens in chunks of at most N: the prefill's working set bounded.

A micro-batch of 8 prompts of 128 tokens is one step of 1024 tokens; every activation, router
output and expert temporary of the step scales with that. The engine runs such a step as
consecutive runner calls of at most `limit` tokens each, splitting a prompt where a chunk ends
(the later piece attends to the earlier one through the KV cache, as a decode does). Chunking
happens before the runner, so eager and every scheduler run the same chunks.

By default only a run on the CPU alone (no GPU; its KV cache on the CPU) in a dtype narrower than
float32 that torch multiplies by emulation (no AVX512-BF16 / AMX for bf16) is chunked
(`default_chunk`): there each chunk's projections fit the CPU kernels' row block and read their
weights in place, where a whole prefill's widen every weight to fp32 (kernels/linear.py) beside
products of every token. A float32 prefill widens nothing, nor does one where torch's bf16 is
native (oneDNN reads the bf16 weights: on a Zen 4 with AVX512-BF16, the bench's bf16 8 x 128-token
prefill took 2.4-2.6 CPU s in one call and peaked at 1.81 GiB, against 3.4-3.6 s and 1.84 GiB in
chunks of 128; bench/RESULTS.md, issue 25); a GPU's is fast because it reads each weight once for all
the step's tokens, and an offloading scheduler copies each expert in once per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from attrs import frozen

from flowmoe.kernels.cpu_expert import AVX2_MAX_ROWS, emulated
from flowmoe.kernels.kv_cache import Homes, SlotSplit
from flowmoe.kernels.layout import TokenLayout

__all__ = ["CPU_PREFILL_CHUNK", "Chunk", "chunked", "default_chunk", "final_logits"]

# the CPU kernels' row block (kernels/cpu_expert.py): a chunk's attention and dense projections are
# kernel calls on the weights as stored, not fp32 copies of them. llama.cpp's physical batch
# (n_ubatch, common/common.h) is 512; the bench's bf16 8 x 128-token prefill peaks at 1.747 GiB in
# one call, 1.719 in chunks of 512, 1.691 in chunks of 128, no slower (bench/RESULTS.md, issue 25)
CPU_PREFILL_CHUNK = AVX2_MAX_ROWS


def default_chunk(homes: Homes, gpu: bool = False, dtype: torch.dtype = torch.bfloat16) -> int | None:
    """The engine's tokens per runner call where the job sets none: CPU_PREFILL_CHUNK where the run
    has no GPU (`gpu`: a runtime whose GPU holds copies of weights), its weights are narrower than
    float32 and torch multiplies them by emulation (`dtype`: the model's; a float32 prefill widens no
    weight, and in chunks it ran 11-17% slower, issue 25; nor does a native bf16 one, 1.4x slower
    in chunks) and every layer's KV cache lives on the CPU (`homes`, as KVCache.allocate takes it),
    else None (a step in one call)."""
    if gpu or dtype == torch.float32 or not emulated(dtype) or isinstance(homes, SlotSplit):
        return None
    devices = [homes] if isinstance(homes, torch.device | str) else list(homes)
    return CPU_PREFILL_CHUNK if all(torch.device(d).type == "cpu" for d in devices) else None


@frozen
class Chunk:
    """One runner call's share of a micro-batch's step: `layout` covers ids[start : start + tokens]."""

    start: int
    layout: TokenLayout
    ends: tuple[int, ...]  # the chunk's sequences (rows of its logits) whose last token is in it


def chunked(layout: TokenLayout, limit: int | None) -> list[Chunk]:
    """The step of `layout` as chunks of at most `limit` tokens (None: no limit), in token order (one
    chunk, the same layout, where it fits); a sequence cut by a chunk's end goes on in the next, its
    past grown by the tokens before."""
    if limit is None or layout.tokens <= limit:
        return [Chunk(0, layout, tuple(range(len(layout.counts))))]
    chunks: list[Chunk] = []
    pieces: list[tuple[int, int, int, bool]] = []  # (slot, count, past, ends its sequence)
    start = room = 0
    for slot, count, past in zip(layout.slots, layout.counts, layout.past, strict=True):
        done = 0
        while done < count:
            if room == 0:  # the chunk so far is full
                chunks.extend(_chunk(start, pieces))
                start, room, pieces = start + sum(p[1] for p in pieces), limit, []
            take = min(count - done, room)
            pieces.append((slot, take, past + done, done + take == count))
            done, room = done + take, room - take
    return [*chunks, *_chunk(start, pieces)]


def _chunk(start: int, pieces: list[tuple[int, int, int, bool]]) -> list[Chunk]:
    """The chunk of `pieces` from token `start` (none where there are no pieces)."""
    if not pieces:
        return []
    slots, counts, past, ends = zip(*pieces, strict=True)
    return [Chunk(start, TokenLayout(slots, counts, past), tuple(i for i, e in enumerate(ends) if e))]


def final_logits(chunks: Sequence[Chunk], logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each chunk's logits [its sequences, vocab] -> the step's [B, vocab]: the row of each
    sequence's last piece, in the step's order."""
    if len(chunks) == 1:
        return logits[0]
    return torch.cat([rows[list(c.ends)] for c, rows in zip(chunks, logits, strict=True) if c.ends])
