"""dpkit's `replicated` against a hand-written torch DDP loop and a bare one-thread loop, fresh processes each round.

The model of `make bench` (an MLP of 3 hidden layers 1536 wide, 10 classes, global batch 512, SGD), trained by

    replicated     dpkit's Engine(strategy="replicated", accelerator="cpu", devices=2), 1 intra-op thread per device
    torch DDP      DistributedDataParallel over gloo, 2 processes of 1 thread each started by torch.distributed.run
                   (a free port on loopback), each process taking half the global batch
    bare loop      the plain PyTorch loop in one process with 1 intra-op thread

Every round starts each contender in a fresh process (the order rotating from round to round, so a change in
the machine's load hits them alike); a process warms up, then times windows of steps and reports its median
samples/s. The medians over the rounds are compared: replicated / DDP (the target: >= 1.05x, as `make bench`
holds it), replicated / bare and DDP / bare.

`--dpkit-src PATH` (repeatable) adds `replicated` run from another checkout's `src` (PYTHONPATH=PATH): two commits
of dpkit paired in one run, for bisecting; `--dpkit-only` leaves out DDP and the bare loop, `--only-given-src` this
checkout's replicated (to pair two other commits).

    python benchmarks/replicated_vs_ddp.py                                   # 5 rounds
    python benchmarks/replicated_vs_ddp.py --rounds 7 --dpkit-src /tmp/wt-164b19f/src
    python benchmarks/replicated_vs_ddp.py --dpkit-only --dpkit-src /tmp/wt-164b19f/src
    python benchmarks/replicated_vs_ddp.py --dpkit-only --only-given-src --dpkit-src /tmp/a/src --dpkit-src /tmp/b/src
    python benchmarks/replicated_vs_ddp.py --contend 2 --dpkit-only --dpkit-src /tmp/old/src

`--contend N` starts N busy processes (each spinning on one core, in a session of its own, as another user's work)
while every contender warms up, and stops them before its timed windows: what a run meets when other work keeps the
cores busy while dpkit's `concurrency="auto"` decides, and the cores come free afterwards (issue 41).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEVICES = 2
THREADS = 1
REPLICATED, DDP, BARE = "replicated", "torch DDP", "bare loop"
TARGET = 1.05  # replicated / torch DDP, at least (benchmarks/strategies_throughput.py's target)


# --- inside a contender's process -----------------------------------------------------------------------------
def build(args: argparse.Namespace):
    """The model and the global batch (the same in every contender)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(args.width, 10))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, args.width, generator=generator)
    return model, x, torch.randint(0, 10, (args.batch_size,), generator=generator)


