"""Policy: the knobs a scheduler and the memory planner agree on for one run. One frozen value."""

from __future__ import annotations

from typing import Literal

from attrs import field, frozen

from flowmoe.core.errors import ConfigError

Place = Literal["gpu", "cpu"]
ExpertFormat = Literal["native", "fp8"]
EXPERT_FORMATS: tuple[ExpertFormat, ...] = ("native", "fp8")

UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
         "gb": 10**9, "tb": 10**12, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}  # fmt: skip


def parse_bytes(text: str) -> int:
    """'16GiB', '24 GB', '512MiB', '1e9' -> bytes."""
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number) :]
    if unit not in UNITS or not number:
        raise ConfigError(f"cannot read {text!r} as a size; use e.g. 16GiB, 24GB or 512MiB")
    try:
        return int(float(number) * UNITS[unit])
    except ValueError as exc:
        raise ConfigError(f"cannot read {text!r} as a size; use e.g. 16GiB, 24GB or 512MiB") from exc


def check_defer(defer: int, top_k: int) -> None:
    """KTransformers' Expert Deferral keeps at least one expert of each token in its own layer."""
    if defer and defer >= top_k:
        raise ConfigError(
            f"--defer-experts {defer} must be below the model's top-k ({top_k}): "
            "each token keeps at least one expert in its own layer"
        )


@frozen
class Policy:
    """Batch size N and micro-batch size μ, where attention and FFNs run, what stays on the GPU.

    `gpu_memory` is the budget flowmoe's own accounting enforces (None: unlimited, or
    the device's memory), so a small GPU can be emulated on a big one."""

    micro_batch_size: int = 16
    micro_batches: int = 1
    attention_on: Place = "gpu"
    ffn_on: Place = "gpu"
    weights_gpu_share: float = field(default=1.0)  # share of expert weights resident on the GPU
    kv_gpu_share: float = field(default=1.0)  # share of the KV cache kept on the GPU
    expert_cache_slots: int = 0  # experts the GPU expert cache holds (0: scheduler default)
    cache_ways: int = 4  # associativity of the set-associative expert cache
    group_size: int = 0  # Klotski's n (0: let its planner choose)
    hot_experts: int = 0  # Klotski's K hot experts prefetched per layer (0: top_k)
    # KTransformers' Expert Deferral: experts per token whose output goes into the next layer (0: none;
    # more changes the model's outputs, so only the ktransformers scheduler takes it)
    defer_experts: int = 0
    page_bytes: int = 16 * 2**20  # CGOPipe weight page size
    gpu_memory: int | None = None  # bytes; None = unlimited
    cpu_threads: int | None = None
    # how host-side experts cross the link: "native" in the model's dtype, or "fp8" (an FP8
    # checkpoint's e4m3 values + block scales, dequantized on the GPU after the copy)
    expert_format: ExpertFormat = "native"

    @weights_gpu_share.validator
    @kv_gpu_share.validator
    def _share(self, attribute: object, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{getattr(attribute, 'name', 'share')} must be in [0, 1], got {value}")

    def __attrs_post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.micro_batches < 1:
            raise ConfigError("micro-batch size and count must be at least 1")
        if self.defer_experts < 0:
            raise ConfigError(f"--defer-experts must be >= 0, got {self.defer_experts}")
        if self.page_bytes < 1:
            raise ConfigError(f"page size must be positive, got {self.page_bytes}")
        if self.expert_format not in EXPERT_FORMATS:
            raise ConfigError(
                f"expert format must be one of {', '.join(EXPERT_FORMATS)}, got {self.expert_format!r}"
            )

    @property
    def batch_size(self) -> int:
        return self.micro_batch_size * self.micro_batches
