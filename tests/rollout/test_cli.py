"""The `rollout` command's parsers, as a new user meets them: every flag says what it does and its
default, abbreviations are refused, a wrong flag is reported with its subcommand's usage, and
`serve` takes the model positionally or as --model (as `vllm serve` does). Nothing is started.
"""
import argparse

import pytest

from rollout import cli


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", ["generate", "serve", "dashboard"])
def test_every_flag_has_help_and_its_default(command):
    _, commands = cli.build_parser()
    parser = commands[command]
    text = parser.format_help()
    for action in options(parser):
        flag = action.option_strings[0]
        assert action.help, f"{command} {flag} has no help"
        switch = action.nargs == 0  # store_true / store_false: off or on unless given
        shown = parser._get_formatter()._get_help_string(action)  # with "(default: X)" appended
        assert switch or "default" in shown, f"{command} {flag} does not say its default"
    assert "(default: auto)" in text or command == "dashboard"


def test_serve_help_reads_in_sections():
    _, commands = cli.build_parser()
    text = commands["serve"].format_help()
    assert text.startswith("usage: rollout serve [MODEL] [options]")
    for section in ("model:", "engine: memory and scheduling:", "LoRA adapters:",
                    "scale-out: engine replicas and API servers:", "HTTP server: address, keys and limits:",
                    "logs, metrics and profiling:"):
        assert f"\n{section}\n" in text, section
    # the two stats intervals say what each is for
    text = " ".join(text.split())
    assert "polls the engine's stats for /metrics and W&B" in text
    assert "log one engine stats line to the console" in text


@pytest.mark.parametrize("argv, wrong", [
    (["serve", "--dtyp", "bfloat16"], "--dtyp"),  # an abbreviation is not a flag
    (["serve", "--prot", "1"], "--prot"),         # a misspelt flag
    (["generate", "hi", "--max-token", "3"], "--max-token"),
    (["dashboard", "runs/x", "--ou", "y"], "--ou"),
])
def test_a_wrong_flag_shows_its_subcommands_usage(argv, wrong, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: rollout {argv[0]}"), err
    assert f"error: unrecognized arguments: {wrong}" in err


def test_top_level_refuses_abbreviations():
    ap, commands = cli.build_parser()
    assert ap.allow_abbrev is False and all(p.allow_abbrev is False for p in commands.values())


@pytest.mark.parametrize("argv, model", [
    (["serve"], None),
    (["serve", "/models/a"], "/models/a"),
    (["serve", "--model", "/models/a"], "/models/a"),
    (["serve", "/models/a", "--model", "/models/a"], "/models/a"),
])
def test_serve_takes_the_model_positionally_or_as_a_flag(argv, model):
    ap, commands = cli.build_parser()
    args = ap.parse_args(argv)
    cli._resolve_model(commands["serve"], args)
    assert args.model == model


def test_serve_refuses_two_different_models(capsys):
    ap, commands = cli.build_parser()
    args = ap.parse_args(["serve", "/models/a", "--model", "/models/b"])
    with pytest.raises(SystemExit):
        cli._resolve_model(commands["serve"], args)
    assert "the model is given twice" in capsys.readouterr().err


def test_serve_flags_reach_the_same_destinations():
    """The sections changed only how --help reads: the flags and what they set stay."""
    ap, _ = cli.build_parser()
    args = ap.parse_args(["serve", "-dp", "2", "-asc", "2", "--no-enable-prefix-caching", "--kv-cache-memory", "512MiB",
                          "--stats-interval-s", "0.2", "--log-stats-interval-s", "5", "--lora-modules", "a=/x"])
    assert (args.data_parallel_size, args.api_server_count, args.enable_prefix_caching) == (2, 2, False)
    assert (args.kv_cache_memory, args.stats_interval_s, args.log_stats_interval_s) == (512 << 20, 0.2, 5.0)
    assert args.lora_modules == ["a=/x"] and args.max_body_bytes == 16 << 20
    assert args.kv_cache_dtype == "auto"
    assert ap.parse_args(["serve", "--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"


@pytest.mark.parametrize("text, n", [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1000000", 10**6), ("1.5k", 1536)])
def test_sizes(text, n):
    assert cli._bytes(text) == n
