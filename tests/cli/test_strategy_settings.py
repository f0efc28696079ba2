"""zero's stage and hsdp's shard groups from `dpkit train` (issue 43): `--zero-stage {1,2}` and `--shard-size N`,
refused in one line with a strategy that lacks them, and named in the start line and by `dpkit ckpt inspect`."""

from __future__ import annotations

import pytest

from dpkit.cli.main import main as dpkit_main

CPU = ["--accelerator", "cpu", "--no-progress"]


@pytest.mark.parametrize(
    "flags,said",
    [
        (["--strategy", "ddp", "--devices", "2", "--zero-stage", "2"], "--zero-stage: strategy 'ddp' has no stage"),
        (["--strategy", "fsdp", "--devices", "2", "--shard-size", "1"], "--shard-size: strategy 'fsdp' has no shard"),
        (["--strategy", "hsdp", "--devices", "4", "--shard-size", "3"], "--shard-size: 3 processes per shard group"),
        (["--strategy", "zero", "--devices", "2", "--zero-stage", "3"], "--zero-stage: invalid choice: 3"),
    ],
)
def test_a_setting_the_strategy_lacks_is_refused_before_any_work(flags, said, tmp_path, capsys):
    assert dpkit_main(["train", *CPU, *flags, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert not (tmp_path / "run").exists()


def layout_and_state(strategy: str, devices: int, folder: str, options: dict) -> str:
    """In each launched process: the strategy's layout, after saving its (fresh) state into `folder`."""
    import torch
    from torch import nn

    from dpkit.engine.engine import Engine

    engine = Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False, **options)
    layer = nn.Linear(4, 2)
    engine.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    layout = engine.strategy.layout()
    engine.save_state(folder)
    engine.close()
    return layout


@pytest.mark.parametrize(
    "flags,devices,layout",
    [
        (["--strategy", "hsdp", "--shard-size", "2"], 4, "hsdp 2x2 (replicate x shard)"),
        (["--strategy", "zero", "--zero-stage", "2"], 2, "zero stage 2"),
    ],
)
def test_the_flags_reach_the_strategy_which_names_its_layout_where_the_state_keeps_it(
    flags, devices, layout, tmp_path, groups, capsys
):
    from dpkit.cli.main import build_parser
    from dpkit.cli.train import config_from_args

    argv = ["train", *CPU, "--devices", str(devices), *flags, "--out", str(tmp_path / "run")]
    args = build_parser().parse_args(argv)
    args.argv = argv
    options = config_from_args(args).strategy_options()
    folder = tmp_path / "state"
    assert groups(devices).run(layout_and_state, flags[1], devices, str(folder), options) == [layout] * devices
    capsys.readouterr()
    assert dpkit_main(["ckpt", "inspect", str(folder)]) == 0
    assert f"strategy {layout} on {devices} process(es)" in capsys.readouterr().out


def test_the_start_line_says_what_a_step_takes_under_accumulate(tmp_path, capsys):
    argv = ["train", *CPU, "--batch-size", "8", "--accumulate", "4", "--steps", "1", "--out", str(tmp_path / "run")]
    assert dpkit_main(argv) == 0
    said = capsys.readouterr()
    assert "global batch 8 x 4 micro-batches = 32 samples per step" in said.out + said.err


def test_plan_takes_the_same_settings_and_plans_those_variants_alone(tmp_path, capsys):
    import json

    plan = ["plan", "--model", "gpt2-124m", "--gpu", "h100-sxm", "--batch-size-per-device", "8", "--device-counts"]
    out = tmp_path / "plan.json"
    argv = [*plan, "1,4", "--strategies", "ddp,zero,hsdp", "--zero-stage", "2", "--shard-size", "2"]
    assert dpkit_main([*argv, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "zero stage=2             4" in table and "hsdp shard_size=2        4" in table, table
    rows = {row["strategy"]: row for row in json.loads(out.read_text())["memory_by_category"]}
    assert rows["zero"]["options"] == {"stage": 2} and rows["hsdp"]["shard_size"] == 2, rows
    assert [p["options"] for p in json.loads(out.read_text())["predictions"] if p["strategy"] == "hsdp"] == [
        {"shard_size": 2}
    ] * 2
    # without the settings: zero planned at both stages, hsdp over one node's processes (4)
    assert dpkit_main([*plan, "4", "--strategies", "zero,hsdp", "--json", str(out)]) == 0
    rows_default = json.loads(out.read_text())["memory_by_category"]
    assert [(r["strategy"], r["options"], r["shard_size"]) for r in rows_default] == [
        ("zero", {}, 4),
        ("zero", {"stage": 2}, 4),
        ("hsdp", {}, 4),
    ]
    capsys.readouterr()
    assert dpkit_main([*plan, "4", "--strategies", "ddp,fsdp", "--zero-stage", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "dpkit plan: error: --zero-stage: an option of strategy zero, which the planned strategies (ddp,fsdp) leave "
        "out; add it to --strategies or leave --zero-stage out"
    )
