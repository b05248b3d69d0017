"""Schedulers' options (flowmoe.core.options): one instance per class in a policy, validators that name
the flag, a shared knob is one flag for every scheduler that takes it, and two classes cannot claim
one flag with different meanings."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest
from attrs import frozen

from flowmoe.cli import main
from flowmoe.cli.option_flags import option_flags
from flowmoe.core.errors import ConfigError
from flowmoe.core.options import option
from flowmoe.core.policy import Policy
from flowmoe.core.ranges import IntRange
from flowmoe.schedulers import registry
from flowmoe.schedulers.eager import EagerScheduler
from flowmoe.schedulers.klotski import KlotskiOptions
from flowmoe.schedulers.lru_cache import LRUCacheOptions
from flowmoe.schedulers.shared_options import ExpertCacheOptions, HotExpertsOptions, PagedOptions


def test_a_policy_holds_one_instance_per_options_class_and_leaves_defaults_out() -> None:
    policy = Policy(options=(KlotskiOptions(group_size=2), PagedOptions()))
    assert policy.options == (KlotskiOptions(group_size=2),)  # PagedOptions() is every default
    assert policy.options_for(KlotskiOptions).group_size == 2
    assert policy.options_for(PagedOptions) == PagedOptions()  # none held: the class's defaults
    assert Policy(options=(KlotskiOptions(),)) == Policy()
    assert policy.with_options(KlotskiOptions(group_size=3)).options == (KlotskiOptions(group_size=3),)
    with pytest.raises(ConfigError, match="two KlotskiOptions"):
        Policy(options=(KlotskiOptions(group_size=1), KlotskiOptions(group_size=2)))
    with pytest.raises(ConfigError, match="options instances"):
        Policy(options=(3,))


def test_validators_name_the_flag_and_the_field() -> None:
    with pytest.raises(
        ConfigError, match=r"^--cache-ways \(LRUCacheOptions.cache_ways\) must be an integer >= 1"
    ):
        LRUCacheOptions(cache_ways=0)
    with pytest.raises(ConfigError, match=r"^--page-size \(PagedOptions.page_bytes\) must be a size"):
        PagedOptions(page_bytes=0)
    with pytest.raises(ConfigError, match="got True"):
        KlotskiOptions(group_size=True)
    assert ExpertCacheOptions().expert_cache_slots is None  # not set: --weights-gpu-share decides
    with pytest.raises(ConfigError, match="--expert-cache-slots"):
        ExpertCacheOptions(expert_cache_slots=0)


def test_a_shared_knob_is_one_flag_for_every_scheduler_that_takes_it(capsys: pytest.CaptureFixture) -> None:
    flags = {o.name: o for o in option_flags()}
    assert (flags["expert_cache_slots"].owner, flags["expert_cache_slots"].takers) == (
        ExpertCacheOptions,
        ("fate", "hybrimoe", "lru-cache"),
    )
    assert (flags["page_bytes"].flag, flags["page_bytes"].takers) == ("--page-size", ("cgopipe", "lru-cache"))
    assert (flags["hot_experts"].owner, flags["hot_experts"].takers) == (
        HotExpertsOptions,
        ("hybrimoe", "klotski"),
    )
    assert flags["cache_ways"].takers == ("lru-cache",) and flags["defer_experts"].takers == (
        "ktransformers",
    )
    assert main(["compare", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.count("\n  --expert-cache-slots EXPERT_CACHE_SLOTS") == 1  # one flag in --help
    assert "options of fate, hybrimoe, lru-cache:" in text


@frozen
class OtherHotExperts:
    hot_experts: int = option(4, "something else under the same name", IntRange(1))


class Other(EagerScheduler):
    name = "other"
    Options = OtherHotExperts


def test_two_classes_cannot_claim_one_flag_with_different_meanings(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = EntryPoint("other", f"{__name__}:Other", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(
        registry, "entry_points", lambda group: [entry] if group == registry.ENTRY_POINT_GROUP else []
    )
    with pytest.raises(ConfigError, match=r"OtherHotExperts.hot_experts and HotExpertsOptions.hot_experts .* "
                                          r"would both be --hot-experts"):  # fmt: skip
        option_flags()
