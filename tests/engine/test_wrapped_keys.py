"""The model engine.setup returns has the user's module's state dict under every strategy in the registry.

Its keys are the bare module's (no `module.` chains), so plain `torch.save(model.state_dict())` files load into a
bare module, a bare module's state dict loads into it, and what loads reaches every copy the strategy trains: the
next step equals one device's from the loaded weights. Strategies with a process per device run `findings` in
each process of a launched group (two processes); the others run it here.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import dpkit
from closeness import difference_to_scale
from dpkit.engine.engine import Engine
from dpkit.engine.wrappers import EngineModule
from dpkit.strategies import PER_DEVICE, SHARDED, available_strategies, strategy_class

LR = 0.5
TOLERANCE = 1e-6  # of the weights' size: one step on another split of the batch rounds apart from one device's


class Net(nn.Module):
    """Two layers and a buffer that the forward uses, so a buffer that did not load changes the step."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        self.register_buffer("shift", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.shift


def made(seed: int) -> Net:
    torch.manual_seed(seed)
    net = Net()
    net.shift.fill_(0.1 * seed)
    return net


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def single_step(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference: one SGD step of a bare module on one device, from `state`."""
    net = Net()
    net.load_state_dict(state)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = batch()
    F.cross_entropy(net(x), y).backward()
    optimizer.step()
    return {key: value.detach().clone() for key, value in net.state_dict().items()}


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """As one device holds it: a shard gathered (collective: every process calls it at the same point)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


def whole_states(engine: Engine) -> list[dict[str, torch.Tensor]]:
    """The state of every copy of the model this process keeps (replicated: every replica)."""
    return [{key: whole(value) for key, value in copy.state_dict().items()} for copy, _ in engine.model_copies()]


def equal(states: list[dict[str, torch.Tensor]], expected: dict[str, torch.Tensor]) -> list[bool]:
    return [
        list(state) == list(expected) and all(torch.equal(state[k], expected[k]) for k in expected) for state in states
    ]


def findings(strategy: str, devices: int, folder: str, options: dict | None = None) -> dict:
    """What this file claims of one strategy, observed in this process, as plain data; nothing raises between the
    collectives, so a process whose claim fails never leaves the other waiting."""
    folder = Path(folder)
    engine = Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False, **(options or {}))
    model = made(1)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    criterion = engine.setup_criterion(nn.CrossEntropyLoss())
    found: dict = {"rank": engine.rank}
    state = model.state_dict()
    found["keys"] = list(state)
    found["sharded"] = [isinstance(value, DTensor) for value in state.values()]
    found["local_elements"] = [
        (value.to_local() if isinstance(value, DTensor) else value).numel() for value in state.values()
    ]
    found["state_is_the_set_up_model"] = equal([{k: whole(v) for k, v in state.items()}], made(1).state_dict())[0]

    # the wrapped model's state through a plain torch file
    mine = folder / f"wrapped-{engine.rank}.pt"
    torch.save(state, mine)
    try:
        bare = made(2)
        bare.load_state_dict(torch.load(mine, weights_only=True))
        found["bare_loads_wrapped_file"] = equal([bare.state_dict()], made(1).state_dict())[0]
    except RuntimeError as error:
        found["bare_loads_wrapped_file"] = f"refused: {error}"

    # a bare module's state through a plain torch file, into the wrapped model, then one step
    other = made(3)
    torch.save(other.state_dict(), folder / f"bare-{engine.rank}.pt")
    result = model.load_state_dict(torch.load(folder / f"bare-{engine.rank}.pt", weights_only=True))
    found["load_result"] = (list(result.missing_keys), list(result.unexpected_keys))
    found["copies_after_load"] = equal(whole_states(engine), other.state_dict())
    loader = engine.setup_dataloader(DataLoader(TensorDataset(*batch()), batch_size=8))
    for x, y in loader:
        optimizer.zero_grad()
        engine.backward(criterion(model(x), y))
        optimizer.step()
    expected = single_step(other.state_dict())
    found["step_difference"] = max(
        difference_to_scale({key: state[key] for key in expected}, expected) for state in whole_states(engine)
    )

    # the wrapped model's own file back into it (under a sharded strategy: this process's shards)
    model.load_state_dict(torch.load(mine, weights_only=True))
    found["copies_after_own_file"] = equal(whole_states(engine), made(1).state_dict())

    # strict: torch loads the keys that match, then raises for the others; every copy follows all the same
    partial = {key: value for key, value in made(4).state_dict().items() if key != "shift"}
    try:
        model.load_state_dict(partial)
        found["strict_error"] = None
    except RuntimeError as error:
        found["strict_error"] = str(error)
    found["copies_after_strict_error"] = equal(whole_states(engine), {**made(4).state_dict(), "shift": made(1).shift})
    without_shift = {key: value for key, value in made(5).state_dict().items() if key != "shift"}
    result = model.load_state_dict({**without_shift, "extra": torch.ones(1)}, strict=False)
    found["non_strict_result"] = (list(result.missing_keys), list(result.unexpected_keys))
    try:
        model.load_state_dict(made(5).state_dict(), assign=True)
        found["assign_error"] = None
    except ValueError as error:
        found["assign_error"] = str(error)
    engine.close()
    return found


