"""The formats of `flowmoe run`'s prompt file and output: flowmoe's own (jobs/prompts.py) and the
OpenAI batch format (jobs/openai_batch.py), told apart by the prompt file's first line. Torch-free:
the command line picks the format, and checks the output holds it, before it loads a model."""

from __future__ import annotations

from pathlib import Path

from flowmoe.core.errors import PromptFileError
from flowmoe.jobs.joblog import LINE_BOUND, RESULTS, LogLayout
from flowmoe.jobs.prompts import json_lines

NATIVE, OPENAI = "flowmoe", "openai"
OPENAI_LAYOUT = LogLayout(
    "flowmoe OpenAI batch output",
    {"id": (str,), "custom_id": (str,), "response": (dict, type(None)), "error": (dict, type(None))},
    "custom_id",
)


def layout(format_name: str) -> LogLayout:
    """What each line of an output of this format holds."""
    return OPENAI_LAYOUT if format_name == OPENAI else RESULTS


def detect(path: Path) -> str:
    """OPENAI when the first line that is not blank is a JSON object with a "custom_id" and no "id"
    (a native line's key), else NATIVE (a file whose first line cannot be read so is left to the
    native reader, which reports it)."""
    try:
        with json_lines(path, LINE_BOUND) as lines:
            for _number, line in lines:
                value = line()
                batch = isinstance(value, dict) and "custom_id" in value and "id" not in value
                return OPENAI if batch else NATIVE
    except PromptFileError:
        return NATIVE
    return NATIVE
