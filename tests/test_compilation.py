"""torch.compile with dpkit: the `compile` argument's checks, the C++ compiler check, clean keys, dynamo's counters,
and every strategy compiling the model's forward (Engine(compile=...), or a model compiled before engine.setup):
compiled graphs run (in the replicas' threads where there are replicas), nothing recompiles after the warm-up,
checkpoints keep the model's keys and resume across compiled and eager runs (docs/compile.md).

Equality with one device: every run below trains the same model on the same batches (an uneven last one
included) and its weights equal eager single-device training within TOLERANCE. The backends here are "eager"
and "aot_eager" (dynamo's capture, and AOTAutograd's for aot_eager, without generating code), so the tests
take seconds; inductor (measured once: the same 2.98e-08 on this model) and its speed are in
benchmarks/compile_speed.py and docs/compile.md.
"""

from __future__ import annotations

import collections
import functools
import gc
import logging
import shutil
import threading
import time

import pytest
import torch
from torch import nn

from closeness import difference_to_scale
from dpkit.compilation import (
    check_compile,
    check_cpp_compiler,
    compile_counts,
    compile_option_names,
    compiled_submodules,
    describe_compile,
    is_compiled,
    uncompiled,
    without_compiled_prefixes,
)
from dpkit.engine.engine import Engine
from dpkit.strategies import PER_DEVICE, SHARDED, available_strategies, strategy_class