def one_process_cases() -> list:
    cases = []
    for name in available_strategies():
        cls = strategy_class(name)
        if cls.traits.processes == PER_DEVICE:
            continue
        devices = 1 if cls.traits.max_devices == 1 else 2
        cases.append(pytest.param(name, devices, {}, id=name))
        if cls.profile_options():  # the layout GPUs have (replicated: a copy of the weights per device)
            cases.append(pytest.param(name, devices, cls.profile_options(), id=f"{name}-as-on-gpus"))
    return cases


def run(strategy: str, devices: int, options: dict, folder: Path, groups) -> list[dict]:
    if strategy_class(strategy).traits.processes != PER_DEVICE:
        found = findings(strategy, devices, str(folder), options)
        # an engine left in dp-balanced's calibration keeps its Observer started until it is collected; collected
        # here, where no other dispatch mode is active, it stops cleanly
        gc.collect()
        return [found]
    return groups(2).run(findings, strategy, 2, str(folder), options)


def single_step_options(name: str) -> dict:
    """Options under which one step is the single device's: localsgd and diloco meeting after every step, diloco's
    outer step the plain average."""
    options = strategy_class(name).options
    return {
        **({"sync_every": 1} if "sync_every" in options else {}),
        **({"outer_lr": 1.0, "outer_momentum": 0.0} if "outer_lr" in options else {}),
    }


PER_DEVICE_CASES = [
    pytest.param(name, 2, single_step_options(name), id=name)
    for name in available_strategies()
    if strategy_class(name).traits.processes == PER_DEVICE
]


@pytest.mark.parametrize("strategy,devices,options", one_process_cases() + PER_DEVICE_CASES)
def test_the_wrapped_model_has_the_user_modules_state_dict(strategy, devices, options, tmp_path, groups):
    keys = list(Net().state_dict())
    sharded = strategy_class(strategy).traits.weights == SHARDED  # (zero keeps whole weights, sharding the rest)
    for found in run(strategy, devices, options, tmp_path, groups):
        where = f"{strategy} rank {found['rank']}"
        assert found["keys"] == keys, where
        assert found["state_is_the_set_up_model"], where
        if sharded:
            # this process's shards of the parameters (FSDP2's own state dict); the buffer stays whole
            assert found["sharded"] == [key != "shift" for key in keys], where
            whole_elements = [value.numel() for value in Net().state_dict().values()]
            assert [n < m for n, m in zip(found["local_elements"], whole_elements)] == found["sharded"], where
            assert found["bare_loads_wrapped_file"].startswith("refused"), where  # a file of shards: engine.save
        else:
            assert not any(found["sharded"]), where
            assert found["bare_loads_wrapped_file"] is True, where
        assert found["load_result"] == ([], []), where
        assert all(found["copies_after_load"]) and found["copies_after_load"], where
        assert found["step_difference"] <= TOLERANCE, (
            f"{where}: the step after loading is off by {found['step_difference']}"
        )
        assert all(found["copies_after_own_file"]), where
        assert found["strict_error"] is not None and "shift" in found["strict_error"], where
        assert "module." not in found["strict_error"], where  # the user's keys
        assert all(found["copies_after_strict_error"]), where
        assert found["non_strict_result"] == (["shift"], ["extra"]), where
        assert found["assign_error"] is not None and found["assign_error"].startswith("assign: "), where


