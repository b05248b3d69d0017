"""Scheduler registry: every module of this package that defines a scheduler class (one with a
`name` and a `plan`) is a built-in; other packages add theirs under the `flowmoe.schedulers`
entry-point group."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from functools import cache
from importlib.metadata import entry_points

from flowmoe.core.errors import ConfigError
from flowmoe.core.scheduling import Scheduler, SchedulerContext

ENTRY_POINT_GROUP = "flowmoe.schedulers"
NOT_PLUGINS = {"registry"}


@cache
def builtin() -> dict[str, type[Scheduler]]:
    package = importlib.import_module(__package__)
    found: dict[str, type[Scheduler]] = {}
    for module_info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if module_info.name in NOT_PLUGINS or module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__package__}.{module_info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (
                cls.__module__ == module.__name__
                and isinstance(getattr(cls, "name", None), str)
                and hasattr(cls, "plan")
            ):
                found[cls.name] = cls
    return found


def available() -> dict[str, type[Scheduler]]:
    """Every scheduler by name, built-ins first; a plugin cannot shadow a built-in."""
    found = dict(builtin())
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name not in found:
            found[entry.name] = entry.load()
    return found


def create(name: str, context: SchedulerContext) -> Scheduler:
    schedulers = available()
    if name not in schedulers:
        raise ConfigError(f"unknown scheduler {name!r}; available: {', '.join(schedulers)}")
    return schedulers[name](context)
