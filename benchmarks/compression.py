"""ddp's gradient compression on a slow link: 2 processes over a network namespace's loopback shaped with `tc`.

Loopback is far faster than the links where compression matters, so each link but the first is a real slow one:
a network namespace of its own whose loopback goes through a token bucket filter,

    ip netns add N; ip netns exec N ip link set lo up
    ip netns exec N tc qdisc add dev lo root tbf rate 1gbit burst 1mb latency 100ms

(the burst must exceed lo's 64 KiB MTU: with `burst 64kb` gloo's reads time out). Both processes' traffic crosses
the one shaped device, so the rate is shared by the two directions. The links: plain loopback, 1 Gbit/s and
100 Mbit/s. On each, `dpkit launch` starts 2 processes inside the namespace, which train a model whose gradients
are 33.7 MB (two 2048 x 2048 Linear layers and a 10-class head; 16 rows per process, SGD: little compute, so the
link decides) in rounds; each round runs every contender in turn, the order rotating from round to round:

    compute only    the same step in both processes without any exchange (plain torch): the step's computing
    none            dpkit's ddp, gradients all-reduced in float32
    bf16            compress="bf16": gradients cross in 16 bits
    powersgd:1/:4   compress="powersgd:R": rank-R factors, from the first step (compress_warmup_steps=0)

Each contender builds its Engine, takes one untimed step, then times --steps steps; the median over all its
timed steps is quoted, beside the bytes of gradient communication per step from the collective record
(`RECORD.gradient_bytes`, what `dpkit profile --json` reports as gradient_bytes_per_step), the ratios against
none, and the planner's prediction for the same link: `dpkit plan --strategy ddp --compress KIND` calibrated with
a `dpkit bench` of the compute (one device, plain loopback: no exchange in it) and a `dpkit doctor` all-reduce
measured inside the same namespace.

Making a namespace needs root and the `ip` and `tc` commands; without them the benchmark says so in one line and
measures plain loopback only. It removes its namespaces when it ends, Ctrl-C or SIGTERM included.

    sudo .venv/bin/python benchmarks/compression.py                      # 3 links, 5 rounds of 3 steps
    .venv/bin/python benchmarks/compression.py --links loopback --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

WIDTH = 2048
CLASSES = 10
BATCH_SIZE = 32  # global: 16 rows per process
PROCESSES = 2
COMPUTE_ONLY = "compute only"
COMPRESSIONS = ("none", "bf16", "powersgd:1", "powersgd:4")
LINK_RATES = {"loopback": None, "1gbit": "1gbit", "100mbit": "100mbit"}  # name: tc's rate (None: unshaped)
LINK_WORDS = {"loopback": "plain loopback", "1gbit": "1 Gbit/s", "100mbit": "100 Mbit/s"}
HERE = Path(__file__).resolve().parent


def wide_model():
    """The benchmark's model (also `dpkit plan --model compression:wide_model` and `dpkit bench`'s): 33.7 MB of
    float32 gradients, 16.8 MFLOP forward per row."""
    from torch import nn

    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, CLASSES)
    )


def gradient_bytes() -> int:
    """The model's float32 gradients, in bytes: what an uncompressed exchange sends per step."""
    return sum(parameter.numel() * 4 for parameter in wide_model().parameters())


# --- inside the launched processes ------------------------------------------------------------------------------
def process_batch(rank: int):
    """This process's rows of the synthetic global batch."""
    import torch

    generator = torch.Generator().manual_seed(rank)
    rows = BATCH_SIZE // PROCESSES
    return torch.randn(rows, WIDTH, generator=generator), torch.randint(0, CLASSES, (rows,), generator=generator)


def compute_only_step(rank: int):
    """The step without an exchange (plain torch, one intra-op thread, as ddp gives each of 2 processes here)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = wide_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = process_batch(rank)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step, lambda: None


def ddp_step(compression: str):
    """dpkit's ddp with this compression, PowerSGD compressing from the first step."""
    import torch
    import torch.nn.functional as F

    from dpkit.engine.engine import Engine

    engine = Engine(
        strategy="ddp", accelerator="cpu", devices=PROCESSES, progress=False, compress=compression,
        compress_warmup_steps=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = wide_model()
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    x, y = process_batch(engine.rank)

    def step() -> None:
        optimizer.zero_grad()
        engine.backward(F.cross_entropy(model(x), y))
        optimizer.step()

    return step, engine.close


def time_contender(name: str, rank: int, steps: int) -> tuple[list[float], float]:
    """One contender built afresh: an untimed step, then `steps` timed ones; (their seconds, gradient bytes this
    process issued per timed step, from the collective record)."""
    from dpkit.observe.collectives import RECORD

    step, close = compute_only_step(rank) if name == COMPUTE_ONLY else ddp_step(name)
    step()
    seconds, bytes_before = [], RECORD.gradient_bytes
    for _ in range(steps):
        began = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - began)
    sent_bytes = (RECORD.gradient_bytes - bytes_before) / steps
    close()
    return seconds, sent_bytes


