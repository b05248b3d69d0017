"""A jinja2 sandbox with a render deadline and a size budget, for untrusted chat templates.

jinja2's immutable sandbox stops a template from reaching Python internals, but
not from looping 10^10 times or building a 3 GB string. Here every call, filter,
attribute lookup, loop iteration, operator and `~` concatenation checks a
per-render deadline, and every string or list a template builds (and the output
itself) is bounded before it is allocated where the size is known in advance,
and right after otherwise. `include`, `extends` and `import` find no template:
a chat template is one file.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import jinja2
from attrs import define
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

RENDER_SECONDS = 2.0  # real templates render in milliseconds
MAX_CHARS = 1 << 22  # characters (or list items) of any value or of the output; ~1M tokens of text
MAX_TOTAL = 64 * MAX_CHARS  # of all the values one render builds (what it can hold alive at once)
MAX_EXPONENT = 4096
Sized = str | list | tuple


class RenderLimitError(jinja2.TemplateError):
    """A template that ran past the deadline or built a value over the size budget."""


@define
class Budget:
    deadline: float
    built: int = 0  # characters and items of the values built so far

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderLimitError(f"rendering took longer than {RENDER_SECONDS:g} s; stopped")

    def size(self, n: int, what: str = "a value") -> None:
        if n > MAX_CHARS:
            raise RenderLimitError(f"{what} of {n} characters or items is over the limit of {MAX_CHARS}")

    def spend(self, n: int) -> None:
        """A value of `n` characters or items was built; all of them together are bounded too."""
        self.size(n)
        self.built += n
        if self.built > MAX_TOTAL:
            raise RenderLimitError(f"built over {MAX_TOTAL} characters or items in all; stopped")


_current: ContextVar[Budget | None] = ContextVar("chat_template_budget", default=None)


def _tick() -> Budget | None:
    budget = _current.get()
    if budget is not None:
        budget.tick()
    return budget


def _checked(budget: Budget | None, value: Any) -> Any:
    if budget is not None and isinstance(value, Sized):
        budget.spend(len(value))
    return value


def _check_args(budget: Budget | None, args: Iterable[Any]) -> None:
    """A width, count or repeat over the budget (`center(10**9)`) is refused before the call."""
    if budget is not None:
        for arg in args:
            if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > MAX_CHARS:
                budget.size(abs(arg), "an argument")


class Bounds(Extension):
    """Gives compiled templates `iterate` (every for loop) and `concat` (every `~`)."""

    def iterate(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            _tick()
            yield item

    def concat(self, *parts: Any) -> str:
        budget = _tick()
        texts = [str(p) for p in parts]
        if budget is not None:
            budget.spend(sum(map(len, texts)))
        return "".join(texts)


class _Route(NodeTransformer):
    """Rewrites a parsed template so its loops and `~` go through Bounds."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)  # rewrites node's children in place
        node.iter = nodes.Call(self.bounds.attr("iterate"), [node.iter], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)  # rewrites node's children in place
        return nodes.Call(self.bounds.attr("concat"), node.nodes, [], None, None, lineno=node.lineno)


class NoFiles(jinja2.BaseLoader):
    def get_source(self, environment: jinja2.Environment, template: str) -> Any:
        raise jinja2.TemplateNotFound(
            template, f"cannot load {template!r}: include, extends and import are not available"
        )


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, **options: Any) -> None:
        extensions = [*options.pop("extensions", ()), Bounds]
        super().__init__(loader=NoFiles(), extensions=extensions, **options)
        self.globals.pop("lipsum", None)  # `lipsum(4000000)` ran for minutes; no chat template uses it

    def compile_bounded(self, source: str) -> jinja2.Template:
        """`source` compiled with its loops and `~` routed through the budget, every filter
        (the built-in ones and any added since) wrapped to check it."""
        self.filters = {name: _bounded_filter(f) for name, f in self.filters.items()}
        bounds = self.extensions[Bounds.identifier]
        assert isinstance(bounds, Bounds)
        with _budget():  # jinja evaluates constant expressions (`'x'|center(n)`) while compiling
            return self.from_string(_Route(bounds).visit(self.parse(source)))

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        budget = _tick()
        if budget is not None:
            _precheck_binop(budget, operator, left, right)
        return _checked(budget, super().call_binop(context, operator, left, right))

    def call(self, context: jinja2.runtime.Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = _tick()
        _check_args(budget, [*args, *kwargs.values()])
        method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
        if getattr(method, "__name__", None) in ("format", "format_map"):
            _check_format(budget, getattr(method, "__self__", None))
        return _checked(budget, super().call(context, obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)


def _precheck_binop(budget: Budget, operator: str, left: Any, right: Any) -> None:
    """The size of `'x' * n`, `a + b` and `fmt % args` known before Python allocates it."""
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, Sized) and isinstance(count, int):
                budget.size(len(seq) * count)
    elif operator == "+" and isinstance(left, Sized) and isinstance(right, Sized):
        budget.size(len(left) + len(right))
    elif operator == "%":
        _check_format(budget, left)
    elif operator == "**" and isinstance(right, int | float) and abs(right) > MAX_EXPONENT:
        raise RenderLimitError(f"an exponent of {right} is over the limit of {MAX_EXPONENT}")


def _check_format(budget: Budget | None, spec: Any) -> None:
    """A width or precision over the budget in a format string (`'%999999999d'`)."""
    if isinstance(spec, str):
        _check_args(budget, [int(w) for w in re.findall(r"\d{1,12}", spec)])


def _bounded_filter(function: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(function, "bounded", False):
        return function

    @functools.wraps(function)  # keeps jinja's pass_context / pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _tick()
        _check_args(budget, [*args, *kwargs.values()])
        if budget is not None:  # what a filter reads bounds what it builds (`[a]*1000|tojson`)
            for arg in args:
                budget.size(_deep_size(arg), "an input")
        if function.__name__ == "do_format" and args:
            _check_format(budget, args[0])
        return _checked(budget, function(*args, **kwargs))

    bounded.bounded = True  # type: ignore[attr-defined]  # a mark on the wrapper, read by getattr above
    return bounded


def _deep_size(value: Any) -> int:
    """Characters and items in `value` and everything it holds (strings, lists, tuples, dicts),
    counted only up to just past MAX_CHARS: what serialising it (`tojson`, `string`, `join`) would
    build at least, known before the filter runs."""
    total, stack = 0, [value]
    while stack and total <= MAX_CHARS:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, list | tuple):
            total += len(item)
            stack.extend(item[: MAX_CHARS + 1])
        elif isinstance(item, dict):
            total += len(item)
            stack.extend(list(item.items())[: MAX_CHARS + 1])
    return total


@contextmanager
def _budget() -> Iterator[Budget]:
    budget = Budget(time.monotonic() + RENDER_SECONDS)
    token = _current.set(budget)
    try:
        yield budget
    finally:
        _current.reset(token)


def render_bounded(template: jinja2.Template, **variables: Any) -> str:
    """The template's output, under the deadline and the size budget (RenderLimitError past them)."""
    with _budget() as budget:
        parts: list[str] = []
        size = 0
        for part in template.generate(**variables):
            size += len(part)
            budget.size(size, "the rendered prompt")
            budget.tick()
            parts.append(part)
        return "".join(parts)
