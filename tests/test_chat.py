"""Chat templates render (and tokenize) as transformers' apply_chat_template does, in a sandbox."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flowmoe.cli import main
from flowmoe.core.errors import ConfigError, PromptFileError
from flowmoe.jobs.prompts import read_prompts
from flowmoe.model.builtin import byte_tokenizer, ensure_builtin
from flowmoe.model.chat import ChatTemplate
from flowmoe.model.tokenizer import TextCodec

# Mistral-style: a system prompt folded into the first user turn, alternation enforced, tojson used
TEMPLATE = """{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] + '\\n\\n' %}
    {% set messages = messages[1:] %}
{% else %}
    {% set system = '' %}
{% endif %}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{- '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}
    {% else %}
        {{- ' ' + message['content'] + eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}{{- ' ' + {'turns': messages | length, 'note': 'ünï'} | tojson }}{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why MoE?"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
]


def _hf_tokenizer(template: str):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=byte_tokenizer(), bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture
def chat_model(tmp_path: Path) -> Path:
    """The built-in checkpoint with a chat template, saved by transformers beside it."""
    folder = tmp_path / "chat-model"
    shutil.copytree(ensure_builtin(), folder)
    _hf_tokenizer(TEMPLATE).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_renders_and_tokenizes_as_transformers(chat_model: Path, messages: list[dict[str, str]]) -> None:
    hf = _hf_tokenizer(TEMPLATE)
    codec = TextCodec.from_folder(chat_model)
    assert codec is not None and codec.chat is not None
    assert codec.chat.source.name == "chat_template.jinja"
    text = codec.chat.render(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<s>") and "[INST] " in text and text.endswith('"note": "ünï"}')
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert codec.encode_chat(messages) == expected


def test_template_from_tokenizer_config(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<s>"}, "chat_template": TEMPLATE})
    )
    template = ChatTemplate.from_folder(tmp_path)
    assert template is not None and template.source.name == "tokenizer_config.json"
    assert template.render(CONVERSATIONS[0], add_generation_prompt=False) == "<s>\n[INST] Hello! [/INST]\n"
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ bos_token }}hi"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "chat_template": named}))
    assert ChatTemplate.from_folder(tmp_path).render([]) == "<s>hi"  # type: ignore[union-attr]


def test_no_template(tmp_path: Path) -> None:
    assert ChatTemplate.from_folder(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert ChatTemplate.from_folder(tmp_path) is None


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"chat_template": [{"name": "tools", "template": "x"}]},
            '"chat_template" must be a string or a list',
        ),
        ({"chat_template": "{% for m in messages %}"}, "chat template line 1: Unexpected end of template"),
        ("not json", "tokenizer_config.json: not valid JSON"),
    ],
)
def test_bad_templates_name_the_file(tmp_path: Path, config: object, message: str) -> None:
    text = config if isinstance(config, str) else json.dumps(config)
    (tmp_path / "tokenizer_config.json").write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        ChatTemplate.from_folder(tmp_path)
    assert str(info.value).startswith(str(tmp_path / "tokenizer_config.json"))


def test_template_errors_and_sandbox(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    template = ChatTemplate.from_folder(tmp_path)
    assert template is not None
    with pytest.raises(PromptFileError, match="Conversation roles must alternate"):
        template.render([{"role": "assistant", "content": "first?"}])
    (tmp_path / "chat_template.jinja").write_text("{{ messages.append({'role': 'x'}) }}")
    with pytest.raises(PromptFileError, match="unsafe"):
        ChatTemplate.from_folder(tmp_path).render(CONVERSATIONS[0])  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"id": "m", "messages": []}', '"messages" must be a non-empty list'),
        (
            '{"id": "m", "messages": [{"role": "user"}]}',
            '"messages"[0] must be {"role": "...", "content": "..."}',
        ),
        ('{"id": "m", "messages": [{"role": "user", "content": 3}]}', '"messages"[0] must be'),
        ('{"id": "m", "messages": [{"role": "user", "content": "x"}], "prompt": "y"}', "give exactly one of"),
    ],
)
def test_bad_messages_lines(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "ok", "prompt": "fine"}\n' + line + "\n")
    result = read_prompts(path, vocab=300, can_tokenize=True, can_chat=True)
    assert [p.id for p in result.prompts] == ["ok"]
    assert (
        len(result.errors) == 1 and result.errors[0].startswith(f"{path}:2: ") and message in result.errors[0]
    )


def test_messages_need_a_template(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"id": "m", "messages": [{"role": "user", "content": "x"}]}\n{"id": "ok", "prompt": "y"}\n'
    )
    result = read_prompts(path, vocab=300, can_tokenize=True, can_chat=False)
    assert "needs a chat template" in result.errors[0] and [p.id for p in result.prompts] == ["ok"]


def _rows(path: Path) -> dict[str, dict]:
    return {row["id"]: row for row in map(json.loads, path.read_text().splitlines())}


def test_chat_job_end_to_end(chat_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    hf = _hf_tokenizer(TEMPLATE)
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"id": "plain", "prompt": "Hello!"},
        {"id": "conv", "messages": CONVERSATIONS[2]},
        {"id": "bad turn", "messages": [{"role": "assistant", "content": "me first"}]},
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    args = ["run", "--model", str(chat_model), "--prompts", str(prompts), "--output", str(out)]
    assert main([*args, "--max-new-tokens", "3", "--chat"]) == 0
    rows = _rows(out)
    assert set(rows) == {"plain", "conv"}
    chat_ids = hf.apply_chat_template(CONVERSATIONS[0], tokenize=True, add_generation_prompt=True)[
        "input_ids"
    ]
    assert rows["plain"]["prompt_tokens"] == len(chat_ids)
    conv = hf.apply_chat_template(CONVERSATIONS[2], tokenize=True, add_generation_prompt=True)["input_ids"]
    assert rows["conv"]["prompt_tokens"] == len(conv)
    assert f"{prompts}:3: chat template (chat_template.jinja): Conversation roles must alternate" in (
        capsys.readouterr().err.replace("\n", "")
    )
    plain = tmp_path / "plain.jsonl"
    assert main([*args[:-1], str(plain), "--max-new-tokens", "3"]) == 0
    assert _rows(plain)["plain"]["prompt_tokens"] == len(
        hf("Hello!")["input_ids"]
    )  # no template without --chat


def test_chat_flag_needs_a_template(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 1, "prompt": "hi"}\n')
    code = main(["run", "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl"), "--chat"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "flowmoe: error: --chat needs a chat template beside the model (tokenizer_config.json)"
    )
