"""`dpkit train` says an error once, in the flags the user gave (issue 35, item 6): a batch given per device is
named as --batch-size-per-device, never as the --batch-size derived from it, and a saved state that fails to
load under fsdp is said by rank 0 alone, not once per process."""

from __future__ import annotations

import contextlib
import io
import json

import torch

from dpkit.cli.main import main

DIGITS_ROWS = 1437  # the digits example's training rows
CPU2 = ["--accelerator", "cpu", "--devices", "2", "--no-progress"]


def refused(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_last_batch_too_small_names_the_per_device_batch_given(tmp_path, capsys):
    argv = ["train", "--strategy", "replicated", *CPU2, "--out", str(tmp_path / "run"), "--batch-size-per-device"]
    # 718 per device on 2 devices: 1436 rows a step leave a last batch of 1 of the 1437 rows
    assert refused([*argv, "718"], capsys) == (
        "dpkit train: error: --batch-size-per-device: 718 (a global batch of 1436) leaves a last batch of 1 row(s) "
        f"of the {DIGITS_ROWS} training rows, fewer than the 2 devices, so a device would sit idle in that step; "
        "give a batch per device that leaves at least 2, such as 717, or fewer devices"
    )
    assert refused([*argv, "719"], capsys) == (
        f"dpkit train: error: --batch-size-per-device: 719 (a global batch of 1438) is larger than the {DIGITS_ROWS} "
        "training rows; use at most 718"
    )
    assert not (tmp_path / "run").exists()


def test_a_resume_with_another_global_batch_names_the_per_device_batch_given(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--strategy", "replicated", *CPU2, "--out", str(out), "--checkpoint-every", "1"]
    assert main([*argv, "--steps", "1", "--batch-size", "16"]) == 0
    capsys.readouterr()
    assert refused([*argv, "--steps", "2", "--resume", "--batch-size-per-device", "4"], capsys) == (
        f"dpkit train: error: --batch-size-per-device: 4 (a global batch of 8), and the run in {str(out)!r} was "
        "trained with a global batch of 16; resume with the same global batch (--batch-size 16)"
    )
    assert main([*argv, "--steps", "2", "--resume", "--batch-size-per-device", "8"]) == 0  # 8 x 2 is its batch
    assert json.loads((out / "metrics.json").read_text())["batch_size"] == 16


def test_auto_takes_a_per_device_batch(tmp_path, monkeypatch, capsys):
    """Without --strategy, several devices choose with auto; a per-device batch is resolved before it chooses."""
    from dpkit.plan.auto import Choice
    from dpkit.recipe import recipe

    batches = []

    def choose(model, sample, batch_size, devices, **kwargs):
        batches.append(batch_size)
        return Choice("replicated", 2, "auto: replicated (as the test says)", [], "2 virtual CPU devices")

    monkeypatch.setattr(recipe, "choose_strategy", choose)
    argv = ["train", *CPU2, "--steps", "1", "--batch-size-per-device", "8", "--out", str(tmp_path / "run")]
    assert main(argv) == 0, capsys.readouterr().err
    assert batches == [16]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["batch_size"] == 16


def dpkit_said(argv: list[str]) -> tuple[int, str]:
    """`dpkit ARGV` in this process (a launched group's worker): its exit code and what it wrote to stderr."""
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        code = main(argv)
    return code, said.getvalue()


def test_an_fsdp_state_that_fails_to_load_is_said_once(tmp_path, groups):
    out = tmp_path / "run"
    argv = ["train", "--strategy", "fsdp", *CPU2, "--batch-size", "32", "--out", str(out), "--checkpoint-every", "2"]
    assert [code for code, _ in groups(2).run(dpkit_said, [*argv, "--steps", "2"])] == [0, 0]
    shards = sorted((out / "state" / "step-00000002" / "shards").glob("*.distcp"))
    assert shards, "fsdp saved no shards"
    damaged = bytearray(shards[-1].read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # one byte of one shard: every process meets it when checking the digests
    shards[-1].write_bytes(bytes(damaged))
    before = torch.load(out / "model.pt", weights_only=True)

    (code_0, said_0), (code_1, said_1) = groups(2).run(dpkit_said, [*argv, "--steps", "4", "--resume"])
    errors = [line for line in (said_0 + said_1).splitlines() if line.startswith("dpkit train: error:")]
    assert (code_0, code_1) == (2, 2) and len(errors) == 1, (said_0, said_1)
    assert errors[0] in said_0 and shards[-1].name in errors[0], errors
    after = torch.load(out / "model.pt", weights_only=True)
    assert all(torch.equal(before[key], after[key]) for key in before)  # the refused resume wrote nothing