# eager and aot_eager run the same aten operations as eager PyTorch; the replicas' gradient sum is the only
# reordering (measured: at most 2.98e-08 after 4 steps under every strategy); differences relative to the largest
# weight (tests/closeness.py)
TOLERANCE = 1e-6
# bf16-mixed, one optimizer step of 2 micro-batches: measured at most 8.5e-05 against single (bf16 activations of half
# the rows each), exactly what the same strategy gives eagerly (0.0): compiling with aot_eager adds nothing
BF16_TOLERANCE = 1e-3
# uneven batches (10 rows: 5 per device) inside the warm-up and after it
BATCHES = (16, 16, 10, 16, 16, 10, 16, 16, 10)
# steps before the counts must stay still: under dp and dp-balanced a replica's input is a view of the batch (scatter's
# chunk), and dynamo, dynamic=True or not, recompiles the forward once at the first uneven batch (its size was
# specialized) and once for a new storage offset
WARM_UP = 6


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test counts its own compiles: dynamo's caches and counters are process-wide."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Net(nn.Module):
    """Small and launch-bound: a loop over residual layers, as the launch-bound example."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        return self.head(x)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 8, generator=generator), torch.randint(0, 4, (n,), generator=generator)) for n in BATCHES]


def new_net() -> Net:
    torch.manual_seed(0)
    return Net()


@functools.cache  # (read only by the tests)
def eager_single() -> dict[str, torch.Tensor]:
    model = new_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches():
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


class GraphCalls:
    """A backend (torch's `backend`, inside) that counts the compiled graphs run, by thread: whether replicas
    running in dpkit's worker threads run compiled code or fall back to eager."""

    def __init__(self, backend: str = "eager"):
        self.backend = backend
        self.by_thread: collections.Counter[str] = collections.Counter()

    def __call__(self, graph: torch.fx.GraphModule, inputs: list) -> object:
        from torch._dynamo.backends.registry import lookup_backend

        compiled = lookup_backend(self.backend)(graph, inputs)

        def run(*args: object) -> object:
            self.by_thread[threading.current_thread().name] += 1
            return compiled(*args)

        return run

    def in_workers(self) -> int:
        return sum(count for thread, count in self.by_thread.items() if thread != "MainThread")


# --- the compile argument --------------------------------------------------------------------------------
def test_check_compile_accepts_true_false_and_torch_compiles_options():
    assert check_compile(None) is None and check_compile(False) is None
    assert check_compile(True) == {}
    options = {"backend": "aot_eager", "dynamic": True, "fullgraph": False, "mode": None}
    assert check_compile(options) == options and check_compile(options) is not options
    assert {"backend", "dynamic", "mode", "options", "fullgraph"} <= set(compile_option_names())


@pytest.mark.parametrize(
    "value,kind,words",
    [
        ("yes", TypeError, ["compile:", "'yes'", "True, False or a dict"]),
        ({"backnd": "eager"}, ValueError, ["compile:", "'backnd'", "accepted:", "backend"]),
        ({"backend": "no-such"}, ValueError, ["compile:", "'no-such'", "inductor"]),
        ({"mode": "fast"}, ValueError, ["compile:", "'fast'", "'max-autotune'"]),
        ({"mode": "max-autotune", "options": {"max_autotune": True}}, ValueError, ["compile:", "one of them"]),
        ({"dynamic": "yes"}, ValueError, ["compile:", "'dynamic'", "'yes'"]),
        ({"options": ["max_autotune"]}, TypeError, ["compile:", "'options'"]),
    ],
)
def test_check_compile_refuses_in_one_line(value, kind, words):
    with pytest.raises(kind) as caught:
        check_compile(value)
    message = str(caught.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_describe_compile_gives_plain_values_for_the_record():
    def my_backend(graph, inputs):
        return graph

    assert describe_compile(None) is None
    assert describe_compile({"backend": my_backend, "dynamic": True, "options": {"trace.enabled": False}}) == {
        "backend": "test_describe_compile_gives_plain_values_for_the_record.<locals>.my_backend",
        "dynamic": True,
        "options": {"trace.enabled": False},
    }


def test_a_cpp_compiler_is_looked_for_only_for_inductor_on_cpu(monkeypatch):
    assert check_cpp_compiler(None, "cpu") is None  # eager
    assert check_cpp_compiler({"backend": "aot_eager"}, "cpu") is None
    assert check_cpp_compiler({}, "cuda") is None  # inductor writes Triton on GPUs
    if shutil.which("g++") is not None:
        assert check_cpp_compiler({}, "cpu") is not None
    from torch._inductor import config

    monkeypatch.setattr(config.cpp, "cxx", ("dpkit-no-such-compiler",))
    with pytest.raises(RuntimeError) as caught:
        check_cpp_compiler({"backend": "inductor"}, "cpu")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("compile: ") and "dpkit-no-such-compiler" in message and "aot_eager" in message


# --- compiled modules and their keys -------------------------------------------------------------------
def test_compiled_modules_unwrap_and_their_keys_load_into_the_bare_model():
    model = new_net()
    whole = torch.compile(model, backend="eager")
    assert is_compiled(whole) and not is_compiled(model)
    assert uncompiled(whole) is model and uncompiled(model) is model
    assert all(key.startswith("_orig_mod.") for key in whole.state_dict())
    # a block compiled on its own (torchtitan's way) puts the prefix inside the keys
    blocks = new_net()
    blocks.layers[1] = torch.compile(blocks.layers[1], backend="eager")
    blocks.head.compile(backend="eager")  # in place: no prefix
    assert compiled_submodules(blocks) == ["layers.1", "head"]
    keys = list(blocks.state_dict())
    assert "layers.1._orig_mod.weight" in keys and "head.weight" in keys
    bare = Net()
    assert bare.load_state_dict(without_compiled_prefixes(blocks.state_dict())) is not None
    assert bare.load_state_dict(without_compiled_prefixes(whole.state_dict())) is not None
    assert torch.equal(bare.embed.weight, model.embed.weight)
    with pytest.raises(ValueError, match="both become 'embed.weight'"):
        without_compiled_prefixes({"embed.weight": 1, "_orig_mod.embed.weight": 2})


# --- dynamo's counters -----------------------------------------------------------------------------------
def test_compile_counts_see_compiles_recompiles_and_graph_breaks():
    import torch._dynamo

    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def with_break(x: torch.Tensor) -> torch.Tensor:
        x = x + 1
        torch._dynamo.graph_break()
        return x * 3

    start = compile_counts()
    compiled = torch.compile(twice, backend="eager")
    compiled(torch.randn(4))
    first = compile_counts().since(start)
    assert (first.frames, first.graphs, first.graph_breaks) == (1, 1, 0)
    assert first.compile_seconds > 0
    warm = compile_counts()
    compiled(torch.randn(4))
    assert compile_counts().since(warm).frames == 0  # same shape: the cached code runs
    compiled(torch.randn(5))
    assert compile_counts().since(warm).frames == 1  # a new shape: one recompile (dynamic from now on)
    compiled(torch.randn(6))
    assert compile_counts().since(warm).frames == 1
    before_break = compile_counts()
    torch.compile(with_break, backend="eager")(torch.randn(3))
    broken = compile_counts().since(before_break)
    assert broken.graphs == 2 and broken.graph_breaks == 1
    assert broken.break_reasons and broken.break_reasons[0][1] == 1
    assert broken.as_dict()["graph_breaks"] == 1


# --- every strategy, compiled by the Engine ----------------------------------------------------------------
class _Said(logging.Handler):
    """The warnings dpkit's logger gave."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def train(
    strategy: str,
    how: str,
    backend: object,
    devices: int,
    *,
    accumulate: int = 1,
    precision: str = "32",
    steps: int | None = None,
) -> dict:
    """Train BATCHES (the first `steps` of them) under `strategy`, compiled `how`: "compile=" (the Engine's option),
    "before" (torch.compile(model) given to engine.setup), "after" (the wrapper engine.setup returns) or "eager";
    dynamic=True, so that the batch dimension is symbolic from the first compile (no padding)."""
    options = {"backend": backend, "dynamic": True}
    engine = Engine(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        progress=False,
        accumulate=accumulate,
        precision=precision,
        compile=options if how == "compile=" else None,
    )
    model: nn.Module = new_net()
    if how == "before":
        model = torch.compile(model, **options)
    wrapped, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    forward = torch.compile(wrapped, **options) if how == "after" else wrapped
    criterion = engine.setup_criterion(nn.CrossEntropyLoss())
    data = batches()[:steps]
    if engine.strategy.traits.processes == PER_DEVICE:
        from torch.utils.data import DataLoader, TensorDataset

        x, y = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
        ends = torch.tensor(BATCHES[: len(data)]).cumsum(0).tolist()
        same_batches = [list(range(end - n, end)) for n, end in zip(BATCHES, ends)]
        # the same global batches, each process its share of each
        data = engine.setup_dataloader(DataLoader(TensorDataset(x, y), batch_sampler=same_batches))
    counts, start = [], compile_counts()  # (dynamo's counters outlive torch._dynamo.reset(): read from here)
    said = _Said()
    logging.getLogger("dpkit").addHandler(said)
    try:
        for x, y in data:
            optimizer.zero_grad()
            engine.backward(criterion(forward(x), y))
            optimizer.step()
            counts.append(compile_counts())
    finally:
        logging.getLogger("dpkit").removeHandler(said)
    from dpkit.checkpoint.model_files import unwrap_model

    state = engine.strategy.model_state(unwrap_model(wrapped))
    found = {
        "rank": engine.rank,
        "after_warm_up": counts[-1].since(counts[min(WARM_UP, len(counts)) - 1]),
        "total": counts[-1].since(start),
        "sharded": engine.strategy.traits.weights == SHARDED,
        "warnings": said.lines,
        "per_step_frames": [count.frames for count in counts],
        "keys": list(wrapped.state_dict()),
        "state": None if state is None else dict(state),
    }
    del engine, wrapped, optimizer, forward
    gc.collect()  # dp-balanced's calibration observer stops here, with no other dispatch mode active
    return found


def max_difference(state: dict, reference: dict) -> float:
    """Over the reference's keys, relative to its largest value (tests/closeness.py)."""
    return difference_to_scale({key: state[key] for key in reference}, reference)


IN_PROCESS = [name for name in available_strategies() if strategy_class(name).traits.processes != PER_DEVICE]
REPLICATING = [name for name in IN_PROCESS if strategy_class(name).traits.threads_per_step]


def devices_for(strategy: str) -> int:
    return 1 if strategy_class(strategy).traits.max_devices == 1 else 2


@pytest.mark.parametrize("how", ["compile=", "before", "after"])
@pytest.mark.parametrize("strategy", IN_PROCESS)
def test_every_strategy_runs_the_compiled_forward_and_trains_as_eager_single(strategy, how, caplog):
    """Compiled by Engine(compile=), before engine.setup, or after it (torch.compile of the wrapper setup returns:
    dynamo compiles dpkit's glue around the forward; replicas run in worker threads run eager, and it says so)."""
    reference = eager_single()
    backend = GraphCalls("eager")  # dynamo's graphs run as they are: AOTAutograd is tested with bf16 below
    found = train(strategy, how, backend, devices_for(strategy))
    assert max_difference(found["state"], reference) <= TOLERANCE
    assert not [key for key in found["keys"] if "_orig_mod" in key]  # checkpoints keep the model's own keys
    # after the warm-up (an uneven batch included) nothing compiles again, with uneven batches after it too
    assert found["after_warm_up"].frames == 0, found["after_warm_up"]
    said = [r.getMessage() for r in caplog.records if "replicas run in worker threads" in r.getMessage()]
    if how == "after" and strategy in REPLICATING:
        assert len(said) == 1 and f"strategy '{strategy}'" in said[0] and "Engine(compile=True)" in said[0], said
        return
    assert not said
    assert sum(backend.by_thread.values()) >= len(BATCHES)  # compiled graphs ran, not an eager fallback
    if strategy in REPLICATING:
        assert backend.in_workers() > 0, dict(backend.by_thread)  # and the replicas ran them in their threads


@pytest.mark.parametrize("strategy", REPLICATING)
def test_with_accumulation_and_bf16_mixed_the_compiled_replicas_train_as_eager_single(strategy):
    reference = train("single", "eager", None, 1, accumulate=2, precision="bf16-mixed", steps=2)["state"]
    found = train(strategy, "compile=", "aot_eager", 2, accumulate=2, precision="bf16-mixed", steps=2)
    eager = train(strategy, "eager", None, 2, accumulate=2, precision="bf16-mixed", steps=2)
    # bf16 activations on half the rows each: the same products, the replicas' gradient sum reordered in float32
    assert max_difference(found["state"], reference) <= BF16_TOLERANCE
    assert max_difference(found["state"], eager["state"]) <= TOLERANCE  # compiling itself changes nothing


def test_a_replica_runs_its_own_weights_through_the_shared_compiled_forward():
    from dpkit.compilation import compile_forward, has_compiled_forward
    from dpkit.parallel.replicate import replicate

    model = new_net()
    compile_forward(model, lambda function: torch.compile(function, backend="eager", dynamic=True))
    assert has_compiled_forward(model) and "forward" not in model.state_dict()
    replica = replicate(model, ["cpu:0", "cpu:1"])[1]
    with torch.no_grad():
        for parameter in replica.parameters():
            parameter.mul_(0.0)  # the replica's copies, not the model's
    x = torch.randn(3, 8)
    assert torch.equal(replica(x), replica.head.bias.expand(3, 4))  # zero weights: the head's (zero) bias
    assert not torch.equal(model(x), replica(x))
    # the replicas DataParallel keeps between calls (parallel/replica_cache.py) are bound to themselves too
    from dpkit.parallel.replica_cache import ReplicaCache

    cache = ReplicaCache(model)
    assert cache.acquire()
    try:
        devices = [torch.device("cpu", 0), torch.device("cpu", 1)]
        cached = cache.replicas(devices, devices[0])
        assert [replica.forward.__self__ for replica in cached] == cached
    finally:
        cache.release()


def test_the_engine_checks_compile_before_any_work_and_refuses_two_compiles():
    with pytest.raises(TypeError, match="^compile: expected True, False or a dict"):
        Engine(strategy="ddp", accelerator="cpu", devices=2, compile="inductor")  # before a process group
    engine = Engine(strategy="single", accelerator="cpu", devices=1, progress=False, compile={"backend": "eager"})
    compiled = torch.compile(new_net(), backend="eager")
    with pytest.raises(ValueError, match="^model: is compiled already .* and compile= was given; pass one"):
        engine.setup(compiled)
    in_place = new_net()
    in_place.compile(backend="eager")
    with pytest.raises(ValueError, match="^model: was compiled in place"):
        engine.setup(in_place)


def test_a_model_compiled_in_place_keeps_its_options():
    from dpkit.compilation import take_compiled

    model = new_net()
    model.compile(backend="eager", dynamic=True)
    bare, compile_fn = take_compiled(model, None)
    assert bare is model and "_compiled_call_impl" not in model.__dict__
    assert compile_fn is not None and compile_fn is not torch.compile  # the context model.compile made


# --- resume across compiled and eager runs ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "first,second", [("compile=", "eager"), ("eager", "compile=")], ids=["compiled-eager", "eager-compiled"]
)
def test_a_state_saved_compiled_resumes_eager_and_back(tmp_path, first, second):
    reference = eager_single()
    data = batches()
    halves = (data[:5], data[5:])
    state = None
    for how, part in zip((first, second), halves):
        torch._dynamo.reset()
        engine = Engine(
            strategy="replicated",
            accelerator="cpu",
            devices=2,
            progress=False,
            compile={"backend": "eager", "dynamic": True} if how == "compile=" else None,
        )
        model = new_net() if state is None else Net()
        wrapped, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        criterion = engine.setup_criterion(nn.CrossEntropyLoss())
        if state is not None:
            engine.load_state(tmp_path)
        for x, y in part:
            optimizer.zero_grad()
            engine.backward(criterion(wrapped(x), y))
            optimizer.step()
        state = engine.save_state(tmp_path)
        saved = torch.load(state / "state.pt", weights_only=False)["model"]
        assert list(saved) == list(Net().state_dict())  # the model's own keys, no "_orig_mod."
        final = {key: value.clone() for key, value in wrapped.state_dict().items()}
        del engine, wrapped, optimizer
        gc.collect()
    assert max_difference(final, reference) <= TOLERANCE


# --- the launched strategies, in one group run ----------------------------------------------------------------
# A model compiled before setup reaches the strategy as compile= does (take_compiled unwraps it, keeping its options,
# whatever the strategy: tested in process above and here under ddp and fsdp), so zero runs compile= and the wrapper
# compiled after setup; each case compiles afresh (about a second of the suite's time a case). hsdp is fsdp's code on a
# mesh: tests/strategies/test_compile_sharded.py compiles it on its 2-D mesh, both ways.
LAUNCHED_CASES = [
    (strategy, how)
    for strategy, how in (
        ("ddp", "compile="),
        ("ddp", "before"),
        ("ddp", "after"),
        ("fsdp", "compile="),
        ("fsdp", "before"),
        ("fsdp", "after"),
        ("zero", "compile="),
        ("zero", "after"),
    )
    if strategy in available_strategies()
]


def launched_job(cases: list[tuple[str, str]]) -> list[dict]:
    """In each process of a launched group: train under ddp and fsdp, compiled `how`."""
    import torch._dynamo

    results = []
    for strategy, how in cases:
        torch._dynamo.reset()
        start = time.perf_counter()
        try:
            found = train(strategy, how, "eager", 2)  # (AOTAutograd is tested in one process, with bf16)
        finally:
            torch._dynamo.reset()
        results.append(
            {
                "case": (strategy, how),
                "seconds": time.perf_counter() - start,
                "rank": found["rank"],
                "frames_after_warm_up": found["after_warm_up"].frames,
                "graphs": found["total"].graphs,
                "sharded": found["sharded"],
                "warnings": found["warnings"],
                "per_step_frames": found["per_step_frames"],
                "keys": found["keys"],
                "state": found["state"],
            }
        )
    return results


@pytest.mark.skipif(not LAUNCHED_CASES, reason="no launched strategy")
def test_launched_strategies_compiled_train_as_eager_single(groups):
    """ddp compiles the model's forward; fsdp each innermost sharded module's (after fully_shard); the wrapper
    compiled after setup under a sharded strategy compiles nothing, and says so."""
    reference = eager_single()
    by_rank = groups(2).run(launched_job, LAUNCHED_CASES)
    for results in by_rank:
        for found in results:
            case = found["case"]
            if found["rank"] == 0:
                assert max_difference(found["state"], reference) <= TOLERANCE, case
            assert not [key for key in found["keys"] if "_orig_mod" in key], case
            assert found["frames_after_warm_up"] == 0, {k: v for k, v in found.items() if k != "state"}
            if case[1] == "after" and found["sharded"]:
                # FSDP2's hooks around the root: dynamo skips the model's forward, and the run says so once
                assert found["graphs"] == 0, (case, found["per_step_frames"])
                assert [line for line in found["warnings"] if "runs eager" in line], (case, found["warnings"])
            else:
                assert found["graphs"] >= 1, (case, found["per_step_frames"])  # compiled code ran


# --- the command line and the profile -------------------------------------------------------------------------
def test_dpkit_train_compile_gives_the_engines_compile_argument():
    from dpkit.cli.main import build_parser
    from dpkit.cli.train import config_from_args

    def config(*flags: str):
        argv = ["train", "--accelerator", "cpu", "--devices", "2", *flags]
        args = build_parser().parse_args(argv)
        args.argv = argv
        return config_from_args(args)

    assert config().compile is None
    assert config("--compile").compile is True
    assert config("--compile", "aot_eager", "--steps", "3").compile == {"backend": "aot_eager"}
    assert check_compile(config("--compile", "aot_eager").compile) == {"backend": "aot_eager"}


def test_the_profile_line_says_graphs_breaks_seconds_and_recompiles():
    from dpkit.tools.profile import compile_line

    compiled = {
        "options": {"backend": "inductor"},
        "warm_up": {"graphs": 3, "graph_breaks": 2, "break_reasons": {"Tensor.item": 2}, "compile_seconds": 12.34},
        "recompiles_after_warm_up": 0,
    }
    line = compile_line(compiled, warmup=3)
    assert line.startswith("compile: 3 graph(s), 2 graph break(s) (2x Tensor.item), 12.3 s compiling in the 3 ")
    assert line.endswith("0 recompile(s) after")
    assert "first observed step includes the compile" in compile_line(compiled, warmup=0)
