"""find_unused_parameters and static_graph (issue 32): which strategies take them, what bad values say, and
`dpkit train --find-unused-parameters / --static-graph` on a model with a layer no step uses. The matrix's
cells (a parameter used every other step, against one device) are in test_model_matrix_per_device.py."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch import nn

from dpkit.cli.main import build_parser, main
from dpkit.cli.train import config_from_args
from dpkit.recipe.config import TrainConfig
from dpkit.strategies import create_strategy, strategy_class, strategy_traits

PER_DEVICE = ["ddp", "fsdp", "zero", "hsdp"]


class DigitsWithAnUnusedHead(nn.Module):
    """The digits MLP with a second head that forward never calls (a head of another task)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
        self.head = nn.Linear(32, 10)
        self.other_head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


def digits_with_an_unused_head() -> nn.Module:
    return DigitsWithAnUnusedHead()


@pytest.mark.parametrize("name", PER_DEVICE)
def test_every_per_device_strategy_takes_find_unused_parameters(name):
    assert "find_unused_parameters" in strategy_class(name).options
    assert ("static_graph" in strategy_class(name).options) == (name == "ddp")


def test_static_graph_is_ddps_alone():
    with pytest.raises(TypeError, match=r"^static_graph: not an option of strategy 'fsdp' \(its options: "):
        strategy_traits("fsdp", static_graph=True)


@pytest.mark.parametrize(
    "name,option,value,message",
    [
        ("ddp", "find_unused_parameters", "yes", "find_unused_parameters: expected True .* or False, got 'yes'"),
        ("fsdp", "find_unused_parameters", 1, "find_unused_parameters: expected True .* or False, got 1"),
        ("ddp", "static_graph", None, "static_graph: expected True .* or False, got None"),
    ],
)
def test_a_value_not_a_bool_is_named(name, option, value, message):
    with pytest.raises(TypeError, match=f"^{message}$"):
        create_strategy(name, [torch.device("cpu", 0), torch.device("cpu", 1)], **{option: value})


def parsed(*flags: str) -> TrainConfig:
    argv = ["train", "--accelerator", "cpu", *flags]
    args = build_parser().parse_args(argv)
    args.argv = argv  # what main gives the verb: its command line, for relaunching
    return config_from_args(args)


def test_the_flags_reach_the_strategy_that_takes_them():
    ddp = parsed("--strategy", "ddp", "--devices", "2", "--find-unused-parameters", "--static-graph")
    assert ddp.strategy_options() == {"find_unused_parameters": True, "static_graph": True}
    # the single-process strategies handle unused parameters with no option: the flag changes nothing there
    assert parsed("--strategy", "dp", "--devices", "2", "--find-unused-parameters").strategy_options() == {}
    assert parsed("--strategy", "ddp", "--devices", "2").strategy_options() == {}


def test_static_graph_under_another_strategy_is_refused_in_flags(tmp_path, capsys):
    argv = ["train", "--strategy", "fsdp", "--accelerator", "cpu", "--devices", "2", "--static-graph"]
    assert main([*argv, "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("dpkit train: error: --static-graph: not an option of strategy 'fsdp'"), err


def dpkit_said(argv: list[str]) -> tuple[int, str]:
    """`dpkit ARGV` in this process (a launched group's worker): its exit code and what it wrote to stderr."""
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        code = main(argv)
    return code, said.getvalue()


def test_dpkit_train_with_an_unused_layer_under_ddp(tmp_path, groups):
    """Without the flag every process stops at the first step with one line naming the layer and the flag;
    with --find-unused-parameters, or --static-graph (the layer is unused in every step), it trains."""
    argv = ["train", "--model", f"{__name__}:digits_with_an_unused_head", "--strategy", "ddp"]
    argv += ["--accelerator", "cpu", "--devices", "2", "--steps", "2", "--batch-size", "32", "--no-progress"]
    stopped = groups(2).run(dpkit_said, [*argv, "--out", str(tmp_path / "stopped")])
    for code, said in stopped:
        assert code == 2, said
        assert said.strip().splitlines()[-1] == (
            "dpkit train: error: --find-unused-parameters: parameters other_head.weight, other_head.bias got no "
            "gradient this step (before the optimizer stepped, the weights are unchanged); pass "
            "--find-unused-parameters, or freeze them (requires_grad_(False)) before engine.setup"
        ), said
    assert not (tmp_path / "stopped" / "model.pt").exists()
    for flag in ("--find-unused-parameters", "--static-graph"):
        out = tmp_path / flag.strip("-")
        assert [code for code, _ in groups(2).run(dpkit_said, [*argv, flag, "--out", str(out)])] == [0, 0]
        state = torch.load(out / "model.pt", weights_only=True)
        assert set(state) == {f"{layer}.{p}" for layer in ("trunk.0", "head", "other_head") for p in ("weight", "bias")}


def test_the_line_names_the_first_three_and_counts_the_rest():
    from dpkit.strategies.ddp import DDP

    ddp = DDP.__new__(DDP)  # the check alone, without processes
    ddp._trainable = {f"layer{i}.weight": nn.Parameter(torch.zeros(1)) for i in range(5)}
    ddp._got_gradient = {"layer0.weight"}
    with pytest.raises(ValueError, match=r"^find_unused_parameters: parameters layer1\.weight, layer2\.weight, "
                       r"layer3\.weight and 1 more got no gradient this step \(before"):  # fmt: skip
        ddp._check_every_parameter_got_gradient()
    ddp._got_gradient = set(ddp._trainable)
    ddp._check_every_parameter_got_gradient()  # every one got a gradient: nothing to say
