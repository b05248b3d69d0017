"""Registry of supported model families, looked up by `architectures` or `model_type`."""

from __future__ import annotations

from typing import Any

from flowmoe.core.errors import ConfigError
from flowmoe.core.families import (
    deepseek,
    ernie45_moe,
    glm4_moe,
    gpt_oss,
    granite_moe,
    llama4,
    mixtral,
    olmoe,
    phimoe,
    qwen_moe,
)
from flowmoe.core.families.base import Family, TensorNames

FAMILIES: tuple[Family, ...] = (
    mixtral.FAMILY,
    qwen_moe.QWEN2,
    qwen_moe.QWEN3,
    olmoe.FAMILY,
    gpt_oss.FAMILY,
    deepseek.V2,
    deepseek.V3,
    glm4_moe.FAMILY,
    llama4.FAMILY,
    phimoe.FAMILY,
    granite_moe.FAMILY,
    ernie45_moe.FAMILY,
)

__all__ = ["FAMILIES", "Family", "TensorNames", "family_for_config", "family_named"]


def supported() -> str:
    return ", ".join(a for f in FAMILIES for a in f.architectures)


def family_named(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ConfigError(f"unknown model family {name!r}; supported: {', '.join(f.name for f in FAMILIES)}")


def family_for_config(config: dict[str, Any], where: str = "config") -> Family:
    """The family `architectures` and `model_type` name; when both name a family they must name
    the same one (a config naming two is refused, not settled by the registry's order)."""
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    by_arch = [f for f in FAMILIES if any(a in f.architectures for a in archs)]
    by_type = [f for f in FAMILIES if model_type in f.model_types]
    if by_arch and by_type and by_type[0] not in by_arch:
        raise ConfigError(
            f'{where}: "architectures" ({", ".join(map(str, archs))}) and "model_type" ({model_type}) '
            f"name different model families ({by_arch[0].name}, {by_type[0].name}); fix one of them"
        )
    if len(by_arch) > 1:
        names = ", ".join(f.name for f in by_arch)
        raise ConfigError(f'{where}: "architectures" names more than one model family ({names})')
    for family in (*by_arch, *by_type):
        return family
    found = ", ".join(archs) or model_type or "none given"
    raise ConfigError(f"{where}: unsupported architecture {found}; supported: {supported()}")
