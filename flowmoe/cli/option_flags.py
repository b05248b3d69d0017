"""The schedulers' options as command-line flags of `run`, `simulate` and `compare`, generated from
the options classes of every scheduler the registry loads, third-party plugins' included
(`flowmoe.core.options`): one flag per options field, with its range in `--help`, in one group per
class that declares fields, titled by the schedulers that take them, so a knob several schedulers
share is one flag. A flag's default is None (not given): the scheduler's own default applies, and
the best-policy search knows which options the user fixed."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from attrs import evolve, frozen

from flowmoe.core.errors import ConfigError
from flowmoe.core.options import built, declared_by, flag, knob, knobs
from flowmoe.core.ranges import ByteSize, size_flag
from flowmoe.schedulers.registry import available, load

DEST = "option:"  # an option flag's dest: this and the field's name (no other flag's dest has a colon)


@frozen
class OptionFlag:
    """One options field as a flag: the class that declares it and the schedulers that take it."""

    attribute: attrs.Attribute
    owner: type
    takers: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.attribute.name

    @property
    def flag(self) -> str:
        return flag(self.attribute)


def option_flags() -> list[OptionFlag]:
    """Every scheduler's options fields, by field name; a name two classes declare differently (its
    range, help or default) is an error naming both, as it cannot be one flag."""
    found: dict[str, OptionFlag] = {}
    for name, scheduler in available().items():
        for attribute in knobs(scheduler.Options):
            owner = declared_by(scheduler.Options, attribute)
            seen = found.get(attribute.name)
            if seen is None:
                found[attribute.name] = OptionFlag(attribute, owner, (name,))
            elif seen.owner is owner or _same(seen.attribute, attribute):
                found[attribute.name] = evolve(seen, takers=(*seen.takers, name))
            else:
                raise ConfigError(
                    f"scheduler {name}: option {owner.__qualname__}.{attribute.name} and "
                    f"{seen.owner.__qualname__}.{attribute.name} ({', '.join(seen.takers)}) differ but would "
                    f"both be {seen.flag}: rename one field"
                )
    return list(found.values())


def _same(a: attrs.Attribute, b: attrs.Attribute) -> bool:
    """Two fields one flag can stand for: the same Knob and default."""
    return (knob(a), a.default) == (knob(b), b.default)


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """The option flags, a group per options class that declares fields."""
    groups: dict[type, Any] = {}
    for option in option_flags():
        if option.owner not in groups:
            title = f"options of {', '.join(option.takers)}"
            summary = (option.owner.__doc__ or "").strip().splitlines()
            groups[option.owner] = parser.add_argument_group(title, summary[0] if summary else None)
        k, default = knob(option.attribute), option.attribute.default
        shown = size_flag(default) if isinstance(k.range, ByteSize) and default is not None else default
        try:
            groups[option.owner].add_argument(
                option.flag,
                dest=DEST + option.name,
                type=k.range,
                metavar=option.flag.lstrip("-").replace("-", "_").upper(),
                help=k.help.replace("%", "%%")
                + (" (%(type)s)" if default is None else f" (%(type)s; default {shown})"),
            )
        except argparse.ArgumentError as exc:
            raise ConfigError(f"option {option.owner.__qualname__}.{option.name}: {exc}") from exc


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The option flags given, by field name."""
    values = vars(args)
    return {o.name: values[DEST + o.name] for o in option_flags() if values.get(DEST + o.name) is not None}


def check_taken(given: Mapping[str, Any], schedulers: Sequence[str]) -> None:
    """Every option given is one that each of `schedulers` takes; else a ConfigError naming the flag,
    the schedulers that take it and one that does not."""
    for option in option_flags():
        refused = [name for name in schedulers if option.name in given and name not in option.takers]
        if refused:
            raise ConfigError(
                f"{option.flag} is an option of {', '.join(option.takers)}; scheduler {refused[0]} does not "
                f"take it: run {' or '.join(option.takers)}, or leave {option.flag} out"
            )


def options_of(scheduler: str, given: Mapping[str, Any]) -> object:
    """Scheduler `scheduler`'s options with the values `given` (its defaults for the others)."""
    return built(load(scheduler).Options, given)


def cautions(given: Mapping[str, Any]) -> list[str]:
    """A line for each option given away from its default whose knob has a caution (one that changes
    the model's outputs, …)."""
    return [
        f"{o.flag} {given[o.name]}: {knob(o.attribute).caution}"
        for o in option_flags()
        if o.name in given and knob(o.attribute).caution and given[o.name] != o.attribute.default
    ]
