"""A step's tokens in chunks of at most `prefill_chunk` (flowmoe/jobs/prefill_chunks.py): how a step
is cut, the same logits as the whole step, and every scheduler runs eager's chunks."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from flowmoe.core.policy import Policy
from flowmoe.jobs import prefill_chunks
from flowmoe.jobs.engine import Engine, StepInput, eager_step
from flowmoe.jobs.prefill_chunks import CPU_PREFILL_CHUNK, Chunk, chunked, default_chunk, final_logits
from flowmoe.kernels.kv_cache import SlotSplit
from flowmoe.kernels.layout import TokenLayout
from flowmoe.model.loading import load_model
from flowmoe.runtime.runner import Runtime, step_shape
from flowmoe.schedulers.registry import available
from tests.helpers import rel_err
from tests.hf_models import hf_model, save_hf
from tests.schedule_fixtures import assert_as_eager, generate


def _listed(chunks: list[Chunk]) -> list[tuple]:
    return [(c.start, c.layout.slots, c.layout.counts, c.layout.past, c.ends) for c in chunks]


def test_a_step_that_fits_is_one_chunk() -> None:
    layout = TokenLayout((0, 1), (3, 2), (0, 0))
    (chunk,) = chunked(layout, 5)
    assert chunk.layout is layout and (chunk.start, chunk.ends) == (0, (0, 1))


def test_a_prompt_cut_by_a_chunk_goes_on_in_the_next() -> None:
    """Sequences in slots 3, 0, 1 with 4, 7 and 1 new tokens, in chunks of 5: slot 0's prompt runs
    over three chunks, each piece's past counting the tokens before it."""
    layout = TokenLayout((3, 0, 1), (4, 7, 1), (0, 0, 5))
    assert _listed(chunked(layout, 5)) == [
        (0, (3, 0), (4, 1), (0, 0), (0,)),
        (5, (0,), (5,), (1,), ()),
        (10, (0, 1), (1, 1), (6, 5), (0, 1)),
    ]


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])  # attention over the cache, and MLA's
def test_chunks_give_the_whole_steps_logits(tmp_path, family: str) -> None:
    """fp32: a prefill of 3 prompts in chunks of 4 tokens -> each sequence's last logits within 1e-5
    of the prefill in one call."""
    model = load_model(save_hf(hf_model(family), tmp_path / family))
    layout = TokenLayout((1, 0, 2), (6, 3, 5), (0, 0, 0))
    ids = torch.randint(3, model.spec.vocab, (layout.tokens,), generator=torch.Generator().manual_seed(0))

    def run(limit: int) -> torch.Tensor:
        cache = model.new_cache(3, 8)
        chunks = chunked(layout, limit)
        step = [StepInput(0, ids[c.start : c.start + c.layout.tokens], c.layout, cache) for c in chunks]
        return final_logits(chunks, [asyncio.run(eager_step(model, [s]))[0] for s in step])

    whole, parts = run(layout.tokens), run(4)
    assert whole.shape == parts.shape == (3, model.spec.vocab)
    assert rel_err(parts, whole) <= 1e-5


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory):
    return load_model(save_hf(hf_model("mixtral"), tmp_path_factory.mktemp("chunks") / "mixtral"))


@pytest.fixture(scope="module")
def eager_chunks(mixtral):
    return generate(mixtral, eager_step, prefill_chunk=5)


@pytest.mark.parametrize("name", sorted(available()))
def test_every_scheduler_runs_eagers_chunks(mixtral, eager_chunks, name: str) -> None:
    """Prompts of 4-12 tokens in micro-batches of up to 30, in chunks of 5: each runner call of a
    scheduler gives eager's logits within 1e-5, and the same tokens."""
    runtime = Runtime.create(mixtral, name, Policy(micro_batch_size=3, micro_batches=2))
    try:
        ours = generate(mixtral, runtime, prefill_chunk=5)
    finally:
        runtime.close()
    assert len(ours[1]) == 5 + 5  # the prefill in 5 calls (22 tokens), 5 decode steps
    assert_as_eager(ours, eager_chunks)


def test_only_a_run_on_the_cpu_alone_is_chunked_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU run keeps its prefill in one call even where its cache is on the host (cgopipe's CPU
    attention): an offloading scheduler would copy each expert in once per chunk; so does a CPU whose
    torch multiplies bf16 natively (nothing widened)."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(prefill_chunks, "emulated", lambda dtype: False)
    assert default_chunk("cpu") is None  # AVX512-BF16 / AMX: oneDNN reads the bf16 weights
    monkeypatch.setattr(prefill_chunks, "emulated", lambda dtype: True)
    assert default_chunk("cpu") == default_chunk([cpu, cpu]) == CPU_PREFILL_CHUNK
    assert default_chunk("cpu", gpu=True) is None
    assert default_chunk("cpu", dtype=torch.float32) is None  # widens no weight: one call
    for homes in (gpu, [cpu, gpu], SlotSplit(gpu, lambda slots: slots)):
        assert default_chunk(homes) is None


def test_a_runtime_with_gpu_copies_runs_its_prefill_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's default asks the runner whether its GPU holds copies (a CUDA runtime), and a later
    chunk of a prompt is a prefill step to the schedulers."""
    monkeypatch.setattr(prefill_chunks, "emulated", lambda dtype: True)  # where bf16 is chunked

    class Runner:
        def __init__(self, copies: bool) -> None:
            self.devices = type("Devices", (), {"copies": copies})()

    model = type("Model", (), {"dtype": torch.bfloat16})()
    assert Engine(model, Runner(copies=True)).prefill_chunk is None  # type: ignore[arg-type]
    assert Engine(model, Runner(copies=False)).prefill_chunk == CPU_PREFILL_CHUNK  # type: ignore[arg-type]
    later = TokenLayout(slots=(0, 1), counts=(128, 1), past=(128, 7))
    decode = TokenLayout(slots=(0, 1), counts=(1, 1), past=(128, 7))
    assert step_shape(1, [StepInput(0, torch.zeros(129), later, None)]).prefill  # type: ignore[arg-type]
    assert not step_shape(2, [StepInput(0, torch.zeros(2), decode, None)]).prefill  # type: ignore[arg-type]


def test_the_cli_runs_a_prefill_in_chunks(tmp_path) -> None:
    """`flowmoe run --prefill-chunk 2`: the built-in model's fp32 tokens are the default run's."""
    from flowmoe.cli import main

    prompts = Path(__file__).parent.parent / "examples" / "prompts.jsonl"
    outputs = []
    for name, extra in (("whole", []), ("chunked", ["--prefill-chunk", "2"])):
        out = tmp_path / f"{name}.jsonl"
        assert main(["run", "--prompts", str(prompts), "--output", str(out), "-n", "5", *extra]) == 0
        outputs.append({r["id"]: r["output_ids"] for r in map(json.loads, out.read_text().splitlines())})
    assert outputs[0] == outputs[1]
