"""Errors that reach the user as one line naming what is wrong."""


class FlowmoeError(Exception):
    """Base of every error flowmoe reports to the user as a single line."""


class ConfigError(FlowmoeError):
    """A config.json, preset or flag that flowmoe cannot use."""


class CheckpointError(FlowmoeError):
    """A checkpoint folder that is incomplete or inconsistent with its config."""


class PromptFileError(FlowmoeError):
    """A prompt file line that cannot be read as a request."""


class PlanError(FlowmoeError):
    """A task graph that cannot run: a cycle, an unknown dependency, a deadlock."""


class NodeFailed(FlowmoeError):
    """A task node raised while running; the message names the node and its cause."""


class MemoryBudgetError(FlowmoeError):
    """A policy whose resident state does not fit the memory budget."""