def worker(args: argparse.Namespace) -> None:
    """Every contender in turn for --rounds rounds; rank 0 writes each one's step seconds and bytes per step."""
    rank = int(os.environ["RANK"])
    names = [COMPUTE_ONLY, *COMPRESSIONS]
    seconds: dict[str, list[float]] = {name: [] for name in names}
    sent_bytes: dict[str, float] = {}
    for round_ in range(args.rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            measured, sent_bytes[name] = time_contender(name, rank, args.steps)
            seconds[name] += measured
        if rank == 0:
            print(f"  round {round_ + 1} of {args.rounds} done", flush=True)
    if rank == 0:
        Path(args.result).write_text(json.dumps({"seconds": seconds, "bytes_per_step": sent_bytes}))


# --- the link ---------------------------------------------------------------------------------------------------
def why_no_namespace() -> str | None:
    """Why this process cannot make a shaped namespace, or None when it can try."""
    if os.geteuid() != 0:
        return "not root"
    missing = [command for command in ("ip", "tc") if shutil.which(command) is None]
    if missing:
        return f"no {' or '.join(missing)} command"
    probe = f"dpkit-compress-{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return (
            f"ip netns add failed: {made.stderr.strip().splitlines()[-1] if made.stderr.strip() else made.returncode}"
        )
    subprocess.run(["ip", "netns", "delete", probe], check=False)
    return None


@contextmanager
def shaped_link(rate: str | None) -> Iterator[list[str]]:
    """The argv prefix that runs a command over the link: [] for plain loopback, else `ip netns exec N` for a
    namespace N made here, its loopback shaped to `rate`, and removed on the way out."""
    if rate is None:
        yield []
        return
    name = f"dpkit-compress-{os.getpid()}-{rate}"
    inside = ["ip", "netns", "exec", name]
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run([*inside, "ip", "link", "set", "lo", "up"], check=True)
        shaping = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", "1mb", "latency", "100ms"]
        subprocess.run([*inside, *shaping], check=True)
        yield inside
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


def python_env() -> dict[str, str]:
    """This process's environment, dpkit importable from this checkout's src first."""
    source = str(HERE.parent / "src")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([source, *filter(None, [os.environ.get("PYTHONPATH")])]))


def dpkit_command(prefix: list[str], *arguments: str) -> None:
    """`python -m dpkit ARGUMENTS` over the link, in this folder (where `compression:wide_model` imports from)."""
    command = [*prefix, sys.executable, "-m", "dpkit", *arguments]
    subprocess.run(command, env=python_env(), cwd=HERE, check=True, stdout=subprocess.DEVNULL)


def measure_steps(prefix: list[str], args: argparse.Namespace, result: Path) -> dict:
    """The launched processes' rounds over the link: each contender's step seconds and bytes per step."""
    script = [str(Path(__file__).resolve()), "--worker", f"--rounds={args.rounds}", f"--steps={args.steps}"]
    launch = [*prefix, sys.executable, "-m", "dpkit", "launch", f"--nproc-per-node={PROCESSES}"]
    subprocess.run([*launch, *script, f"--result={result}"], env=python_env(), check=True)
    return json.loads(result.read_text())


def measure_link(prefix: list[str], doctor_json: Path) -> None:
    """`dpkit doctor`'s all-reduce over the link, 1 to 16 MiB: the planner's calibration of the link."""
    sizes = ["--min-bytes=1M", "--max-bytes=16M", "--factor=4", "--iters=3", "--warmup=1"]
    dpkit_command(prefix, "doctor", f"--nproc-per-node={PROCESSES}", "--collectives=all_reduce", *sizes,
                  "--no-progress", f"--json={doctor_json}")  # fmt: skip


def measure_compute(bench_json: Path) -> None:
    """`dpkit bench` of the model on one device (single and ddp, no exchange): the planner's compute."""
    dpkit_command([], "bench", "--model=compression:wide_model", f"--input-shape={WIDTH}", "--strategies=single,ddp",
                  "--device-counts=1", f"--batch-size={BATCH_SIZE}", "--optimizer=sgd", "--steps=6", "--warmup=2",
                  "--no-progress", f"--json={bench_json}")  # fmt: skip