@pytest.mark.parametrize(
    "strategy",
    [name for name in available_strategies() if strategy_class(name).traits.processes != PER_DEVICE],
)
def test_the_user_modules_state_dict_hooks_run(strategy):
    class Renamed(Net):
        """Loads files of an older version, whose buffer was called 'offset'; saving marks its state."""

        def __init__(self) -> None:
            super().__init__()
            self.saved = 0
            self.register_state_dict_post_hook(self.count)
            self.register_load_state_dict_pre_hook(self.rename)

        @staticmethod
        def count(module, state_dict, prefix, local_metadata) -> None:
            module.saved += 1

        @staticmethod
        def rename(module, state_dict, prefix, *_) -> None:
            if prefix + "offset" in state_dict:
                state_dict[prefix + "shift"] = state_dict.pop(prefix + "offset")

    devices = 1 if strategy_class(strategy).traits.max_devices == 1 else 2
    engine = Engine(strategy=strategy, accelerator="cpu", devices=devices, progress=False)
    user = Renamed()
    model = engine.setup(user)
    model.state_dict()
    assert user.saved == 1
    old = {("offset" if key == "shift" else key): value for key, value in made(3).state_dict().items()}
    assert model.load_state_dict(old) is not None
    assert torch.equal(user.shift, made(3).shift)


def test_only_the_engine_model_changes_keys():
    """dpkit.DataParallel stays torch's drop-in: its keys carry `module.`, as nn.DataParallel's."""
    data_parallel = dpkit.DataParallel(Net(), dpkit.cpu_devices(2))
    assert list(data_parallel.state_dict()) == [f"module.{key}" for key in Net().state_dict()]
    engine = Engine(strategy="dp", accelerator="cpu", devices=2, progress=False)
    model = engine.setup(Net())
    assert list(model.state_dict()) == list(Net().state_dict())
    assert all(name.startswith("module.module.") for name, _ in model.named_parameters())  # as torch's wrappers


def test_a_wrapped_model_saved_by_name_in_a_state_loads_with_old_and_new_keys(tmp_path, monkeypatch):
    """engine.load_state(..., name=model) loads a module's saved state keyed as the module names it: a wrapped
    model's saved with the user's keys, or with the `module.module.…` keys its state_dict() had before, reaches
    every replica of the wrapped model it is given."""
    engine = Engine(strategy="single", accelerator="cpu", devices=1, progress=False)
    engine.setup(Net())
    teacher = Engine(strategy="replicated", accelerator="cpu", devices=2, progress=False).setup(made(3))
    engine.save_state(tmp_path / "new", keep=None, teacher=teacher)
    with monkeypatch.context() as patch:
        patch.setattr(EngineModule, "state_dict", nn.Module.state_dict)  # the wrapper's own keys, as before
        engine.save_state(tmp_path / "old", keep=None, teacher=teacher)
    for version, prefix in (("new", ""), ("old", "module.module.")):
        saved = torch.load(next((tmp_path / version).glob("step-*/state.pt")), weights_only=True)
        assert list(saved["extra"]["teacher"]["value"]) == [prefix + key for key in Net().state_dict()]
        student_engine = Engine(
            strategy="replicated", accelerator="cpu", devices=2, progress=False, share_weights=False
        )
        student = student_engine.setup(made(4))
        engine.load_state(tmp_path / version, teacher=student)
        assert all(equal(whole_states(student_engine), made(3).state_dict())), version


def test_dpkit_load_model_into_the_engines_model_reaches_every_replica(tmp_path):
    """dpkit.load_model(engine_model, path) loads through the wrapper: with a copy per device (replicated's GPU
    layout) every replica takes the file, not only the first."""
    import dpkit

    dpkit.save_model(made(3), tmp_path / "model.pt")
    engine = Engine(strategy="replicated", accelerator="cpu", devices=2, progress=False, share_weights=False)
    model = engine.setup(made(4))
    assert not any(equal(whole_states(engine), made(3).state_dict()))
    dpkit.load_model(model, tmp_path / "model.pt")
    assert all(equal(whole_states(engine), made(3).state_dict()))
