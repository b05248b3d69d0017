"""Policy: the knobs a scheduler and the memory planner agree on for one run. One frozen value."""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import attrs
from attrs import evolve, field, frozen

from flowmoe.core.errors import ConfigError

Place = Literal["gpu", "cpu"]
ExpertFormat = Literal["native", "fp8", "int8", "int4", "hqq4"]
EXPERT_FORMATS: tuple[ExpertFormat, ...] = ("native", "fp8", "int8", "int4", "hqq4")
# formats a model in its own dtype is quantized to as it loads (flowmoe/model/quantize.py)
QUANTIZED_ON_LOAD: tuple[ExpertFormat, ...] = ("int8", "int4", "hqq4")
# how a layer's attention projections (q, k, v, o) are kept: the model's dtype or quantized on load
AttentionFormat = Literal["native", "int8", "int4", "hqq4"]
ATTENTION_FORMATS: tuple[AttentionFormat, ...] = ("native", "int8", "int4", "hqq4")

UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
         "gb": 10**9, "tb": 10**12, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}  # fmt: skip
MAX_BYTES = 2**64  # no memory, disk or budget is larger: a size beyond is a typo, refused as read


def parse_bytes(text: str) -> int:
    """'16GiB', '24 GB', '512MiB', '1e9' -> bytes."""
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number) :]
    if unit not in UNITS or not number:
        raise ConfigError(f"cannot read {text!r} as a size; use e.g. 16GiB, 24GB or 512MiB")
    try:
        value = int(float(number) * UNITS[unit])
    except (ValueError, OverflowError) as exc:  # not a number; inf, nan or 1e999GiB
        raise ConfigError(f"cannot read {text!r} as a size; use e.g. 16GiB, 24GB or 512MiB") from exc
    if not 0 <= value <= MAX_BYTES:
        raise ConfigError(f"{text!r} is not a size between 0 and 16 EiB")
    return value


T = TypeVar("T")


def canonical_options(options: tuple[Any, ...] | list[Any]) -> tuple[Any, ...]:
    """Schedulers' options instances (`core.options`), at most one per class, in the order of their
    class names, those equal to their class's defaults left out: equal policies compare equal."""
    kept: dict[type, Any] = {}
    for item in options:
        kind = type(item)
        if not attrs.has(kind):
            raise ConfigError(f"policy options must be options instances (attrs), got {item!r}")
        if kind in kept:
            raise ConfigError(f"policy options hold two {kind.__name__}: {kept[kind]!r} and {item!r}")
        kept[kind] = item
    ordered = sorted(kept.items(), key=lambda kv: (kv[0].__module__, kv[0].__qualname__))
    return tuple(item for kind, item in ordered if item != kind())


@frozen
class Policy:
    """Batch size N and micro-batch size μ, where attention and FFNs run, what stays on the GPU,
    and each scheduler's own options (`options`, an instance per options class; `options_for`).

    `gpu_memory` is the budget flowmoe's own accounting enforces (None: unlimited, or
    the device's memory), so a small GPU can be emulated on a big one."""

    micro_batch_size: int = 16
    micro_batches: int = 1
    attention_on: Place = "gpu"
    ffn_on: Place = "gpu"
    weights_gpu_share: float = field(default=1.0)  # share of expert weights resident on the GPU
    kv_gpu_share: float = field(default=1.0)  # share of the KV cache kept on the GPU
    gpu_memory: int | None = None  # bytes; None = unlimited
    cpu_threads: int | None = None
    # how experts are kept in host memory and cross the link: "native" in the model's dtype, "fp8"
    # (an FP8 checkpoint's e4m3 values + block scales), or quantized as the model loads: "int8" (per
    # channel), "int4" (groups of 128), "hqq4" (HQQ, groups of 64); dequantized on the GPU after the
    # copy (core/expert_formats.py, model/quantized.py)
    expert_format: ExpertFormat = "native"
    # how the attention projections are kept where the dense part of a layer is offloaded (Klotski(q)):
    # "native", or quantized on load as the experts are (core/expert_formats.py, model/quantize.py)
    attention_format: AttentionFormat = "native"
    # the schedulers' own knobs: each scheduler's options class (its `Options`) says what they are
    options: tuple[Any, ...] = field(default=(), converter=canonical_options)

    @weights_gpu_share.validator
    @kv_gpu_share.validator
    def _share(self, attribute: object, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{getattr(attribute, 'name', 'share')} must be in [0, 1], got {value}")

    def __attrs_post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.micro_batches < 1:
            raise ConfigError("micro-batch size and count must be at least 1")
        if self.expert_format not in EXPERT_FORMATS:
            raise ConfigError(
                f"expert format must be one of {', '.join(EXPERT_FORMATS)}, got {self.expert_format!r}"
            )
        if self.attention_format not in ATTENTION_FORMATS:
            known = ", ".join(ATTENTION_FORMATS)
            raise ConfigError(f"attention format must be one of {known}, got {self.attention_format!r}")

    @property
    def batch_size(self) -> int:
        return self.micro_batch_size * self.micro_batches

    def options_for(self, cls: type[T]) -> T:
        """The policy's instance of options class `cls`, or `cls()` (its defaults) where it has none."""
        return next((item for item in self.options if type(item) is cls), None) or cls()

    def with_options(self, *options: Any) -> Policy:
        """This policy with `options` in place of its instances of the same classes."""
        replaced = {type(item) for item in options}
        return evolve(self, options=(*(o for o in self.options if type(o) not in replaced), *options))
