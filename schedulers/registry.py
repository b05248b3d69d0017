"""Scheduler registry: every module of this package that defines a scheduler class (one with a
`name` and a `plan`) is a built-in; other packages add theirs under the `flowmoe.schedulers`
entry-point group.

Plugins load lazily: listing names reads only the entry points' metadata, and a
plugin that fails to import (or is not a usable scheduler class) is reported in
`broken()` and fails only the command that chooses it. What a plugin does when
created and what it plans are checked too (`create`, `checked_plan`), so a
faulty plugin ends its run with one line naming it.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Generator
from functools import cache
from importlib.metadata import EntryPoint, entry_points

from flowmoe.core.errors import ConfigError, FlowmoeError, PlanError
from flowmoe.core.options import knobs
from flowmoe.core.plan import ExpertCounts, RoutingRequest, TaskNode
from flowmoe.core.scheduling import (
    PlanStream,
    Residency,
    Scheduler,
    SchedulerContext,
    StepShape,
    WrappedPlan,
)
from flowmoe.core.spec import ModelSpec

ENTRY_POINT_GROUP = "flowmoe.schedulers"
NOT_PLUGINS = {"registry", "layer_nodes"}  # the public node builders (the plugin SDK), not a scheduler


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
                and issubclass(cls, Scheduler)
                and not inspect.isabstract(cls)
            ):
                found[cls.name] = cls
    return dict(sorted(found.items()))  # by name: a module may hold several (accelerate, zero-inference)


def plugins() -> dict[str, EntryPoint]:
    """Third-party schedulers by name, not loaded; a plugin cannot shadow a built-in."""
    shadowed = builtin()
    return {e.name: e for e in entry_points(group=ENTRY_POINT_GROUP) if e.name not in shadowed}


def names() -> list[str]:
    """Every scheduler name, built-ins first, without loading any plugin."""
    return [*builtin(), *plugins()]


def default_name(cuda: bool) -> str:
    """The scheduler a run takes without --scheduler: eager where it computes on a GPU, cpu (the whole
    model on the host's CPU, a node per decoder layer) where it uses none: on one device with one lane
    nothing overlaps, and eager's finer nodes cost the host ~1 ms a decode step more (schedulers/cpu.py)."""
    return "eager" if cuda else "cpu"


def load(name: str) -> type[Scheduler]:
    """The scheduler class of `name`; ConfigError naming the plugin if it cannot be used."""
    if name in builtin():
        return builtin()[name]
    entry = plugins().get(name)
    if entry is None:
        raise ConfigError(f"unknown scheduler {name!r}; available: {', '.join(names())}")
    try:
        cls = entry.load()
    except Exception as exc:  # whatever a third-party import raises
        raise ConfigError(f"scheduler plugin {name!r} ({entry.value}) failed to load: {_why(exc)}") from exc
    problem = _class_problem(cls)
    if problem:
        raise ConfigError(f"scheduler plugin {name!r} ({entry.value}) {problem}")
    return cls


def _class_problem(cls: object) -> str | None:
    if not inspect.isclass(cls) or not issubclass(cls, Scheduler):
        what = f"the class {cls.__name__}" if inspect.isclass(cls) else f"a {type(cls).__name__}"
        return f"is {what}, not a scheduler class (a subclass of flowmoe.core.scheduling.Scheduler)"
    for attribute in ("name", "summary"):
        if not isinstance(inspect.getattr_static(cls, attribute, None), str):
            return f"has no `{attribute}` (a one-line str class attribute)"
    missing = sorted(cls.__abstractmethods__)
    if missing:
        return f"lacks {', '.join(missing)}"
    try:
        knobs(cls.Options)  # its options are flags of every command: a bad field fails only this plugin
    except ConfigError as exc:
        return f"has unusable Options: {exc}"
    return None


def available() -> dict[str, type[Scheduler]]:
    """Every scheduler that loads, by name, built-ins first (see `broken()` for the others)."""
    found = dict(builtin())
    for name in plugins():
        try:
            found[name] = load(name)
        except ConfigError:
            continue
    return found


def broken() -> dict[str, str]:
    """Plugins that cannot be used, with why."""
    errors = {}
    for name in plugins():
        try:
            load(name)
        except ConfigError as exc:
            errors[name] = str(exc)
    return errors


def create(name: str, context: SchedulerContext) -> Scheduler:
    """The scheduler `name` built for `context`, its residency and weight buffer checked."""
    cls = load(name)
    try:
        scheduler = cls(context)
        residency, buffer = scheduler.residency(), scheduler.weight_buffer_bytes()
    except FlowmoeError:
        raise
    except Exception as exc:  # a plugin's own bug
        raise ConfigError(f"scheduler {name!r} failed to start: {_why(exc)}") from exc
    problem = _residency_problem(residency, context.spec)
    if problem:
        raise ConfigError(f"scheduler {name!r}: its residency {problem}")
    if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 0:
        raise ConfigError(f"scheduler {name!r}: weight_buffer_bytes() is {buffer!r}, not a byte count >= 0")
    return scheduler


def _residency_problem(residency: object, spec: ModelSpec) -> str | None:
    if not isinstance(residency, Residency):
        return f"is a {type(residency).__name__}, not a Residency"
    layers = [x for x in residency.dense if not (isinstance(x, int) and 0 <= x < spec.layers)]
    if layers:
        return f"names layer {layers[0]!r}; the model has layers 0..{spec.layers - 1}"
    for item in residency.experts:
        layer, expert = item if isinstance(item, tuple) and len(item) == 2 else (None, None)
        if not (
            isinstance(layer, int)
            and 0 <= layer < spec.layers
            and spec.is_moe_layer(layer)
            and isinstance(expert, int)
            and 0 <= expert < spec.moe.experts
        ):
            return (
                f"names expert {item!r}; experts are (MoE layer, 0..{spec.moe.experts - 1}) "
                f"with layers 0..{spec.layers - 1}"
            )
    return None


def checked_plan(scheduler: Scheduler, step: StepShape) -> PlanStream:
    """`scheduler.plan(step)`, failing with a PlanError naming the scheduler if it is not a
    generator, raises, yields something that is neither a TaskNode nor a RoutingRequest, or
    plans no node at all."""
    name = scheduler.name
    try:
        plan = scheduler.plan(step)
    except FlowmoeError:
        raise
    except Exception as exc:
        raise PlanError(f"scheduler {name!r} failed to plan step {step.step}: {_why(exc)}") from exc
    if not isinstance(plan, Generator):
        raise PlanError(
            f"scheduler {name!r}: plan() returned {type(plan).__name__}, not a generator of TaskNodes"
        )
    return CheckedPlan(name, step, plan)


class CheckedPlan(WrappedPlan):
    """A plan stream that turns a plugin's faults into a PlanError naming it."""

    def __init__(self, name: str, step: StepShape, plan: PlanStream) -> None:
        self.name, self.step, self.plan, self.planned = name, step, plan, False

    def send(self, reply: ExpertCounts | None) -> TaskNode | RoutingRequest:
        try:
            item = self.plan.send(reply)
        except StopIteration:
            if not self.planned:
                raise PlanError(
                    f"scheduler {self.name!r} planned no node for step {self.step.step}"
                ) from None
            raise
        except FlowmoeError:
            raise
        except Exception as exc:
            raise PlanError(
                f"scheduler {self.name!r} failed to plan step {self.step.step}: {_why(exc)}"
            ) from exc
        if isinstance(item, TaskNode):
            self.planned = True  # a node: the plan is not empty
        elif not isinstance(item, RoutingRequest):
            raise PlanError(
                f"scheduler {self.name!r} yielded a {type(item).__name__}, "
                "neither a TaskNode nor a RoutingRequest"
            )
        return item


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
