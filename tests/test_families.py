"""Every supported family matches transformers' own forward and greedy generate."""

from __future__ import annotations

import pytest
import torch

from flowmoe.kernels.layout import TokenLayout
from flowmoe.model.loading import load_model
from tests.helpers import rel_err
from tests.hf_models import FAMILY_CONFIGS, hf_model, save_fused, save_hf

PROMPT_LEN, NEW_TOKENS, BATCH = 9, 16, 2


def _reference(model, prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (greedy tokens [B, NEW], logits of every position of prompt + generated [B, L, V])."""
    with torch.no_grad():
        model.generation_config.eos_token_id = None  # run all NEW_TOKENS steps, EOS included
        generated = model.generate(
            prompts,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            attention_mask=torch.ones_like(prompts),
            pad_token_id=0,
        )
        assert generated.shape[1] == PROMPT_LEN + NEW_TOKENS
        logits = model(generated).logits
    return generated[:, PROMPT_LEN:], logits


def _flowmoe_run(folder, sequence: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """Prefill the prompts, then decode feeding the reference tokens.
    -> (prefill logits [B * P, V], per decode step logits [B, V], greedy tokens of step 0..)"""
    model = load_model(folder)
    cache = model.new_cache(BATCH, PROMPT_LEN + NEW_TOKENS)
    slots = tuple(range(BATCH))
    with torch.inference_mode():
        layout = TokenLayout(slots, (PROMPT_LEN,) * BATCH, (0,) * BATCH)
        prefill = model.forward(sequence[:, :PROMPT_LEN].reshape(-1), cache, layout, all_rows=True)
        steps = []
        for step in range(NEW_TOKENS - 1):
            pos = PROMPT_LEN + step
            layout = TokenLayout(slots, (1,) * BATCH, (pos,) * BATCH)
            steps.append(model.forward(sequence[:, pos], cache, layout))
    return prefill, steps


def _greedy(folder, prompts: torch.Tensor) -> torch.Tensor:
    model = load_model(folder)
    cache = model.new_cache(BATCH, PROMPT_LEN + NEW_TOKENS)
    slots, out = tuple(range(BATCH)), []
    ids, past = prompts.reshape(-1), 0
    counts = (PROMPT_LEN,) * BATCH
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            logits = model.forward(ids, cache, TokenLayout(slots, counts, (past,) * BATCH))
            ids = logits.argmax(-1)
            out.append(ids)
            past += counts[0]
            counts = (1,) * BATCH
    return torch.stack(out, dim=1)


# GPT-OSS checkpoints are always stacked (save_pretrained writes that layout), so it has no fused case;
# nor have Llama 4 (likewise), Phi-3.5-MoE, Granite MoE and ERNIE 4.5 (released only in the layout
# save_pretrained writes, not under transformers 5's in-memory names)
ONE_LAYOUT = {
    "gpt_oss",
    "llama4",
    "llama4_no_qk_norm",
    "phimoe",
    "phimoe_longrope",
    "granitemoe",
    "ernie4_5_moe",
}
CASES = [
    (family, layout)
    for family in sorted(FAMILY_CONFIGS)
    for layout in ("per_expert", "fused", "sharded")
    if not (family in ONE_LAYOUT and layout == "fused")
]


@pytest.mark.parametrize(("family", "layout"), CASES)
def test_matches_transformers(family: str, layout: str, tmp_path) -> None:
    hf = hf_model(family)
    folder = tmp_path / family
    if layout == "fused":
        save_fused(hf, folder)
    else:
        save_hf(hf, folder, shard_size="40KB" if layout == "sharded" else None)
    if layout == "sharded":
        assert (folder / "model.safetensors.index.json").is_file()
    prompts = torch.randint(
        3, hf.config.vocab_size, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(1)
    )
    tokens, ref_logits = _reference(hf, prompts)
    sequence = torch.cat([prompts, tokens], dim=1)

    prefill, steps = _flowmoe_run(folder, sequence)
    assert rel_err(prefill, ref_logits[:, :PROMPT_LEN].reshape(-1, ref_logits.shape[-1])) <= 1e-4
    for step, logits in enumerate(steps):
        assert rel_err(logits, ref_logits[:, PROMPT_LEN + step]) <= 1e-4, f"decode step {step}"
    assert torch.equal(_greedy(folder, prompts), tokens)
