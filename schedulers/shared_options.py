"""Options several schedulers share (`flowmoe.core.options`). A scheduler's options class is one of
these or inherits those it takes, so a shared knob is one flag, one default and one range for all
of them; a third-party scheduler may inherit them too. They keep a `__dict__` (`slots=False`):
slotted classes cannot be combined as the bases of one class."""

from __future__ import annotations

from attrs import frozen

from flowmoe.core.errors import ConfigError
from flowmoe.core.memory import gib
from flowmoe.core.options import option
from flowmoe.core.ranges import ByteSize, IntRange, size_flag
from flowmoe.core.spec import ModelSpec

MAX_PAGES_PER_EXPERT = 256  # a paged expert is one copy node per page: bound the nodes of a step


def check_pages(page_bytes: int, spec: ModelSpec) -> None:
    """A page size against the model: at most MAX_PAGES_PER_EXPERT pages per expert."""
    pages = -(-spec.expert_bytes // page_bytes)
    if pages > MAX_PAGES_PER_EXPERT:
        least = -(-spec.expert_bytes // MAX_PAGES_PER_EXPERT // 2**16) * 2**16  # rounded up to 64 KiB
        raise ConfigError(
            f"--page-size {size_flag(page_bytes)} cuts each expert ({gib(spec.expert_bytes)}) into {pages} "
            f"pages; at most {MAX_PAGES_PER_EXPERT} are allowed: use --page-size {size_flag(least)} or more"
        )


@frozen(slots=False)
class PagedOptions:
    """Offloaded weights cross the link in pages, one copy node each (cgopipe, lru-cache)."""

    page_bytes: int = option(
        16 * 2**20, "weight page size", ByteSize(), flag="--page-size", label="page", check=check_pages
    )


@frozen(slots=False)
class ExpertCacheOptions:
    """A GPU expert cache of a fixed number of slots (lru-cache, fate, hybrimoe)."""

    expert_cache_slots: int | None = option(
        None, "experts the GPU expert cache holds; default: --weights-gpu-share of them", IntRange(1),
        label="slots",
    )  # fmt: skip


@frozen(slots=False)
class HotExpertsOptions:
    """Experts prefetched per layer ahead of its gate (klotski's hot experts, hybrimoe's prefetch)."""

    hot_experts: int = option(
        0, "experts prefetched per layer (0: the model's top-k)", IntRange(0), label="K"
    )
