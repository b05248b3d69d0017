"""The built-in default model: a small Mixtral-shaped checkpoint with a byte-level tokenizer.

It is written once (random weights from a fixed seed, Mixtral's original
per-expert layout) into the user's cache folder and then loaded through the
ordinary checkpoint loader, so `flowmoe run` works with no download.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from flowmoe.core.errors import ConfigError
from flowmoe.core.os_errors import os_reason
from flowmoe.core.spec import ModelSpec
from flowmoe.model.random_weights import RandomSource
from flowmoe.model.tensor_map import TensorMap

NAME = "flowmoe-tiny-mixtral"
SPECIALS = ("<pad>", "<s>", "</s>")
CONFIG: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 256 + len(SPECIALS),
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
    "dtype": "float32",
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def default_home() -> Path:
    return Path(os.environ.get("FLOWMOE_HOME") or Path.home() / ".cache" / "flowmoe")  # "" is unset


def ensure_builtin(home: Path | None = None) -> Path:
    """The folder of the built-in checkpoint, written atomically on first use (ConfigError naming
    the folder when it cannot be: a file in the way, no permission, a full disk)."""
    home = home or default_home()
    folder = home / NAME
    try:
        if (folder / "config.json").is_file():
            return folder
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=folder.parent))
    except OSError as exc:
        raise _unusable(home, exc) from exc
    try:
        write_checkpoint(staging)
        staging.rename(folder)
    except (OSError, SafetensorError) as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "config.json").is_file():  # else another process wrote it first
            raise _unusable(home, exc) from exc
    return folder


def _unusable(home: Path, exc: Exception) -> ConfigError:
    reason = os_reason(exc) if isinstance(exc, OSError) else str(exc)
    return ConfigError(
        f"{home}: cannot write the built-in model there ({reason}); set FLOWMOE_HOME to a writable folder"
    )


def write_checkpoint(folder: Path) -> None:
    spec = ModelSpec.from_hf(CONFIG)
    source, tensor_map = RandomSource(spec, seed=1234, std=0.05), TensorMap.for_spec(spec)
    shapes = {**tensor_map.top_level()}
    for layer in range(spec.layers):
        shapes |= tensor_map.layer_tensors(layer, source.has)
    tensors = {name: source.get(name, shape) for name, shape in shapes.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=2))
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))


def byte_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: ids 0-2 are <pad> <s> </s>, then one id per byte."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab |= {char: len(SPECIALS) + byte for byte, char in _byte_chars().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIALS))
    return tokenizer


def _byte_chars() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what ByteLevel pre-tokenizes to)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {b: chr(b) for b in printable}, 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars
