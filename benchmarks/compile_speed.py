"""What torch.compile (inductor) buys under dpkit's one-process strategies, eager against compiled, side by side.

Two models: the launch-bound example (40 residual Linear(32, 32) layers, batch 32: a step is mostly operation
launches, which a compiler that fuses operations should remove) and a compute-bound one (the wide-blocks example,
four blocks of 960-wide layers, batch 64: a step is mostly matrix multiplications, which inductor leaves to the
same BLAS). For each, on 2 virtual CPU devices, the contenders are:

    single           eager, and Engine(compile=True)
    replicated       eager; the wrapper engine.setup returns compiled after (the replicas stay eager: a noise
                     floor); and Engine(compile=True): every replica runs the model's class forward,
                     compiled once, in its own thread
    dp, dp-balanced  eager, and Engine(compile=True) as above

and, launched as 2 processes (`--per-device`, or named in --strategies), for ddp, fsdp, zero and hsdp: one
Engine(compile=True) per strategy, whose model is timed compiled and eager in turn (the compiled forwards dpkit
bound on the model or on each unit are taken off for the eager windows and put back after: the same weights,
process group and batch; per process half of the batch), rank 0 printing.

Every contender times windows of steps in turn (A B C … A B C …), so changing machine load hits them alike; the
medians over the rounds are compared. Compile time (dynamo's trace and inductor, forward and backward, read from
torch._dynamo's counters) is reported separately, with the frames compiled during the timed windows (0: no
recompiles). The machine's other load is not controlled: run it on an idle machine for the published table.

    python benchmarks/compile_speed.py                       # both models, the one-process strategies
    python benchmarks/compile_speed.py --models launch-bound --rounds 7 --steps 30 --threads 1
    python benchmarks/compile_speed.py --per-device --rounds 7   # ddp, fsdp, zero, hsdp on 2 processes
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch._dynamo
from torch import nn

from dpkit.compilation import check_cpp_compiler, compile_counts
from dpkit.engine.engine import Engine
from dpkit.examples.launch_bound import LaunchBoundMLP
from dpkit.examples.wide_blocks import WideBlocksNet

DEVICES = 2


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[], nn.Module]
    features: int
    batch_size: int
    steps: int  # per timed window


WORKLOADS = {
    "launch-bound": Workload("launch-bound", LaunchBoundMLP, 32, 32, 20),
    "compute-bound": Workload("compute-bound", WideBlocksNet, 64, 64, 4),
}


@dataclass
class Contender:
    name: str
    strategy: str
    how: str  # "eager", "compile=" (the Engine's compile=True), "after" (the wrapper compiled)
    step: Callable[[], None] | None = None
    compile_seconds: float = 0.0
    frames_while_timed: int = 0
    graphs: int = 0
    windows: list[float] = field(default_factory=list)  # seconds per step


def make_step(workload: Workload, contender: Contender) -> Callable[[], None]:
    torch.manual_seed(0)
    devices = 1 if contender.strategy == "single" else DEVICES
    engine = Engine(
        strategy=contender.strategy,
        accelerator="cpu",
        devices=devices,
        progress=False,
        compile=contender.how == "compile=",
    )
    model = workload.build()
    wrapped, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    forward = torch.compile(wrapped) if contender.how == "after" else wrapped
    criterion = engine.setup_criterion(nn.CrossEntropyLoss())
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(workload.batch_size, workload.features, generator=generator)
    y = torch.randint(0, 10, (workload.batch_size,), generator=generator)

    def step() -> None:
        optimizer.zero_grad()
        engine.backward(criterion(forward(x), y))
        optimizer.step()

    step.engine = engine  # type: ignore[attr-defined]  # kept alive with the step
    return step


def measure(workload: Workload, contenders: list[Contender], rounds: int, warm_up: int) -> None:
    for contender in contenders:
        before = compile_counts()
        contender.step = make_step(workload, contender)
        for _ in range(warm_up):  # compiles (and dp-balanced calibrates) here
            contender.step()
        compiled = compile_counts().since(before)
        contender.compile_seconds = compiled.compile_seconds
        contender.graphs = compiled.graphs
        print(
            f"  {contender.name}: warm-up done, {compiled.graphs} graphs, {compiled.compile_seconds:.1f} s compiling",
            flush=True,
        )
    for _ in range(rounds):
        for contender in contenders:
            step = contender.step
            assert step is not None
            gc.collect()
            before = compile_counts()
            began = time.perf_counter()
            for _ in range(workload.steps):
                step()
            contender.windows.append((time.perf_counter() - began) / workload.steps)
            contender.frames_while_timed += compile_counts().since(before).frames


def contenders_for(strategies: list[str]) -> list[Contender]:
    ways = {
        "single": ["eager", "compile="],
        "replicated": ["eager", "after", "compile="],
        "dp": ["eager", "compile="],
        "dp-balanced": ["eager", "compile="],
    }
    labels = {"eager": "eager", "compile=": "compiled", "after": "wrapper compiled"}
    return [Contender(f"{name} {labels[how]}", name, how) for name in strategies for how in ways[name]]


def report(workload: Workload, contenders: list[Contender]) -> None:
    print(f"\n{workload.name}: batch {workload.batch_size}, {workload.steps} steps per window, medians in ms/step")
    eager = {c.strategy: statistics.median(c.windows) for c in contenders if c.how == "eager"}
    single = eager.get("single")
    header = f"  {'contender':34} {'ms/step':>8} {'vs eager':>9} {'vs single eager':>16} {'compile s':>10}"
    print(header + f" {'graphs':>7}  frames while timed")
    for c in contenders:
        median = statistics.median(c.windows)
        versus = eager[c.strategy] / median if c.strategy in eager else float("nan")
        versus_single = single / median if single else float("nan")
        print(
            f"  {c.name:34} {median * 1e3:8.2f} {versus:8.2f}x {versus_single:15.2f}x {c.compile_seconds:10.1f} "
            f"{c.graphs:7d}  {c.frames_while_timed}"
        )


PER_DEVICE = ["ddp", "fsdp", "zero", "hsdp"]


def per_device_worker(args: argparse.Namespace) -> None:
    """In each of the 2 launched processes: per model and strategy, compiled and eager windows in turn."""
    torch.set_num_threads(1)  # two processes share the two cores
    warnings.filterwarnings("ignore")
    torch._dynamo.config.recompile_limit = 64
    for name in args.models:
        for strategy in args.strategies:
            torch._dynamo.reset()
            time_compiled_and_eager(WORKLOADS[name], strategy, args)


def time_compiled_and_eager(workload: Workload, strategy: str, args: argparse.Namespace) -> None:
    from dpkit.compilation import has_compiled_forward

    steps = args.steps or workload.steps
    engine = Engine(strategy=strategy, accelerator="cpu", devices=2, progress=False, compile=True)
    torch.manual_seed(0)
    model = workload.build()
    wrapped, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    generator = torch.Generator().manual_seed(1 + engine.rank)
    rows = workload.batch_size // 2
    x = torch.randn(rows, workload.features, generator=generator)
    y = torch.randint(0, 10, (rows,), generator=generator)

    def step() -> None:
        optimizer.zero_grad()
        engine.backward(nn.functional.cross_entropy(wrapped(x), y))
        optimizer.step()

    before = compile_counts()
    for _ in range(args.warm_up):
        step()
    compiled = compile_counts().since(before)
    # the forwards dpkit compiled (the model's, or each unit's under fsdp and hsdp), bound on their modules
    forwards = {module: module.__dict__["forward"] for module in model.modules() if has_compiled_forward(module)}

    def run_eager(eager: bool) -> None:
        for module, forward in forwards.items():
            if eager:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = forward

    run_eager(True)
    step()  # the eager path's first step, untimed
    windows: dict[str, list[float]] = {"eager": [], "compiled": []}
    frames = 0
    for round_ in range(args.rounds):
        for way in ("eager", "compiled") if round_ % 2 == 0 else ("compiled", "eager"):
            run_eager(way == "eager")
            gc.collect()
            counted = compile_counts()
            began = time.perf_counter()
            for _ in range(steps):
                step()
            windows[way].append((time.perf_counter() - began) / steps)
            frames += compile_counts().since(counted).frames
    run_eager(False)
    if engine.rank == 0:
        slow, fast = statistics.median(windows["eager"]), statistics.median(windows["compiled"])
        print(
            f"{workload.name:14} {strategy:6} eager {slow * 1e3:8.2f} ms  compiled {fast * 1e3:8.2f} ms  "
            f"{slow / fast:5.2f}x  compile {compiled.compile_seconds:5.1f} s, {compiled.graphs} graph(s) in "
            f"{len(forwards)} forward(s); frames while timed {frames}",
            flush=True,
        )
    engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(WORKLOADS), default=sorted(WORKLOADS, reverse=True))
    parser.add_argument("--strategies", nargs="+", default=["single", "replicated", "dp", "dp-balanced"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warm-up", type=int, default=6, help="untimed steps first (compiles, calibrates)")
    parser.add_argument("--steps", type=int, default=None, help="steps per timed window (default: per model)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads of this process (single's)",
    )
    parser.add_argument("--per-device", action="store_true", help="ddp, fsdp, zero and hsdp, 2 launched processes")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        per_device_worker(args)
        return
    launched = [name for name in args.strategies if name in PER_DEVICE] or (PER_DEVICE if args.per_device else [])
    if launched:
        import os

        from dpkit.launch import launch

        check_cpp_compiler({}, "cpu")
        forwarded = ["--worker", "--models", *args.models, "--strategies", *launched, "--rounds", str(args.rounds)]
        forwarded += ["--warm-up", str(args.warm_up)] + (["--steps", str(args.steps)] if args.steps else [])
        print(f"torch {torch.__version__}, 2 processes of 1 intra-op thread each (gloo)", flush=True)
        launch(os.path.abspath(__file__), forwarded, nproc_per_node=2)
        args.strategies = [name for name in args.strategies if name not in PER_DEVICE]
        if args.per_device or not args.strategies:
            return
    if args.threads:
        # on a loaded machine, OpenMP's waits between 2 threads cost single more than its second core gives
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    check_cpp_compiler({}, "cpu")  # inductor on CPU: one line now if there is no C++ compiler
    # one code object (the model's forward) collects a cache entry per contender and replica thread: room for all
    torch._dynamo.config.recompile_limit = 64
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, {DEVICES} virtual CPU devices")
    for name in args.models:
        workload = WORKLOADS[name]
        if args.steps:
            workload = Workload(workload.name, workload.build, workload.features, workload.batch_size, args.steps)
        contenders = contenders_for(args.strategies)
        print(f"\n{workload.name}: warming up (inductor compiles here)", flush=True)
        measure(workload, contenders, args.rounds, args.warm_up)
        report(workload, contenders)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