def bare_step(args: argparse.Namespace):
    import torch
    import torch.nn.functional as F

    model, x, y = build(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step, args.batch_size, None


def ddp_step(args: argparse.Namespace):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, x, y = build(args)
    model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    share = args.batch_size // world
    x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step, args.batch_size, None  # every process steps on its share of the same global batch


def replicated_step(args: argparse.Namespace):
    import torch
    import torch.nn.functional as F

    from dpkit.engine.engine import Engine

    engine = Engine(
        strategy="replicated", accelerator="cpu", devices=DEVICES, progress=False, threads_per_device=THREADS
    )
    model, x, y = build(args)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    criterion = engine.setup_criterion(F.cross_entropy)

    def step() -> None:
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        engine.backward(loss)
        optimizer.step()

    return step, args.batch_size, engine


def concurrency_choices(engine: object) -> dict[str, str | None]:
    """How each of replicated's call sites ran its replicas once decided: this dpkit's concurrency (threads or
    serial), or an older checkout's learners (apply.Turns: taking turns or side by side); {} where neither."""

    def say(policy: object) -> str | None:
        if hasattr(policy, "choice"):
            return policy.choice()
        taking = getattr(policy, "taking", None)
        return None if taking is None else ("turns" if taking else "threads")

    strategy = getattr(engine, "strategy", None)
    sites = getattr(strategy, "concurrency", None) or getattr(strategy, "turns", None) or {}
    found = {site: say(policy) for site, policy in sites.items()} if isinstance(sites, dict) else {}
    gradients = getattr(strategy, "gradients", None)
    policy = getattr(gradients, "concurrency", None) or getattr(gradients, "turns", None)
    if policy is not None:
        found["gradient sum"] = say(policy)
    return {site: way for site, way in found.items() if way is not None}


def worker(args: argparse.Namespace) -> None:
    """One contender in this process: warm up, time windows, write the windows' samples/s (rank 0)."""
    import torch

    torch.set_num_threads(THREADS)
    step, samples, engine = {"bare": bare_step, "ddp": ddp_step, "replicated": replicated_step}[args.worker](args)
    rank = int(os.environ.get("RANK", "0"))
    spin = [sys.executable, "-c", "while True: pass"]
    busy = [subprocess.Popen(spin, start_new_session=True) for _ in range(args.contend if rank == 0 else 0)]
    try:
        for _ in range(args.warmup):
            step()
    finally:
        for process in busy:
            process.kill()
            process.wait()
    if args.worker == "ddp":
        import torch.distributed as dist

        dist.barrier()
    rates, cpu_seconds = [], []
    for _ in range(args.windows):
        began, began_cpu = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            step()
        rates.append(samples * args.steps / (time.perf_counter() - began))
        cpu_seconds.append((time.process_time() - began_cpu) / args.steps)
    if rank == 0:
        where, choices = "", {}
        if args.worker == "replicated":
            import dpkit

            where, choices = str(Path(dpkit.__file__).parent.parent), concurrency_choices(engine)
        result = {"rates": rates, "cpu_seconds": cpu_seconds, "dpkit": where, "choices": choices}
        Path(args.result).write_text(json.dumps(result))
    if args.worker == "ddp":
        import torch.distributed as dist

        dist.destroy_process_group()


# --- the driver ---------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        return listener.getsockname()[1]


def shape_argv(args: argparse.Namespace) -> list[str]:
    return [
        f"--width={args.width}",
        f"--depth={args.depth}",
        f"--batch-size={args.batch_size}",
        f"--steps={args.steps}",
        f"--windows={args.windows}",
        f"--warmup={args.warmup}",
        f"--contend={args.contend}",
    ]


def run_contender(args: argparse.Namespace, kind: str, src: str | None, folder: Path) -> dict:
    """One fresh process (two for DDP) running one contender; its windows' samples/s and where dpkit came from."""
    result = folder / f"{kind}-{time.monotonic_ns()}.json"
    script = [str(Path(__file__).resolve()), *shape_argv(args), f"--worker={kind}", f"--result={result}"]
    environment = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    if src is not None:
        environment["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])
    if kind == "ddp":
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={DEVICES}",
            "--nnodes=1",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            *script,
        ]
    else:
        command = [sys.executable, *script]
    subprocess.run(command, env=environment, check=True)
    return json.loads(result.read_text())


def ratio_line(medians: dict[str, float], contender: str, reference: str, target: float | None = None) -> str:
    ratio = medians[contender] / medians[reference]
    verdict = "" if target is None else f"   target >= {target}x: {'met' if ratio >= target else 'NOT met'}"
    return f"  {contender} / {reference}: {ratio:.3f}x{verdict}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="fresh processes per contender (default 5)")
    parser.add_argument("--windows", type=int, default=3, help="timed windows per process (default 3)")
    parser.add_argument("--steps", type=int, default=10, help="steps per window (default 10)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=12,
        help="untimed steps first (default 12: dpkit's concurrency='auto' decides within its first 10 steps)",
    )
    parser.add_argument(
        "--contend", type=int, default=0, help="busy processes while each contender warms up (default 0; see above)"
    )
    parser.add_argument("--width", type=int, default=1536, help="MLP width (default 1536)")
    parser.add_argument("--depth", type=int, default=3, help="hidden layers (default 3)")
    parser.add_argument("--batch-size", type=int, default=512, help="global batch (default 512)")
    parser.add_argument(
        "--dpkit-src",
        action="append",
        default=[],
        metavar="PATH",
        help="also run replicated with dpkit from this src folder (another checkout); repeatable",
    )
    parser.add_argument("--dpkit-only", action="store_true", help="leave out torch DDP and the bare loop")
    parser.add_argument(
        "--only-given-src", action="store_true", help="leave out this checkout's replicated (only --dpkit-src's)"
    )
    parser.add_argument("--json", default=None, help="also write the rates, medians and ratios here")
    parser.add_argument("--worker", choices=["bare", "ddp", "replicated"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.dpkit_only and not args.dpkit_src:
        parser.error("--dpkit-only: pass --dpkit-src PATH too (with nothing to pair, there is nothing to compare)")
    if args.only_given_src and len(args.dpkit_src) < (2 if args.dpkit_only else 1):
        parser.error("--only-given-src: pass --dpkit-src PATH (twice with --dpkit-only: the two checkouts to pair)")

    contenders: dict[str, tuple[str, str | None]] = {} if args.only_given_src else {REPLICATED: ("replicated", None)}
    for src in args.dpkit_src:
        contenders[f"{REPLICATED} [{src}]"] = ("replicated", str(Path(src).resolve()))
    if not args.dpkit_only:
        contenders[DDP] = ("ddp", None)
        contenders[BARE] = ("bare", None)
    names = list(contenders)
    print(
        f"MLP {args.depth}x{args.width} -> 10, global batch {args.batch_size}, SGD; replicated on {DEVICES} "
        f"virtual CPU devices x {THREADS} intra-op thread, torch DDP on {DEVICES} gloo processes x {THREADS} thread, "
        f"the bare loop on {THREADS} thread; {args.rounds} rounds of fresh processes, each {args.warmup} "
        f"warm-up steps{f' beside {args.contend} busy processes' if args.contend else ''} then the median of "
        f"{args.windows} windows x {args.steps} steps",
        flush=True,
    )
    load_before = os.getloadavg()
    rates: dict[str, list[float]] = {name: [] for name in names}
    cpu_ms: dict[str, list[float]] = {name: [] for name in names}  # CPU of the (rank 0) process per step
    sources: dict[str, str] = {}
    choices: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            line = []
            for name in order:
                kind, src = contenders[name]
                result = run_contender(args, kind, src, Path(folder))
                rates[name].append(statistics.median(result["rates"]))
                cpu_ms[name].append(1e3 * statistics.median(result["cpu_seconds"]))
                if result["dpkit"]:
                    sources[name] = result["dpkit"]
                choices[name].append(result.get("choices", {}))
                line.append(f"{name} {rates[name][-1]:.0f}")
            print(f"round {round_ + 1}: " + ", ".join(line) + " samples/s", flush=True)
    load_after = os.getloadavg()

    medians = {name: statistics.median(values) for name, values in rates.items()}
    print(
        f"\nload average (1, 5, 15 min) before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
        f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; {os.cpu_count()} CPUs"
    )
    print(f"{'contender':40s} {'median samples/s':>17s} {'ms/step':>8s} {'min':>7s} {'max':>7s} {'CPU ms/step':>12s}")
    for name in names:
        print(
            f"{name:40s} {medians[name]:17.0f} {1e3 * args.batch_size / medians[name]:8.1f} "
            f"{min(rates[name]):7.0f} {max(rates[name]):7.0f} {statistics.median(cpu_ms[name]):12.1f}"
        )
    print("  (CPU ms/step: the process's CPU time per step, all its threads; for DDP rank 0's process)")
    for name, where in sources.items():
        ways = "; ".join(", ".join(f"{site} {way}" for site, way in made.items()) or "-" for made in choices[name])
        print(f"  {name}: dpkit from {where}; each round's concurrency: {ways}")
    print("ratios of median throughputs (higher: the first is faster):")
    replicas = [name for name in names if contenders[name][0] == "replicated"]
    for name in replicas:
        if DDP in medians:
            print(ratio_line(medians, name, DDP, TARGET))
            print(ratio_line(medians, name, BARE))
    if DDP in medians:
        print(ratio_line(medians, DDP, BARE))
    for other in replicas[1:]:
        print(ratio_line(medians, replicas[0], other))
    if args.json:
        report = {
            "rates": rates,
            "cpu_ms_per_step": cpu_ms,
            "medians": medians,
            "sources": sources,
            "config": vars(args),
        }
        report["load_average"] = [load_before, load_after]
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
