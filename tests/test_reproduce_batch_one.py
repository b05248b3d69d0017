"""`flowmoe reproduce batch-one`: Fiddler against the offloaders it was measured with, one request at a
time, each figure from `batch_one_numbers`; the systems' stand-ins and policies as the sources state."""

from __future__ import annotations

from flowmoe.schedulers.lru_cache import LRUCacheOptions
from flowmoe.study.reproduce import PAPERS, settings
from flowmoe.study.reproduce import batch_one_numbers as B
from flowmoe.study.reproduce.run import run_setting


def test_the_readme_setting_runs_fiddler_ahead_of_both_offloaders() -> None:
    assert "batch-one" in PAPERS
    (setting,) = settings("batch-one", quick=True)
    fiddler, offloading, deepspeed = setting.systems
    assert (fiddler.scheduler, offloading.scheduler, deepspeed.scheduler) == (
        "fiddler",
        "lru-cache",
        "zero-inference",
    )
    assert fiddler.published == B.FIDDLER_README_TPS and fiddler.policy is not None
    assert fiddler.policy.weights_gpu_share == 56 / 256 and fiddler.policy.cpu_threads == 16
    assert offloading.policy is not None
    cache = offloading.policy.options_for(LRUCacheOptions)
    assert (cache.expert_cache_slots, cache.cache_ways, cache.gpu_misses) == (32, 1, 1)  # 8 - 7 offloaded
    assert offloading.implied == B.FIDDLER_README_TPS / B.FIDDLER_README_OVER["Mixtral-offloading"]
    result = run_setting(setting)
    assert all(row["simulated"] for row in result["rows"])
    assert result["ranking"]["holds"] is True
    assert {(s["faster"], s["slower"]) for s in result["speedups"]} == {
        ("Fiddler", "DeepSpeed-MII"),
        ("Fiddler", "Mixtral-offloading"),
    }


def test_the_ttft_settings_keep_each_environments_gpu_experts() -> None:
    full = settings("batch-one")
    assert len(full) == 3
    env2 = full[2]
    assert "Env2" in env2.name and all(s.metric == "prefill tok/s" for s in env2.systems)
    fiddler, offloading, _ = env2.systems
    assert fiddler.policy is not None and fiddler.policy.weights_gpu_share == 125 / 256
    assert offloading.policy is not None
    assert offloading.policy.options_for(LRUCacheOptions).cache_ways == 3  # offload_per_layer 5
