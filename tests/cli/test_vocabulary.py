"""One vocabulary: a flag means one thing, parsed one way, in every verb that has it; every verb teaches (a
description, examples, defaults shown); a refused flag is one line in one style; docs/cli.md shows the table."""

from pathlib import Path

import pytest

from dpkit.cli.main import build_parser, main
from dpkit.cli.vocabulary import VOCABULARY, verb_parsers, vocabulary_table

PARSER = build_parser()
VERBS = verb_parsers(PARSER)
POSITIONALS = {"launch": ["train.py"], "ckpt inspect": ["model.pt"], "ckpt convert": ["a.pt", "b.pt"]}
# a value for each flag that takes one, parsed by every verb that has the flag
SAMPLES = {
    "--accelerator": "cpu",
    "--devices": "2",
    "--device-counts": "1,2,4",
    "--nproc-per-node": "3",
    "--strategy": "ddp",
    "--strategies": "single,dp",
    "--batch-size": "96",
    "--batch-size-per-device": "32",
    "--precision": "bf16-mixed",
    "--optimizer": "adam",
    "--lr": "0.01",
    "--seed": "7",
    "--example": "digits",
    "--model": "mymodels:build",
    "--data": "mydata:load",
    "--input-shape": "3,32,32",
    "--steps": "5",
    "--warmup": "2",
    "--out": "runs/x",
    "--json": "out.json",
    "--png": "out.png",
    "--link": "pcie4",
    "--catalogue": "mine.toml",
    "--max-restarts": "2",
    "--hang-timeout": "30",
    "--compress": "POWERSGD:4",  # (parsed to its one spelling, powersgd:4, in every verb)
    "--accumulate": "4",
    "--zero-stage": "2",
    "--shard-size": "2",
}


def having(flag):
    return {name: sub for name, sub in VERBS.items() if flag in sub._option_string_actions}


def test_every_shared_flag_comes_from_the_vocabulary_in_every_verb():
    for flag in VOCABULARY:
        assert having(flag), f"{flag} is in no verb"
        for name, sub in having(flag).items():
            assert getattr(sub._option_string_actions[flag], "vocabulary", None) == flag, (name, flag)


@pytest.mark.parametrize("flag", sorted(SAMPLES))
def test_a_flag_is_parsed_the_same_way_in_every_verb_that_has_it(flag):
    parsed = {}
    for name, sub in having(flag).items():
        args, _ = sub.parse_known_args([flag, SAMPLES[flag], *POSITIONALS.get(name, [])])
        parsed[name] = getattr(args, sub._option_string_actions[flag].dest)
    assert len({repr(value) for value in parsed.values()}) == 1, parsed


def test_the_names_that_used_to_mean_two_things_are_gone():
    for name, sub in VERBS.items():
        options = sub._option_string_actions
        assert "--dtype" not in options and "--processes" not in options, name
        if "--devices" in options:  # devices to use, never counts to compare
            assert "--device-counts" not in options, name
    assert set(having("--devices")) == {"train", "profile", "demo"}
    assert set(having("--device-counts")) == {"bench", "plan"}


def test_accelerator_defaults_to_auto_everywhere():
    for name, sub in having("--accelerator").items():
        assert sub._option_string_actions["--accelerator"].default == "auto", name


def test_every_verb_has_a_description_examples_and_shows_its_defaults():
    for name, sub in VERBS.items():
        if " " in name:  # ckpt's actions: the verb teaches them
            continue
        assert sub.description and len(sub.description) > 80, name
        assert sub.epilog and f"dpkit {name}" in sub.epilog, name
        text = sub.format_help()
        for action in sub._actions:
            shown = action.option_strings and action.default not in (None, False) and action.help
            if shown and action.default is not __import__("argparse").SUPPRESS:
                help_text = sub._get_formatter()._expand_help(action)
                assert "default" in help_text, (name, action.option_strings)
        assert "examples:" in text


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["train", "--strategy", "nonesuch"], "--strategy"),
        (["profile", "--accelerator", "tpu"], "--accelerator"),
        (["bench", "--device-counts", "0"], "--device-counts"),
        (["plan", "--device-counts", "a"], "--device-counts"),
        (["train", "--batch-size", "0"], "--batch-size"),
        (["demo", "--batch-size-per-device", "-1"], "--batch-size-per-device"),
        (["doctor", "--nproc-per-node", "zero"], "--nproc-per-node"),
        (["launch", "--nproc-per-node", "0", "x.py"], "--nproc-per-node"),
        (["bench", "--strategies", "single,zero3"], "--strategies"),
        (["profile", "--precision", "8"], "--precision"),
    ],
)
def test_a_refused_flag_is_one_line_in_one_style(capsys, argv, flag):
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dpkit {argv[0]}: error: {flag}: "), lines


def test_plain_dpkit_lists_every_verb_and_first_steps(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in ("demo", "train", "profile", "bench", "plan", "launch", "doctor", "ckpt", "catalogue"):
        assert f"    {name}" in out
    assert "first steps:" in out


def test_docs_cli_page_shows_the_vocabulary_as_it_is():
    page = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    for flag, meaning, verbs in vocabulary_table(PARSER):
        row = f"| `{flag}` | {meaning} | {', '.join(verbs)} |"
        assert row in page, row
