"""Consumer hardware presets (issue 28): the GeForce cards and desktop/laptop hosts people offload on,
each accepted in any case, listed where --hardware is explained, every figure sourced, and their
differences (an 8-lane card, a slower host, a smaller card) showing in what the simulator predicts."""

from __future__ import annotations

import pytest
from attrs import evolve

from flowmoe.cli import main
from flowmoe.core.consumer_presets import CONSUMER
from flowmoe.core.hardware import GB, PRESETS, SUSTAINED, GiB, hardware
from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.core.synthetic_routing import RoutingModel
from flowmoe.core.workloads import workload
from flowmoe.study.simulate import Setup, Simulation

NAMES = {"rtx3060-i9", "rtx3060-ryzen", "rtx4060-i9", "rtx4060-ryzen", "rtx4070-i9", "rtx4070-ryzen",
         "rtx4090-i9", "rtx4090-ryzen", "rtx3080-mobile", "rtx3060", "rtx4060", "rtx4070"}  # fmt: skip


def test_every_consumer_preset_is_a_preset_in_any_case() -> None:
    assert set(CONSUMER) == NAMES and set(PRESETS) >= NAMES
    for name in NAMES:
        assert hardware(name.upper()) is PRESETS[name]
        spec = PRESETS[name]
        assert all(len(spec.source_of(f)) >= 20 for f in SUSTAINED), name
        assert "GeForce" in spec.source or "RTX 4090" in spec.source


def test_the_hosts_and_cards_as_their_datasheets_give_them() -> None:
    i9, ryzen, laptop = hardware("rtx4070-i9"), hardware("rtx4070-ryzen"), hardware("rtx3080-mobile")
    assert (i9.cpu_bandwidth, ryzen.cpu_bandwidth, laptop.cpu_bandwidth) == (89.6 * GB, 83.2 * GB, 51.2 * GB)
    assert (i9.cpu_cores, ryzen.cpu_cores, laptop.cpu_cores) == (24, 16, 8)
    assert hardware("rtx3060").gpu_memory == 12 * GiB and hardware("rtx4060").gpu_memory == 8 * GiB
    assert laptop.gpu_memory == 16 * GiB
    # the RTX 4060 has eight PCIe 4.0 lanes: half the link of the x16 cards, on either host
    assert hardware("rtx4060-ryzen").link_peak == pytest.approx(hardware("rtx4070-ryzen").link_peak / 2)
    assert hardware("rtx4060").h2d_bandwidth == pytest.approx(hardware("rtx3060").h2d_bandwidth / 2)
    assert (
        hardware("rtx3060").name == "rtx3060"
        and hardware("rtx3060").gpu_flops == PRESETS["rtx3060-i9"].gpu_flops
    )


def test_simulate_help_lists_them(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["simulate", "--help"]) == 0
    words = set(capsys.readouterr().out.replace(",", " ").replace(")", " ").split())
    assert words >= NAMES


def _decode(hw: str, share: float, scheduler: str = "on-demand") -> float:
    """Mixtral-8x7B (four layers) at batch 1 with `share` of its experts on the GPU under `scheduler`:
    seconds per decode token."""
    spec = preset("mixtral-8x7b", layers=4)
    setup = Setup(spec, hardware(hw), workload("fixed:16:4"), Policy(1, 1, weights_gpu_share=share),
                  RoutingModel(seed=0), decode_samples=1)  # fmt: skip
    result = Simulation(setup).run(scheduler)
    assert result.error is None and result.token_latency is not None, result.error
    return result.token_latency.mean


def test_the_eight_lane_card_waits_longer_for_its_experts() -> None:
    """Experts copied per token: the x8 RTX 4060 takes about twice the x16 RTX 3060's time."""
    x8, x16 = _decode("rtx4060", 0.0), _decode("rtx3060", 0.0)
    assert 1.6 < x8 / x16 < 2.1


def test_a_card_holding_experts_decodes_faster() -> None:
    assert _decode("rtx3080-mobile", 0.5, "klotski") < _decode("rtx3080-mobile", 0.0, "klotski")


def test_the_simulator_refuses_more_than_the_card_holds() -> None:
    spec = preset("mixtral-8x7b", layers=4)
    setup = Setup(spec, hardware("rtx4060"), workload("fixed:16:4"), Policy(1, 1, weights_gpu_share=1.0))
    assert "over the 8.0 GiB GPU" in (Simulation(setup).run("klotski").error or "")
    bigger = evolve(setup, hardware=hardware("rtx4090-ryzen"))
    assert Simulation(bigger).run("klotski").error is None
