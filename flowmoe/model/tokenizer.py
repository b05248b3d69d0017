"""The checkpoint's own tokenizer, read from tokenizer.json with the `tokenizers` library,
and its chat template when it has one."""

from __future__ import annotations

from pathlib import Path

from attrs import frozen
from tokenizers import Tokenizer

from flowmoe.core.bounded_read import TOKENIZER, read_bounded
from flowmoe.core.errors import ConfigError, FlowmoeError
from flowmoe.core.jsonfile import read_json_object
from flowmoe.model.chat import ChatTemplate, Message


@frozen
class TextCodec:
    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    chat: ChatTemplate | None = None

    @classmethod
    def from_folder(cls, folder: str | Path) -> TextCodec | None:
        """None when the folder has no tokenizer.json (prompts must then give input_ids)."""
        path = Path(folder) / "tokenizer.json"
        if not path.exists() and not path.is_symlink():
            return None
        try:
            tokenizer = Tokenizer.from_str(read_bounded(path, TOKENIZER).decode("utf-8"))
        except FlowmoeError:
            raise
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise ConfigError(f"{path}: cannot read tokenizer ({exc})") from exc
        eos = frozenset(_config_eos(Path(folder), tokenizer))
        return cls(tokenizer, eos, ChatTemplate.from_folder(folder))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids; a rendered chat template carries its own special tokens (add none)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, messages: list[Message] | tuple[Message, ...]) -> list[int]:
        """A conversation through the chat template, then the tokenizer (PromptFileError if the
        template rejects it)."""
        assert self.chat is not None, "the model has no chat template"
        return self.encode(self.chat.render(messages), add_special_tokens=False)

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


@frozen
class StopStrings:
    """`--stop` strings, looked for in the decoded text of an output as it grows."""

    codec: TextCodec
    strings: tuple[str, ...]

    def cut(self, ids: list[int] | tuple[int, ...]) -> str | None:
        """The output's text cut before the earliest stop string in it, or None when there is none."""
        text = self.codec.decode(ids)
        found = [i for i in (text.find(s) for s in self.strings) if i >= 0]
        return text[: min(found)] if found else None


def _config_eos(folder: Path, tokenizer: Tokenizer) -> set[int]:
    """eos ids named by tokenizer_config.json (as a token string), if any."""
    path = folder / "tokenizer_config.json"
    if not path.exists() and not path.is_symlink():
        return set()
    eos = read_json_object(path).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    token_id = tokenizer.token_to_id(eos) if isinstance(eos, str) else None
    return {token_id} if token_id is not None else set()
