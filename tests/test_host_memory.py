"""Host weights in one arena per layer, and host buffers on transparent huge pages."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import pytest
import torch
from attrs import fields
from safetensors.torch import load_file

from flowmoe.kernels.host_memory import HUGE_PAGE, huge_empty, huge_zeros
from flowmoe.model.arena import ALIGN, arena_of
from flowmoe.model.loading import load_model
from flowmoe.model.weights import AttentionWeights
from tests.hf_models import hf_model, save_hf

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
PAGE_KIB = mmap.PAGESIZE // 1024


def _thp_mode() -> str | None:
    try:
        return re.search(r"\[(\w+)\]", THP.read_text()).group(1)
    except (OSError, AttributeError):
        return None


def _smaps_kib(tensor: torch.Tensor, field: str = "AnonHugePages") -> int:
    """`field` (KiB) of the mapping that holds `tensor` (/proc/self/smaps): AnonHugePages, Rss."""
    address, lines = tensor.data_ptr(), Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def test_a_large_buffer_starts_on_a_huge_page_and_gets_huge_pages() -> None:
    buffer = huge_empty(3 * HUGE_PAGE)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 3 * HUGE_PAGE
    assert buffer.data_ptr() % HUGE_PAGE == 0
    buffer.fill_(7)  # first touch allocates the pages
    assert int(buffer[-1]) == 7
    if _thp_mode() not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {_thp_mode()!r} here")
    assert _smaps_kib(buffer) >= HUGE_PAGE // 1024  # at least one huge page (the OS may split some)


def test_small_buffers_and_the_switch_give_ordinary_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    assert huge_empty(1000).numel() == 1000
    monkeypatch.setenv("FLOWMOE_HUGE_PAGES", "0")
    buffer = huge_empty(3 * HUGE_PAGE)
    assert buffer.numel() == 3 * HUGE_PAGE and buffer.untyped_storage().nbytes() == 3 * HUGE_PAGE


def test_huge_zeros_is_zeros() -> None:
    z = huge_zeros((3, 1024, 700), torch.bfloat16)
    assert z.shape == (3, 1024, 700) and z.dtype == torch.bfloat16 and not z.any()


def test_loaded_weights_live_in_one_arena_per_layer(mixtral_folder: Path) -> None:
    model = load_model(mixtral_folder)
    storages = set()
    for lw in model.weights.layers:
        arena = arena_of(lw)
        assert arena is not None
        tensors = [getattr(lw.attn, f.name) for f in fields(AttentionWeights)]
        tensors += [t for ffn in lw.experts for t in ffn.tensors()] + [lw.router]
        for t in (t for t in tensors if t is not None):
            assert t.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
            assert (t.data_ptr() - arena.data_ptr()) % ALIGN == 0
        storages.add(arena.untyped_storage().data_ptr())
    assert len(storages) == model.spec.layers
    top = model.weights
    assert top.final_norm.arena is top.lm_head.arena
    # the untied embedding stays in the mapped file as stored (a step reads its tokens' rows), also
    # where the run computes in another dtype: MoEModel.embed converts the rows it reads
    assert not hasattr(top.embed, "arena") and hasattr(top.embed, "release")
    converted = load_model(mixtral_folder, "bfloat16")
    w = converted.weights
    assert w.embed.dtype == torch.float32 and hasattr(w.embed, "release") and not hasattr(w.embed, "arena")
    assert converted.dtype == torch.bfloat16 and w.final_norm.arena is w.lm_head.arena
    shard = next(mixtral_folder.glob("*.safetensors"))
    table = load_file(shard)["model.embed_tokens.weight"]  # [vocab, hidden]
    # a step's rows come from the file (model/file_rows.py), converted where the run computes in
    # another dtype: the table's bits, and none of its pages mapped into the process
    many = torch.arange(3 * 64 + 5) % table.shape[0]  # [T]
    for ids in (torch.tensor([0, 5, 3, 5]), many, many[:1]):
        assert torch.equal(converted.embed(ids), table.to(torch.bfloat16)[ids])
        assert torch.equal(model.embed(ids), table[ids])
    assert _smaps_kib(top.embed, "Rss") == 0 and _smaps_kib(w.embed, "Rss") == 0


def test_a_tied_lm_head_stays_the_embedding(tmp_path: Path) -> None:
    hf = hf_model("mixtral")
    hf.config.tie_word_embeddings = True
    hf.tie_weights()
    model = load_model(save_hf(hf, tmp_path / "tied"))
    assert model.spec.tie_embeddings
    assert model.weights.lm_head is model.weights.embed
    assert torch.equal(model.weights.embed, hf.model.embed_tokens.weight.detach())


def test_a_refused_mapping_or_advice_falls_back_to_ordinary_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """No huge pages is only slower: a mapping the OS refuses, or a kernel without THP."""
    import mmap

    from flowmoe.kernels import host_memory

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(host_memory.mmap, "mmap", refuse)
    assert huge_empty(3 * HUGE_PAGE).numel() == 3 * HUGE_PAGE
    monkeypatch.undo()

    class NoAdvice(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(host_memory.mmap, "mmap", NoAdvice)
    buffer = huge_empty(3 * HUGE_PAGE)
    buffer.fill_(3)
    assert buffer.numel() == 3 * HUGE_PAGE and int(buffer.sum()) == 9 * HUGE_PAGE
