"""Bad checkpoints, configs, tokenizer files, chat templates, routing traces and cache folders,
through the command line: exit 2 and one `flowmoe: error:` line naming the file and field, or a
skipped prompt line with one message; never a traceback, never a file read from outside the
checkpoint folder, never a silently wrong model."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flowmoe.cli import main
from flowmoe.core.errors import ConfigError, FlowmoeError
from flowmoe.core.routing_trace import RoutingTrace
from flowmoe.core.spec import ModelSpec
from flowmoe.model import template_sandbox
from flowmoe.model.builtin import CONFIG as BUILTIN_CONFIG
from flowmoe.model.builtin import default_home, ensure_builtin
from flowmoe.model.chat import ChatTemplate
from flowmoe.model.checkpoint import INDEX, Checkpoint
from tests.hf_models import hf_model, save_hf

ROOT = os.geteuid() == 0  # root reads a mode-000 file and writes a read-only folder


def _run(model: Path | str, tmp_path: Path, prompts: Path | None = None, *extra: str) -> int:
    if prompts is None:
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text('{"id": "a", "input_ids": [5, 6, 7]}\n')
    args = [
        "run",
        "--prompts",
        str(prompts),
        "--output",
        str(tmp_path / "out.jsonl"),
        "--max-new-tokens",
        "2",
    ]
    return main([*args, *(["--model", str(model)] if model else []), *extra])


def _error(capsys: pytest.CaptureFixture) -> str:
    """The failed run's stderr: exactly one line, the error (no traceback, no second line)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("flowmoe: error: "), err
    return lines[0].removeprefix("flowmoe: error: ")


