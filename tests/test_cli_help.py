"""What `--help` shows (issue 27, item 4): every flag's default, and the global flags accepted after
the subcommand too."""

from __future__ import annotations

import argparse

import pytest

from flowmoe.cli import COMMANDS, main, parser


def _subparsers(top: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = {}
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found[name] = child
                found.update({f"{name} {k}": v for k, v in _subparsers(child).items()})
    return found


def test_every_flag_with_a_default_shows_it() -> None:
    subs = _subparsers(parser())
    assert set(COMMANDS) <= set(subs)
    for name, sub in subs.items():
        text = sub.format_help()
        for action in sub._actions:
            default = action.default
            if not action.option_strings or default in (None, argparse.SUPPRESS) or default is False:
                continue
            if default == []:
                continue
            assert action.help and "default" in sub._get_formatter()._expand_help(action), (name, action.dest)
        assert text


def test_run_help_names_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # lines joined: argparse wraps at COLUMNS
    shown_scheduler = "(default: eager where the run uses a GPU, cpu where it does not"
    for shown in (shown_scheduler, "(default: 32)", "(default: 16)", "(default: 1)"):
        assert shown in text


@pytest.mark.parametrize("flag", ["--log-json", "-v", "--verbose"])
def test_global_flags_after_the_subcommand(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets", flag]) == 0
    assert main([flag, "presets"]) == 0
    assert "mixtral-8x7b" in capsys.readouterr().out


def test_global_flag_given_before_holds() -> None:
    top = parser(["--log-json", "schedulers"])
    assert top.parse_args(["--log-json", "schedulers"]).log_json is True
    assert top.parse_args(["schedulers", "--log-json"]).log_json is True
    assert top.parse_args(["schedulers"]).log_json is False


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main([*argv, "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())  # lines joined: argparse wraps at COLUMNS


def test_simulate_help_lists_the_hardware_presets(capsys: pytest.CaptureFixture[str]) -> None:
    """issue 27 item 9: the presets named where --hardware is explained, in simulate and plan."""
    from flowmoe.core.hardware_presets import PRESETS

    for command in ("simulate", "plan"):
        text = _help([command], capsys)
        for name in ("t4", "l4", "h100", "a100-80", "rtx4090", "fate-1080ti"):
            assert name in text, (command, name)
        assert len(PRESETS) > 6


def test_help_never_cuts_a_name_at_its_hyphens(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from flowmoe.core.hardware_presets import PRESETS

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["simulate", "--help"]) == 0
    words = set(capsys.readouterr().out.replace(",", " ").replace(")", " ").split())
    assert set(PRESETS) <= words  # each preset whole on one line


def test_reproduce_and_routing_flags_have_help(capsys: pytest.CaptureFixture[str]) -> None:
    """issue 27 item 9: reproduce's PAPER, simulate's --pregate-accuracy and --seed explained."""
    subs = _subparsers(parser())
    for command, dests in (("reproduce", ("paper",)), ("simulate", ("pregate_accuracy", "seed"))):
        actions = {a.dest: a for a in subs[command]._actions}
        for dest in dests:
            assert actions[dest].help and len(actions[dest].help) > 20, (command, dest)
    text = _help(["reproduce"], capsys)
    assert "PAPER" in text and "moe-lightning" in text and "or all (default)" in text


def test_calibrate_offers_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    subs = _subparsers(parser())
    device = next(a for a in subs["calibrate"]._actions if a.dest == "device")
    assert device.choices is not None and "cuda" in device.choices
    assert subs["calibrate"].parse_args(["--device", "cuda"]).device == "cuda"


SHORT_FLAGS = {  # the common options' short forms, the same letter for the same option in every command
    "-m": "--model", "-p": "--prompts", "-o": "--output", "-n": "--max-new-tokens", "-s": "--scheduler",
    "-b": "--batch-size",
}  # fmt: skip


def test_short_flags_mean_the_same_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    """issue 27 item 8: -m, -p, -o, -n, -s and -b, each shown in --help beside its long flag."""
    subs = _subparsers(parser())
    for name, sub in subs.items():
        for action in sub._actions:
            short = [s for s in action.option_strings if len(s) == 2 and s not in ("-h", "-v")]
            assert all(SHORT_FLAGS.get(s) in action.option_strings for s in short), (name, short)
    run = subs["run"].parse_args(["-m", "M", "-p", "P", "-o", "O", "-n", "5", "-s", "fiddler", "-b", "4"])
    assert (
        run.model,
        str(run.prompts),
        str(run.output),
        run.max_new_tokens,
        run.scheduler,
        run.batch_size,
    ) == ("M", "P", "O", 5, "fiddler", 4)
    assert subs["simulate"].parse_args(["-m", "mixtral-8x7b", "-s", "eager", "-b", "8"]).batch_size == 8
    assert subs["calibrate"].parse_args(["-m", "M", "-o", "hw.json"]).model == "M"
    text = _help(["run"], capsys)
    for short, long in SHORT_FLAGS.items():
        assert f"{short} {long[2:].upper().replace('-', '_')}, {long}" in text