def predicted_step_seconds(bench_json: Path, doctor_json: Path, compression: str, folder: Path) -> float:
    """`dpkit plan`'s step time for ddp on 2 devices with this compression over the doctor's link."""
    plan_json = folder / f"plan-{doctor_json.stem}-{compression.replace(':', '-')}.json"
    dpkit_command([], "plan", "--model=compression:wide_model", f"--input-shape={WIDTH}", "--strategy=ddp",
                  f"--device-counts={PROCESSES}", f"--batch-size={BATCH_SIZE}", "--optimizer=sgd",
                  f"--compress={compression}", f"--calibration={bench_json}", f"--calibration={doctor_json}",
                  f"--json={plan_json}")  # fmt: skip
    (prediction,) = json.loads(plan_json.read_text())["predictions"]
    return prediction["step_seconds"]


# --- the driver ---------------------------------------------------------------------------------------------------
def link_rows(link: str, measured: dict, predicted: dict[str, float]) -> list[str]:
    """The table's rows of one link: median ms per step, bytes per step, ratios against none, the prediction."""
    medians = {name: statistics.median(values) for name, values in measured["seconds"].items()}
    sent = measured["bytes_per_step"]
    rows = []
    for name in [COMPUTE_ONLY, *COMPRESSIONS]:
        speedup = f"{medians['none'] / medians[name]:.2f}x" if name != COMPUTE_ONLY else "-"
        sent_mb = f"{sent[name] / 1e6:.3f}" if name != COMPUTE_ONLY else "-"
        fewer = f"{sent['none'] / sent[name]:.0f}x" if name != COMPUTE_ONLY else "-"
        plan_ms = f"{predicted[name] * 1e3:.0f}" if name in predicted else "-"
        rows.append(
            f"{LINK_WORDS[link]:<15} {name:<13} {medians[name] * 1e3:>9.0f} {plan_ms:>9} {speedup:>8} "
            f"{sent_mb:>11} {fewer:>7}"
        )
    return rows


def stop_on_sigterm() -> None:
    """SIGTERM as Ctrl-C, so that the namespaces are removed on the way out either way."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--links", default="loopback,1gbit,100mbit", help="comma-separated, from " + ", ".join(LINK_RATES)
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds over every contender (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contender and round (default 3)")
    parser.add_argument("--json", help="also write every step's seconds, the bytes and the predictions here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    links = [link.strip() for link in args.links.split(",")]
    unknown = [link for link in links if link not in LINK_RATES]
    if unknown:
        parser.error(f"--links: unknown {', '.join(unknown)}; expected some of {', '.join(LINK_RATES)}")
    reason = why_no_namespace()
    if reason is not None and any(LINK_RATES[link] for link in links):
        print(f"cannot make a shaped network namespace ({reason}; it needs root, ip and tc): plain loopback only")
        links = ["loopback"]
    stop_on_sigterm()
    print(
        f"ddp on {PROCESSES} processes, 2 x {WIDTH}x{WIDTH} + a {CLASSES}-class head ({gradient_bytes() / 1e6:.1f} MB "
        f"of float32 gradients), global batch {BATCH_SIZE}, SGD; {args.rounds} rounds x {args.steps} timed steps per "
        f"contender; {os.cpu_count()} CPUs",
        flush=True,
    )
    began = time.perf_counter()
    measured, predicted = {}, {}
    with tempfile.TemporaryDirectory() as folder_name:
        folder = Path(folder_name)
        bench_json = folder / "bench.json"
        measure_compute(bench_json)
        for link in links:
            print(f"{LINK_WORDS[link]}:", flush=True)
            with shaped_link(LINK_RATES[link]) as prefix:
                doctor_json = folder / f"doctor-{link}.json"
                measure_link(prefix, doctor_json)
                measured[link] = measure_steps(prefix, args, folder / f"steps-{link}.json")
            predicted[link] = {
                kind: predicted_step_seconds(bench_json, doctor_json, kind, folder) for kind in COMPRESSIONS
            }
    print(
        f"\nmedian ms per step (of {args.rounds} x {args.steps} steps), dpkit plan's prediction, none's step / this "
        "one's, gradient MB sent per step and process, none's bytes / these"
    )
    print(f"{'link':<15} {'contender':<13} {'step ms':>9} {'plan ms':>9} {'speedup':>8} {'MB / step':>11} {'fewer':>7}")
    for link in links:
        print("\n".join(link_rows(link, measured[link], predicted[link])))
    print(f"{time.perf_counter() - began:.0f} s in all; load average {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"measured": measured, "predicted": predicted}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the namespaces are gone by now (shaped_link's finally)
        print("compression.py: interrupted; its network namespaces removed", file=sys.stderr)
        sys.exit(130)
