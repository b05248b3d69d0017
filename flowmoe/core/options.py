"""A scheduler's own options: its knobs, declared once, in its own file.

A scheduler class names an attrs frozen options class (`Options`; `NoOptions` where it has no
knob) whose fields are made with `option()`. A field's `Knob` (its metadata) holds what every
consumer of the knob reads: its help and range (the flag that `run`, `simulate` and `compare`
generate, shown in `--help`, and the field's validator), the values the best-policy search tries
where the knob is not given, its label in a result's policy cell, a check against the model, and
a caution `run` prints when it is given. A `Policy` carries one instance per options class
(`Policy.options`); a scheduler reads its own with `policy.options_for(self.Options)`, which gives
the class's defaults where the policy holds none.

Schedulers that share a knob share the class that declares it: an options class may inherit the
fields of several others (attrs subclasses), and a field is one flag wherever it is inherited. A
field's name is its key: in `Given.options` (the values a user fixed) and in a result's JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
from attrs import field, frozen

from flowmoe.core.errors import ConfigError
from flowmoe.core.ranges import ByteSize, IntRange
from flowmoe.core.spec import ModelSpec

KNOB = "flowmoe.knob"  # the metadata key of an options field's Knob
T = TypeVar("T")


@frozen
class Knob:
    """What the command line, the search and the reports know of one options field."""

    help: str
    range: IntRange | ByteSize  # the values allowed, flag and field alike
    candidates: tuple[int, ...] = ()  # what the best-policy search tries where it is not given
    flag: str = ""  # the flag; "" is the field's name as a flag (group_size: --group-size)
    label: str = ""  # its name in a result's policy cell; "" is the field's name
    check: Callable[[Any, ModelSpec], None] | None = None  # raises ConfigError where the model rules it out
    caution: str = ""  # `flowmoe run` prints it when the flag is given (a knob that changes the outputs)


def option(
    default: int | None,
    help: str,
    range: IntRange | ByteSize,
    *,
    candidates: tuple[int, ...] = (),
    flag: str = "",
    label: str = "",
    check: Callable[[Any, ModelSpec], None] | None = None,
    caution: str = "",
) -> Any:
    """An options field with its Knob, validated against `range`; a None default means "not set:
    the scheduler decides" and is allowed besides the range."""
    knob = Knob(help, range, tuple(candidates), flag, label, check, caution)
    return field(default=default, validator=_within, metadata={KNOB: knob})


def _within(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is None and attribute.default is None:
        return
    allowed = knob(attribute).range
    if isinstance(value, bool) or not isinstance(value, int) or not allowed.contains(value):
        raise ConfigError(
            f"{flag(attribute)} ({type(instance).__name__}.{attribute.name}) must be {allowed}, got {value!r}"
        )


@frozen
class NoOptions:
    """The options of a scheduler without knobs."""


def knobs(cls: type) -> tuple[attrs.Attribute, ...]:
    """The fields of options class `cls`; ConfigError where it is not an attrs class or a field was
    not made with `option()`."""
    if not attrs.has(cls):
        raise ConfigError(f"options class {cls.__qualname__} is not an attrs class (use @attrs.frozen)")
    fields = attrs.fields(cls)
    bare = [a.name for a in fields if KNOB not in a.metadata]
    if bare:
        raise ConfigError(
            f"options class {cls.__qualname__}: field {bare[0]} has no Knob (make it with "
            "flowmoe.core.options.option)"
        )
    return fields


def knob(attribute: attrs.Attribute) -> Knob:
    return attribute.metadata[KNOB]


def flag(attribute: attrs.Attribute) -> str:
    """The command-line flag of an options field."""
    return knob(attribute).flag or "--" + attribute.name.replace("_", "-")


def declared_by(cls: type, attribute: attrs.Attribute) -> type:
    """The class in `cls`'s bases (or `cls`) that declares field `attribute`."""
    return next(
        k
        for k in cls.__mro__
        if attrs.has(k) and any(a.name == attribute.name and not a.inherited for a in attrs.fields(k))
    )


def built(cls: type[T], given: Mapping[str, Any]) -> T:
    """Options `cls` with the values `given` by field name; its defaults for the others."""
    return cls(**{a.name: given[a.name] for a in knobs(cls) if a.name in given})


def check_options(options: object, spec: ModelSpec) -> None:
    """Each field of `options` checked against the model (a page size against its experts, …)."""
    for attribute in knobs(type(options)):
        check = knob(attribute).check
        if check is not None:
            check(getattr(options, attribute.name), spec)
