"""torch.compile under the FSDP2 strategies (fsdp, zero's stage 2, hsdp): the model compiles, flat or in blocks.

Issue 41: a flat model (an nn.Sequential of layers, no unit below the root) compiled before setup or with compile=
ran eagerly under fsdp (dynamo counted no graph in 8 steps), since only the units below the root were compiled.
Each case here counts the graphs dynamo made and the calls of them, and the frames compiled after the warm-up
(none: no recompile per step), and trains as one device does. A model compiled before setup and compile= reach
the strategy the same way (take_compiled), so each strategy runs one of them on each model.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpkit.compilation import compile_counts
from dpkit.engine.engine import Engine
from dpkit.strategies import available_strategies
from dpkit.strategies.units import innermost_sharded, shard_units

# global batches: the uneven 10 rows (5 a process) recompile the forward once with torch's default dynamic=None
BATCHES = (16, 16, 10, 16, 10, 16)
WARM_UP = 3  # steps before nothing may compile again: the first uneven batch included
TOLERANCE = 1e-6  # dynamo's graphs run the same operations; FSDP2's reduce-scatter is the only reordering

# (strategy, its options, how it is compiled, model): fsdp, zero's stage 2 and hsdp each compiled both ways, each way
# on both models; hsdp on a 2-D mesh (2 replicas of shard groups of 1), where it is not fsdp's 1-D one
CASES = [
    case
    for case in (
        ("fsdp", {}, "before", "flat"),
        ("fsdp", {}, "compile=", "blocks"),
        ("zero", {"stage": 2}, "before", "blocks"),
        ("zero", {"stage": 2}, "compile=", "flat"),
        ("hsdp", {"shard_size": 1}, "before", "flat"),
        ("hsdp", {"shard_size": 1}, "compile=", "blocks"),
    )
    if case[0] in available_strategies()
]


class Blocks(nn.Module):
    """Residual blocks in a ModuleList: the default rule shards each block as a unit of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def new_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "flat":  # no module but leaf layers: the root is the only unit
        return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    return Blocks()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(n, 16, generator=generator), torch.randint(0, 4, (n,), generator=generator)) for n in BATCHES]


class CountingBackend:
    """dynamo's `eager` backend (its graphs run as captured), counting the graphs it is given and their calls."""

    def __init__(self) -> None:
        self.graphs = 0
        self.calls = 0

    def __call__(self, graph: torch.fx.GraphModule, inputs: list) -> object:
        self.graphs += 1

        def run(*args: object) -> object:
            self.calls += 1
            return graph.forward(*args)

        return run


@functools.cache  # (read only by the test)
def eager_single(kind: str) -> dict[str, torch.Tensor]:
    model = new_model(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches():
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def train_compiled(strategy: str, options: dict, how: str, kind: str) -> dict:
    """In each process of a launched group: train `kind` under `strategy`, compiled `how`; what dynamo did."""
    import torch._dynamo

    torch._dynamo.reset()
    backend = CountingBackend()
    engine = Engine(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        progress=False,
        compile={"backend": backend} if how == "compile=" else None,
        **options,
    )
    model = new_model(kind)
    given = torch.compile(model, backend=backend) if how == "before" else model
    wrapped, optimizer = engine.setup(given, torch.optim.SGD(model.parameters(), lr=0.1))
    criterion = engine.setup_criterion(nn.CrossEntropyLoss())
    data = batches()
    x, y = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    ends = torch.tensor(BATCHES).cumsum(0).tolist()
    same_batches = [list(range(end - n, end)) for n, end in zip(BATCHES, ends)]  # each process its share of each
    loader = engine.setup_dataloader(DataLoader(TensorDataset(x, y), batch_sampler=same_batches))
    start = compile_counts()
    counts, calls = [], []
    for x, y in loader:
        optimizer.zero_grad()
        engine.backward(criterion(wrapped(x), y))
        optimizer.step()
        counts.append(compile_counts().since(start))
        calls.append(backend.calls)
    state = engine.strategy.model_state(engine.strategy.model)
    found = {
        "case": (strategy, how, kind),
        "rank": engine.rank,
        "graphs_per_step": [count.graphs for count in counts],
        "frames_per_step": [count.frames for count in counts],
        "graph_calls_per_step": calls,
        "backend_graphs": backend.graphs,
        "state": None if state is None else {key: value.clone() for key, value in state.items()},
    }
    engine.close()
    torch._dynamo.reset()
    return found


def run_cases(cases: list) -> list[dict]:
    return [train_compiled(*case) for case in cases]


@pytest.mark.skipif(not CASES, reason="no FSDP2 strategy")
def test_fsdp_zero2_and_hsdp_compile_flat_and_blocked_models_once(groups):
    for results in groups(2).run(run_cases, CASES):
        for found in results:
            case, graphs, frames = found["case"], found["graphs_per_step"], found["frames_per_step"]
            summary = {key: value for key, value in found.items() if key != "state"}
            assert graphs[0] >= 1, summary  # the first step compiled the model's code
            assert frames[-1] == frames[WARM_UP - 1] and graphs[-1] == graphs[WARM_UP - 1], summary  # no recompile
            calls = found["graph_calls_per_step"]
            assert all(later > earlier for earlier, later in zip(calls, calls[1:])), summary  # compiled code ran
            if found["rank"] == 0:
                reference = eager_single(case[2])
                assert list(found["state"]) == list(reference), case  # the bare model's keys
                difference = max(float((found["state"][k] - reference[k]).abs().max()) for k in reference)
                assert difference <= TOLERANCE, (case, difference)


def test_the_innermost_sharded_modules_compile():
    """A flat model is its own only unit; a model with units compiles them, not the root that calls their hooks."""
    flat = new_model("flat")
    assert shard_units(flat) == [] and innermost_sharded(flat, []) == [flat]
    blocked = new_model("blocks")
    units = shard_units(blocked)
    assert units == list(blocked.blocks) and innermost_sharded(blocked, units) == units
    # units inside units (a units= function's): the inner ones compile, their holder calls their hooks
    inner = [block[0] for block in blocked.blocks]
    assert innermost_sharded(blocked, [*inner, *blocked.blocks, inner[0]]) == inner