def _fails(model: Path | str, tmp_path: Path, capsys: pytest.CaptureFixture) -> str:
    assert _run(model, tmp_path) == 2
    return _error(capsys)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mixtral checkpoint in three shards with an index (written by transformers)."""
    return save_hf(hf_model("mixtral"), tmp_path_factory.mktemp("sharded") / "ckpt", shard_size="40KB")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _index(folder: Path) -> dict:
    return json.loads((folder / INDEX).read_text())


def _write_index(folder: Path, index: dict) -> None:
    (folder / INDEX).write_text(json.dumps(index))


# ---- config.json: every field's type and range, from one table


def _config_dir(tmp_path: Path, **changes: object) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    config = {**BUILTIN_CONFIG, **changes}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


BAD_FIELDS = [
    ("num_hidden_layers", 0, "an integer from 1 to 4096, got 0"),
    ("num_hidden_layers", -2, "an integer from 1 to 4096, got -2"),
    ("num_hidden_layers", 2.7, "an integer from 1 to 4096, got 2.7"),
    ("num_hidden_layers", True, "an integer from 1 to 4096, got true"),
    ("num_experts_per_tok", 0, "an integer from 1 to 65536, got 0"),
    ("num_experts_per_tok", 9, "an integer from 1 to the 8 experts, got 9"),
    ("num_local_experts", 0, "an integer from 1 to 65536, got 0"),
    ("num_local_experts", 10**9, "an integer from 1 to 65536, got 1000000000"),  # hung listing its tensors
    ("max_position_embeddings", 1e15, "an integer from 1 to 4294967296, got 1000000000000000.0"),
    ("max_position_embeddings", 10**15, "an integer from 1 to 4294967296, got 1000000000000000"),
    ("rms_norm_eps", 10**400, "a number > 0 and ≤ 1, got 1000"),  # past float's range: OverflowError
    ("rms_norm_eps", 2, "a number > 0 and ≤ 1, got 2"),
    ("hidden_size", 2**40, "an integer from 1 to 1048576, got 1099511627776"),
    ("vocab_size", 2**30, "an integer from 1 to 16777216, got 1073741824"),
    (
        "rope_scaling",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0},
        '"rope_scaling.original_max_position_embeddings" must be an integer from 1 to 4294967296, got 0',
    ),
    ("architectures", 5, '"architectures" must be a list of strings, got 5'),
    ("architectures", ["Qwen2MoeForCausalLM"], "name different model families (qwen2_moe, mixtral)"),
    ("model_type", "qwen3_moe", "name different model families (mixtral, qwen3_moe)"),
    ("model_type", ["mixtral"], '"model_type" must be a string, got ["mixtral"]'),
    ("rope_theta", -1, "a number > 0, got -1"),
    ("sliding_window", -5, "an integer from 0 to 4294967296, got -5"),
    ("num_attention_heads", 0, "an integer from 1 to 4096, got 0"),
    ("num_attention_heads", 6, '"num_key_value_heads" must divide "num_attention_heads" (6), got 4'),
    ("hidden_size", "abc", 'an integer from 1 to 1048576, got "abc"'),
    ("hidden_size", 250, '"hidden_size" (250) must be a multiple of "num_attention_heads" (8)'),
    ("vocab_size", 0, "an integer from 1 to 16777216, got 0"),
    ("intermediate_size", -1, "an integer from 1 to 1048576, got -1"),
    ("head_dim", 0, "an integer from 1 to 1048576, got 0"),
    ("max_position_embeddings", 0, "an integer from 1 to 4294967296, got 0"),
    ("rms_norm_eps", 0, "a number > 0 and ≤ 1, got 0"),
    ("tie_word_embeddings", "yes", 'true or false, got "yes"'),
    ("eos_token_id", "</s>", 'an integer or a list of integers, got "</s>"'),
    ("eos_token_id", [2, "x"], 'an integer or a list of integers, got [2, "x"]'),
    ("dtype", "int8", 'one of float32, bfloat16, float16, got "int8"'),
    ("rope_scaling", "yarn", 'must be an object or null, got "yarn"'),
    ("rope_scaling", {"rope_type": "yarn", "factor": -2}, '"rope_scaling.factor" must be a number > 0'),
    ("rope_scaling", {"rope_type": "ntk"}, '"rope_scaling.rope_type" must be one of default, linear, yarn'),
    ("layer_types", ["full_attention"], '"layer_types" must name one type per layer (4), got 1'),
    ("layer_types", ["full", "full", "full", "full"], "one of full_attention, sliding_attention"),
]


@pytest.mark.parametrize(("field", "value", "allowed"), BAD_FIELDS)
def test_config_fields_are_checked_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture, field: str, value: object, allowed: str
) -> None:
    folder = _config_dir(tmp_path, **{field: value})
    message = _fails(folder, tmp_path, capsys)
    assert message.startswith(f"{folder / 'config.json'}: ") and allowed in message
    assert f'"{field}' in message or field == "num_attention_heads"


def test_config_non_finite_number(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = _config_dir(tmp_path)
    (folder / "config.json").write_text(json.dumps({**BUILTIN_CONFIG, "rms_norm_eps": float("nan")}))
    assert "NaN" in (folder / "config.json").read_text()
    assert '"rms_norm_eps" must be a number > 0 and ≤ 1, got NaN' in _fails(folder, tmp_path, capsys)


def test_every_family_and_preset_config_passes_the_table() -> None:
    from flowmoe.core.presets import PRESETS, preset
    from tests.hf_models import FAMILY_CONFIGS

    for name in PRESETS:
        assert preset(name).layers > 0
    for family in FAMILY_CONFIGS:
        model = hf_model(family)
        config = {**model.config.to_dict(), "architectures": [type(model).__name__]}
        assert ModelSpec.from_hf(json.loads(json.dumps(config, default=str))).layers == 3


# ---- config.json and tokenizer files that cannot be read at all


def _bad_config(kind: str) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        path = folder / "config.json"
        path.unlink()
        if kind == "utf8":
            path.write_bytes(b'{"model_type": "mixtral\xff"}')
        elif kind == "list":
            path.write_text("[1, 2]")
        elif kind == "directory":
            path.mkdir()
        elif kind == "loop":
            path.symlink_to("config.json")
        elif kind == "deep":
            path.write_text("[" * 100_000 + "]" * 100_000)

    return make


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("utf8", "config.json: not UTF-8 text (byte 23)"),
        ("list", "config.json: expected a JSON object, found a list"),
        ("directory", "config.json: is a directory, not a file"),
        ("loop", "config.json: a symlink loop"),
        ("missing", "config.json: no such file"),
        ("deep", "config.json: JSON nested too deeply"),
    ],
)
def test_unreadable_config(
    sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture, kind: str, message: str
) -> None:
    folder = _copy(sharded, tmp_path / "ckpt")
    _bad_config(kind)(folder)
    found = _fails(folder, tmp_path, capsys)
    assert found == f"{folder}/{message}"  # the path once, not config.json/config.json


@pytest.fixture
def text_model(tmp_path: Path) -> Path:
    """The built-in checkpoint (tokenizer included), copied so its files can be broken."""
    return _copy(ensure_builtin(), tmp_path / "text-model")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("tokenizer_config.json", b"{not json", "tokenizer_config.json: not valid JSON"),
        ("tokenizer_config.json", b'["eos"]', "tokenizer_config.json: expected a JSON object, found a list"),
        ("tokenizer_config.json", b'{"eos_token": "\xff"}', "tokenizer_config.json: not UTF-8 text"),
        ("tokenizer_config.json", None, "tokenizer_config.json: is a directory"),
        ("chat_template.jinja", b"{{ bos_token \xff }}", "chat_template.jinja: not UTF-8 text"),
        ("chat_template.jinja", b"{% for m in messages %}", "chat_template.jinja: chat template line 1"),
        ("tokenizer.json", b"{}", "tokenizer.json: cannot read tokenizer"),
    ],
)
def test_bad_tokenizer_files(
    text_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    name: str,
    content: bytes | None,
    message: str,
) -> None:
    path = text_model / name
    path.unlink(missing_ok=True)
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    assert _fails(text_model, tmp_path, capsys).startswith(f"{text_model}/{message}")


def test_model_folder_is_a_symlink_loop(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert _fails(loop, tmp_path, capsys) == f"{loop}: checkpoint folder: a symlink loop"


# ---- the index names files inside the folder; a Hugging Face cache snapshot still loads


@pytest.mark.parametrize(
    "entry",
    [
        "../outside/secret.safetensors",
        "/etc/passwd",
        "sub/../../outside/secret.safetensors",
        "..",
        "",
    ],
)
def test_index_entries_outside_the_folder_are_refused(
    sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture, entry: str
) -> None:
    folder = _copy(sharded, tmp_path / "ckpt")
    index = _index(folder)
    name = next(iter(index["weight_map"]))
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(folder / index["weight_map"][name], outside / "secret.safetensors")  # loads, unchecked
    index["weight_map"][name] = entry
    _write_index(folder, index)
    assert _fails(folder, tmp_path, capsys) == (
        f"{folder / INDEX}: shard {entry!r} is not a file inside the checkpoint folder"
    )


def test_hugging_face_cache_snapshot_with_linked_blobs(sharded: Path, tmp_path: Path) -> None:
    """snapshots/<rev>/<file> -> ../../blobs/<sha>: links out of the folder, named inside it."""
    repo = tmp_path / "models--tiny--mixtral"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, file in enumerate(sorted(sharded.iterdir())):
        shutil.copy(file, blobs / f"{number:040x}")
        (snapshot / file.name).symlink_to(Path("../../blobs") / f"{number:040x}")
    out = {}
    for name, folder in (("plain", sharded), ("snapshot", snapshot)):
        (tmp_path / name).mkdir()
        assert _run(folder, tmp_path / name) == 0
        out[name] = (tmp_path / name / "out.jsonl").read_text()
    assert out["snapshot"] == out["plain"] and '"output_ids"' in out["plain"]


# ---- the same tensor in two shards: the index decides, or it is an error


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _add_tensor(shard: Path, name: str, value: torch.Tensor) -> None:
    tensors = load_file(str(shard))
    tensors[name] = value
    save_file(tensors, str(shard), metadata={"format": "pt"})


NORM = "model.norm.weight"


def _with_duplicate_norm(sharded: Path, tmp_path: Path) -> tuple[Path, Path, Path, torch.Tensor]:
    """A copy whose final norm is also, with other values, in a second shard."""
    folder = _copy(sharded, tmp_path / "ckpt")
    listed = folder / _index(folder)["weight_map"][NORM]
    other = next(s for s in _shards(folder) if s != listed)
    original = load_file(str(listed))[NORM]
    _add_tensor(other, NORM, original + 100.0)
    return folder, listed, other, original


def test_duplicate_tensor_follows_the_index(sharded: Path, tmp_path: Path) -> None:
    folder, listed, other, original = _with_duplicate_norm(sharded, tmp_path)
    for shard, expected in ((listed, original), (other, original + 100.0)):
        index = _index(folder)
        index["weight_map"][NORM] = shard.name
        _write_index(folder, index)
        ckpt = Checkpoint.open(folder)
        try:
            assert torch.equal(ckpt.get(NORM, tuple(original.shape)), expected)
        finally:
            ckpt.close()


def _drop_from_index(folder: Path) -> None:
    index = _index(folder)
    del index["weight_map"][NORM]
    _write_index(folder, index)


@pytest.mark.parametrize(
    ("unsettle", "why"),
    [
        (_drop_from_index, f"{INDEX} does not place it"),
        (lambda f: (f / INDEX).unlink(), f"there is no {INDEX}"),
    ],
    ids=["not in the index", "no index"],
)
def test_duplicate_tensor_nothing_settles(
    sharded: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    unsettle: Callable[[Path], None],
    why: str,
) -> None:
    folder, listed, other, _ = _with_duplicate_norm(sharded, tmp_path)
    unsettle(folder)
    first, second = sorted([listed, other])
    assert _fails(folder, tmp_path, capsys) == f"tensor {NORM} is in both {first} and {second}, and {why}"


def test_index_places_a_tensor_in_a_shard_that_lacks_it(
    sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    folder = _copy(sharded, tmp_path / "ckpt")
    index = _index(folder)
    listed = index["weight_map"][NORM]
    index["weight_map"][NORM] = next(s.name for s in _shards(folder) if s.name != listed)
    _write_index(folder, index)
    message = _fails(folder, tmp_path, capsys)
    assert (
        message
        == f"{folder / index['weight_map'][NORM]}: tensor {NORM} listed in {INDEX} is not in the shard"
    )


# ---- shards that are not whole safetensors files


def _header(shard: Path) -> tuple[dict, bytes]:
    raw = shard.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _rewrite_header(shard: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _offset_past_end(shard: Path) -> None:
    header, data = _header(shard)
    name = max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + 64, end + 64]
    _rewrite_header(shard, header, data)


def _wrong_size(shard: Path) -> None:
    header, data = _header(shard)
    name = next(n for n in header if n != "__metadata__")
    header[name]["shape"] = [*header[name]["shape"], 2]
    _rewrite_header(shard, header, data)


SHARD_FAULTS: list[tuple[str, Callable[[Path], None], str]] = [
    ("truncated", lambda s: s.write_bytes(s.read_bytes()[:-100]), "past the end of the file"),
    ("truncated header", lambda s: s.write_bytes(s.read_bytes()[:40]), "truncated safetensors file"),
    ("empty", lambda s: s.write_bytes(b""), "not a safetensors file (0 bytes, shorter than its header)"),
    ("a png", lambda s: s.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(200)), "header length"),
    ("garbage", lambda s: s.write_bytes(struct.pack("<Q", 50) + bytes(range(200))), "header is not JSON"),
    ("oversized header", lambda s: s.write_bytes(struct.pack("<Q", 2**40) + b"{}"), "over the 100 MB limit"),
    ("header not json", lambda s: s.write_bytes(struct.pack("<Q", 4) + b"\xff{}x"), "header is not JSON"),
    ("header a list", lambda s: s.write_bytes(struct.pack("<Q", 2) + b"[]"), "header is not a JSON object"),
    ("offsets past the end", _offset_past_end, "past the end of the file"),
    ("size mismatch", _wrong_size, "bytes, but F32"),
    ("directory", lambda s: (s.unlink(), s.mkdir()), "is a directory, not a file"),
    ("symlink loop", lambda s: (s.unlink(), s.symlink_to(s.name)), "a symlink loop"),
    ("missing", lambda s: s.unlink(), "shard listed in model.safetensors.index.json is missing"),
]


@pytest.mark.parametrize(
    ("fault", "make"), [(f, m) for f, m, _ in SHARD_FAULTS], ids=[f for f, *_ in SHARD_FAULTS]
)
def test_bad_shards(
    sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture, fault: str, make: Callable[[Path], None]
) -> None:
    folder = _copy(sharded, tmp_path / "ckpt")
    shard = _shards(folder)[-1]
    make(shard)
    message = _fails(folder, tmp_path, capsys)
    expected = next(text for f, _, text in SHARD_FAULTS if f == fault)
    assert message.startswith(f"{shard}: ") and expected in message, message


@pytest.mark.skipif(ROOT, reason="root reads a mode-000 file")
def test_unreadable_shard(sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = _copy(sharded, tmp_path / "ckpt")
    shard = _shards(folder)[0]
    shard.chmod(0)
    assert _fails(folder, tmp_path, capsys) == f"{shard}: permission denied"


# ---- chat templates: bounded time and size, one file, one message per failed line


LIMITS = "over the limit of 4194304"
TEMPLATES = [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x", "took longer"),
    ("{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% set k = j %}{% endfor %}{% endfor %}",
     "took longer"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}ab{% endfor %}{% endfor %}", "took longer"),
    ("{{ 'x' * 3000000000 }}", "a value of 3000000000 characters or items is " + LIMITS),
    ("{{ ([0] * 3000000000) | length }}", LIMITS),
    ("{% set n = namespace(s='x') %}{% for i in range(64) %}{% set n.s = n.s ~ n.s %}{% endfor %}{{ n.s }}",
     LIMITS),
    ("{% set n = namespace(s='x') %}{% for i in range(64) %}{% set n.s = n.s + n.s %}{% endfor %}{{ n.s }}",
     LIMITS),
    ("{% set n = namespace(l=[], b='x' * 4000000) %}{% for i in range(9999) %}{% set n.l = n.l + [n.b ~ i] %}"
     "{% endfor %}", "built over 268435456 characters or items in all"),
    ("{{ 'x'.center(3000000000) }}", LIMITS),
    ("{{ 'x' | center(3000000000) }}", LIMITS),
    ("{{ messages | tojson(indent=3000000000) }}", LIMITS),
    ("{{ '%3000000000d' % 1 }}", LIMITS),
    ("{{ '{:>3000000000}'.format(1) }}", LIMITS),
    ("{{ 2 ** 100000000 }}", "an exponent of 100000000 is over the limit"),
    ("{% include 'other.jinja' %}", "cannot load 'other.jinja': include, extends and import are not"),
    ("{% extends 'base.jinja' %}", "cannot load 'base.jinja'"),
    ("{% import 'macros.jinja' as m %}{{ m.say() }}", "cannot load 'macros.jinja'"),
    ("{% from 'macros.jinja' import say %}{{ say() }}", "cannot load 'macros.jinja'"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion too deep"),
    ("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
    ("{% if false %}x{% endif %}", "rendered an empty prompt"),
]  # fmt: skip


@pytest.mark.parametrize(("template", "message"), TEMPLATES)
def test_chat_template_limits_fail_the_line(
    text_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    template: str,
    message: str,
) -> None:
    if message == "took longer":  # a short deadline where the clock is what stops it; the size limits
        monkeypatch.setattr(template_sandbox, "RENDER_SECONDS", 0.2)  # must act first under any load
    (text_model / "chat_template.jinja").write_text(template)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"id": "chat", "messages": [{"role": "user", "content": "hi"}]}\n'
        '{"id": "ids", "input_ids": [5, 6]}\n'
    )
    assert _run(text_model, tmp_path, prompts, "--chat") == 0
    err = capsys.readouterr().err.replace("\n", "")
    assert "Traceback" not in err
    assert f"{prompts}:1: chat template (chat_template.jinja): " in err and message in err
    assert [json.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()] == ["ids"]


def test_big_multiplication_is_refused_before_it_allocates(tmp_path: Path) -> None:
    """At the real deadline: refused by size at once (no 3 GB string), not by the clock."""
    (tmp_path / "chat_template.jinja").write_text("{{ 'x' * 3000000000 }}{% for i in range(9) %}{% endfor %}")
    template = ChatTemplate.from_folder(tmp_path)
    assert template is not None
    with pytest.raises(Exception, match=LIMITS):
        template.render([{"role": "user", "content": "hi"}])


def test_bounded_template_renders_loops_and_concatenation(tmp_path: Path) -> None:
    text = (
        "{% for m in messages %}{{ loop.index ~ ':' ~ m['content'] | upper }}"
        "{% if not loop.last %}, {% endif %}"
        "{% endfor %}{{ ' #' * 2 }}{{ '%03d' % messages | length }}{{ '{:>4}'.format('x') }}"
    )
    (tmp_path / "chat_template.jinja").write_text(text)
    template = ChatTemplate.from_folder(tmp_path)
    assert template is not None
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert template.render(messages) == "1:A, 2:B # #002   x"


# ---- routing traces know the model they were recorded on


def test_routing_trace_is_refused_for_another_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "input_ids": [5, 6, 7]}\n')
    trace_path = tmp_path / "routing.jsonl"
    assert _run("", tmp_path, prompts, "--record-routing", str(trace_path)) == 0
    builtin = ModelSpec.from_hf(BUILTIN_CONFIG)
    assert RoutingTrace.load(trace_path, builtin).shape is not None
    for changes, shape in (
        ({"num_local_experts": 64}, "4 layers, 64 experts, top-2"),
        ({"num_hidden_layers": 2}, "2 layers, 8 experts, top-2"),
        ({"num_experts_per_tok": 4}, "4 layers, 8 experts, top-4"),
    ):
        other = ModelSpec.from_hf({**BUILTIN_CONFIG, **changes})
        with pytest.raises(ConfigError) as info:
            RoutingTrace.load(trace_path, other)
        assert str(info.value) == (
            f"{trace_path}: routing trace recorded on a model with 4 layers, 8 experts, top-2; "
            f"this model has {shape}"
        )
    capsys.readouterr()
    code = main(["simulate", "--model", "olmoe-1b-7b", "--routing", str(trace_path), "--scheduler", "eager"])
    assert code == 2
    assert (
        "routing trace recorded on a model with 4 layers, 8 experts, top-2; this model has 16 layers, "
        in (_error(capsys))
    )


def test_routing_trace_without_a_shape_is_checked_by_its_entries(tmp_path: Path) -> None:
    path = tmp_path / "old.jsonl"
    path.write_text('{"step": 0, "layer": 0, "mb": 0, "counts": [[12, 3]]}\n')
    spec = ModelSpec.from_hf(BUILTIN_CONFIG)
    with pytest.raises(
        ConfigError, match="routing trace names expert 12; this model has 4 layers, 8 experts"
    ):
        RoutingTrace.load(path, spec)
    assert (
        RoutingTrace.load(path, ModelSpec.from_hf({**BUILTIN_CONFIG, "num_local_experts": 16})).shape is None
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "routing.jsonl: is a directory, not a file"),
        (
            b'{"step": 0, "layer": 0, "mb": 0, "counts": [[1, 2]]}\n\xff\n',
            "routing.jsonl: not UTF-8 text (byte 53)",
        ),
        (b'{"step": 0, "layer": 0}\n', "routing.jsonl:1: not a routing trace line ('mb')"),
        (b'{"model": {"layers": 4}}\n', "routing.jsonl:1: not a routing trace line ('experts')"),
        (b"[" * 100_000 + b"\n", "routing.jsonl:1: not a routing trace line (maximum recursion depth"),
    ],
)
def test_unreadable_routing_trace(tmp_path: Path, content: bytes | None, message: str) -> None:
    path = tmp_path / "routing.jsonl"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        RoutingTrace.load(path)
    assert str(info.value).startswith(f"{tmp_path}/{message}")


def test_routing_trace_write_failure_is_one_line(tmp_path: Path) -> None:
    trace = RoutingTrace.for_model(ModelSpec.from_hf(BUILTIN_CONFIG))
    with pytest.raises(FlowmoeError, match=f"^{tmp_path}: is a directory, not a file; flowmoe writes only"):
        trace.save(tmp_path)


# ---- FLOWMOE_HOME that cannot hold the built-in model


@pytest.mark.parametrize("kind", ["file", "under a file", "read-only"])
def test_unusable_flowmoe_home(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    if kind == "read-only" and ROOT:
        pytest.skip("root writes a read-only folder")
    home = tmp_path / "home"
    if kind == "file":
        home.write_text("not a folder")
    elif kind == "under a file":
        (tmp_path / "file").write_text("x")
        home = tmp_path / "file" / "home"
    else:
        home.mkdir(mode=0o555)
    monkeypatch.setenv("FLOWMOE_HOME", str(home))
    message = _fails("", tmp_path, capsys)
    assert message.startswith(f"{home}: cannot write the built-in model there (")
    assert message.endswith("); set FLOWMOE_HOME to a writable folder")


def test_empty_flowmoe_home_means_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOWMOE_HOME", "")
    assert default_home() == Path.home() / ".cache" / "flowmoe"  # not "" (the working directory)
