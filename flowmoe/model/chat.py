"""Chat templates: a checkpoint's jinja `chat_template`, rendered in a sandbox as transformers does.

The template comes from `chat_template.jinja` beside the model, or from the
`chat_template` field of tokenizer_config.json (a string, or a list of named
templates of which "default" is used). Templates are untrusted code from a
model's author, so they run in jinja2's immutable sandbox, under a deadline and a
size budget (template_sandbox.py); whatever a template raises fails its prompt line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from attrs import frozen

from flowmoe.core.bounded_read import TEMPLATE, read_bounded
from flowmoe.core.errors import ConfigError, PromptFileError
from flowmoe.core.jsonfile import read_json_object
from flowmoe.model.template_sandbox import BoundedSandbox, render_bounded

Message = dict[str, str]  # {"role": ..., "content": ...}
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


@frozen
class ChatTemplate:
    template: jinja2.Template
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as the template sees them
    source: Path

    @classmethod
    def from_folder(cls, folder: str | Path) -> ChatTemplate | None:
        """The folder's chat template, or None when it has none."""
        folder = Path(folder)
        config = _read_config(folder / "tokenizer_config.json")
        jinja_file = folder / "chat_template.jinja"
        text: str | None
        if _present(jinja_file):
            source, text = jinja_file, _read_text(jinja_file)
        else:
            source, text = folder / "tokenizer_config.json", _config_template(config, folder)
        if text is None:
            return None
        try:
            template = _environment().compile_bounded(text)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"{source}: chat template line {exc.lineno}: {exc.message}") from exc
        return cls(template, _special_tokens(config), source)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The conversation as the model was trained to see it, ending where its reply begins."""
        try:
            text = render_bounded(
                self.template,
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise PromptFileError(f"chat template ({self.source.name}): {exc}") from exc
        except RecursionError as exc:
            raise PromptFileError(f"chat template ({self.source.name}): recursion too deep") from exc
        except Exception as exc:  # the template is untrusted code: what it raises fails its line only
            raise PromptFileError(f"chat template ({self.source.name}): {type(exc).__name__}: {exc}") from exc
        if not text:
            raise PromptFileError(f"chat template ({self.source.name}): rendered an empty prompt")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate, which no tokenizer takes
            bad = text[exc.start : exc.end].encode("unicode_escape").decode()
            raise PromptFileError(
                f"chat template ({self.source.name}): rendered a lone surrogate ({bad}), not Unicode text"
            ) from exc
        return text


def _present(path: Path) -> bool:
    """There is something at `path` to read (or to name in an error: a directory, a broken link)."""
    return path.exists() or path.is_symlink()


def _read_config(path: Path) -> dict[str, Any]:
    return read_json_object(path) if _present(path) else {}


def _read_text(path: Path) -> str:
    try:
        return read_bounded(path, TEMPLATE).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from exc


def _config_template(config: dict[str, Any], folder: Path) -> str | None:
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ConfigError(
        f'{folder / "tokenizer_config.json"}: "chat_template" must be a string or a list holding '
        'a {"name": "default", "template": ...} entry'
    )


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    tokens = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):  # an AddedToken written out: {"content": "<s>", ...}
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _environment() -> BoundedSandbox:
    """The environment transformers renders chat templates in (trimmed blocks, loop controls,
    a tojson that keeps non-ASCII text, raise_exception and strftime_now), bounded."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)
