"""Synchronizing every H steps on a slow link: ddp against localsgd and diloco (H = 8), 2 processes, step time.

The links are those of benchmarks/compression.py: plain loopback, then 1 Gbit/s and 100 Mbit/s, each a network
namespace of its own whose loopback goes through a token bucket filter,

    ip netns add N; ip netns exec N ip link set lo up
    ip netns exec N tc qdisc add dev lo root tbf rate 1gbit burst 1mb latency 100ms

(the burst above lo's 64 KiB MTU; both processes' traffic crosses the one device, so the rate is shared by the two
directions). On each link `dpkit launch` starts 2 processes inside the namespace, which train a model whose
gradients are 33.6 MB (two 2048 x 2048 Linear layers and a 10-class head, 16 rows per process, SGD: little
compute, so the link decides) in rounds; each round runs every contender in turn, the order rotating from round
to round:

    compute only    the same step in both processes without any exchange (plain torch): the floor
    ddp             dpkit's ddp, gradients all-reduced in float32 every step
    localsgd H=8    the replicas' weights averaged every 8 steps (one all-reduce of the whole model)
    diloco H=8      the same meeting, then the outer Nesterov step (Douillard et al. 2023; lr 0.7, momentum 0.9)

Each contender builds its Engine, exchanges once untimed (ddp: its first step; localsgd and diloco: their first
period, meeting included), then times --periods periods of 8 steps, the meeting included: the step time quoted is
the median over all its timed periods of the period's seconds / 8, beside the bytes this process put into
collectives per step, the ratios against ddp, and the planner's prediction for the same link (`dpkit plan
--strategy S --sync-every 8`, calibrated with a `dpkit bench` of the compute on one device and a `dpkit doctor`
all-reduce measured inside the same namespace).

Making a namespace needs root and the `ip` and `tc` commands; without them the benchmark says so in one line and
measures plain loopback only. It removes its namespaces when it ends, Ctrl-C or SIGTERM included.

    sudo .venv/bin/python benchmarks/periodic_link.py                     # 3 links, 3 rounds of 1 period
    .venv/bin/python benchmarks/periodic_link.py --links loopback --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the model, the shaped links and their namespaces, the batches, the launch environment: compression.py's, shared
# (`dpkit plan --model periodic_link:wide_model` finds the model here too)
from compression import (  # noqa: E402  (benchmarks/ is the script's folder)
    CLASSES,
    HERE,
    LINK_RATES,
    LINK_WORDS,
    WIDTH,
    gradient_bytes,
    measure_link,
    process_batch,
    python_env,
    shaped_link,
    stop_on_sigterm,
    why_no_namespace,
    wide_model,
)

BATCH_SIZE = 32  # global: 16 rows per process
PROCESSES = 2
SYNC_EVERY = 8
COMPUTE_ONLY = "compute only"
CONTENDERS = {
    COMPUTE_ONLY: None,
    "ddp": "ddp",
    f"localsgd H={SYNC_EVERY}": "localsgd",
    f"diloco H={SYNC_EVERY}": "diloco",
}


def period_options(strategy: str) -> list[str]:
    """The flags that make `strategy` meet every SYNC_EVERY steps (none for ddp)."""
    return [] if strategy == "ddp" else [f"--sync-every={SYNC_EVERY}"]


# --- inside the launched processes ------------------------------------------------------------------------------
def compute_only_step(rank: int):
    """The step without an exchange (plain torch, one intra-op thread, as each of the 2 processes gets here)."""
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


def engine_step(strategy: str, rank: int):
    """dpkit's ddp, localsgd or diloco (these two meeting every SYNC_EVERY steps) on the batch, through the
    Engine's loader of global batches (localsgd and diloco weight their meetings by the rows it counts)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from dpkit.engine.engine import Engine

    period = {} if strategy == "ddp" else {"sync_every": SYNC_EVERY}
    engine = Engine(strategy=strategy, accelerator="cpu", devices=PROCESSES, progress=False, **period)
    torch.manual_seed(0)
    model = wide_model()
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    x, y = (torch.cat(halves) for halves in zip(process_batch(0), process_batch(1)))  # the global batch
    loader = engine.setup_dataloader(DataLoader(TensorDataset(x, y), batch_size=BATCH_SIZE))

    def step() -> None:
        for rows, labels in loader:  # one global batch: this process's 16 rows of it
            optimizer.zero_grad()
            engine.backward(F.cross_entropy(model(rows), labels))
            optimizer.step()

    return step, engine.close


def time_contender(name: str, rank: int, periods: int) -> tuple[list[float], float]:
    """One contender built afresh: its first exchange untimed, then `periods` timed periods of SYNC_EVERY steps;
    (each period's seconds per step, the bytes this process put into collectives per timed step)."""
    from dpkit.observe.collectives import RECORD

    strategy = CONTENDERS[name]
    step, close = compute_only_step(rank) if strategy is None else engine_step(strategy, rank)
    for _ in range(1 if strategy in (None, "ddp") else SYNC_EVERY):
        step()
    seconds_per_step, bytes_before = [], RECORD.total_bytes
    for _ in range(periods):
        began = time.perf_counter()
        for _ in range(SYNC_EVERY):
            step()
        seconds_per_step.append((time.perf_counter() - began) / SYNC_EVERY)
    sent_bytes = (RECORD.total_bytes - bytes_before) / (periods * SYNC_EVERY)
    close()
    return seconds_per_step, sent_bytes


def worker(args: argparse.Namespace) -> None:
    """Every contender in turn for --rounds rounds; rank 0 writes each one's seconds per step and bytes."""
    rank = int(os.environ["RANK"])
    names = list(CONTENDERS)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    sent_bytes: dict[str, float] = {}
    for round_ in range(args.rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            measured, sent_bytes[name] = time_contender(name, rank, args.periods)
            seconds[name] += measured
        if rank == 0:
            print(f"  round {round_ + 1} of {args.rounds} done", flush=True)
    if rank == 0:
        Path(args.result).write_text(json.dumps({"seconds_per_step": seconds, "bytes_per_step": sent_bytes}))


# --- the link ---------------------------------------------------------------------------------------------------
def dpkit_command(prefix: list[str], *arguments: str) -> None:
    """`python -m dpkit ARGUMENTS` over the link, in this folder (where `periodic_link:wide_model` imports from)."""
    command = [*prefix, sys.executable, "-m", "dpkit", *arguments]
    subprocess.run(command, env=python_env(), cwd=HERE, check=True, stdout=subprocess.DEVNULL)


# --- measuring and predicting -----------------------------------------------------------------------------------
def measure_steps(prefix: list[str], args: argparse.Namespace, result: Path) -> dict:
    """The launched processes' rounds over the link: each contender's seconds per step and bytes per step."""
    script = [str(Path(__file__).resolve()), "--worker", f"--rounds={args.rounds}", f"--periods={args.periods}"]
    launch = [*prefix, sys.executable, "-m", "dpkit", "launch", f"--nproc-per-node={PROCESSES}"]
    subprocess.run([*launch, *script, f"--result={result}"], env=python_env(), check=True)
    return json.loads(result.read_text())


def measure_compute(bench_json: Path) -> None:
    """`dpkit bench` of the model on one device (single and ddp, no exchange): the planner's compute."""
    dpkit_command([], "bench", "--model=periodic_link:wide_model", f"--input-shape={WIDTH}", "--strategies=single,ddp",
                  "--device-counts=1", f"--batch-size={BATCH_SIZE}", "--optimizer=sgd", "--steps=6", "--warmup=2",
                  "--no-progress", f"--json={bench_json}")  # fmt: skip


def predicted_step_seconds(bench_json: Path, doctor_json: Path, strategy: str, folder: Path) -> float:
    """`dpkit plan`'s step time for this strategy on 2 devices over the doctor's link (localsgd and diloco: the
    step averaged over a period)."""
    plan_json = folder / f"plan-{doctor_json.stem}-{strategy}.json"
    dpkit_command([], "plan", "--model=periodic_link:wide_model", f"--input-shape={WIDTH}", f"--strategy={strategy}",
                  *period_options(strategy), f"--device-counts={PROCESSES}", f"--batch-size={BATCH_SIZE}",
                  "--optimizer=sgd", f"--calibration={bench_json}", f"--calibration={doctor_json}",
                  f"--json={plan_json}")  # fmt: skip
    (prediction,) = json.loads(plan_json.read_text())["predictions"]
    return prediction["step_seconds"]


# --- the driver ---------------------------------------------------------------------------------------------------
def link_rows(link: str, measured: dict, predicted: dict[str, float]) -> list[str]:
    """The table's rows of one link: median ms per step, the prediction, ddp's step / this one's, bytes per step."""
    medians = {name: statistics.median(values) for name, values in measured["seconds_per_step"].items()}
    sent = measured["bytes_per_step"]
    rows = []
    for name, strategy in CONTENDERS.items():
        exchanges = strategy is not None
        speedup = f"{medians['ddp'] / medians[name]:.2f}x" if exchanges else "-"
        sent_mb = f"{sent[name] / 1e6:.2f}" if exchanges else "-"
        fewer = f"{sent['ddp'] / sent[name]:.1f}x" if exchanges else "-"
        plan_ms = f"{predicted[strategy] * 1e3:.0f}" if exchanges else "-"
        rows.append(
            f"{LINK_WORDS[link]:<15} {name:<13} {medians[name] * 1e3:>8.0f} {plan_ms:>8} {speedup:>8} "
            f"{sent_mb:>10} {fewer:>6}"
        )
    return rows


def parse_links(parser: argparse.ArgumentParser, text: str) -> list[str]:
    links = [link.strip() for link in text.split(",")]
    unknown = [link for link in links if link not in LINK_RATES]
    if unknown:
        parser.error(f"--links: unknown {', '.join(unknown)}; expected some of {', '.join(LINK_RATES)}")
    reason = why_no_namespace()
    if reason is not None and any(LINK_RATES[link] for link in links):
        print(f"cannot make a shaped network namespace ({reason}; it needs root, ip and tc): plain loopback only")
        return ["loopback"]
    return links


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--links", default="loopback,1gbit,100mbit", help="comma-separated, from " + ", ".join(LINK_RATES)
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every contender (default 3)")
    parser.add_argument("--periods", type=int, default=1, help=f"timed periods of {SYNC_EVERY} steps per contender "
                        "and round (default 1)")  # fmt: skip
    parser.add_argument("--json", help="also write every period's seconds per step, the bytes and the predictions")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    links = parse_links(parser, args.links)
    stop_on_sigterm()
    print(
        f"{PROCESSES} processes, 2 x {WIDTH}x{WIDTH} + a {CLASSES}-class head "
        f"({gradient_bytes() / 1e6:.1f} MB of float32 gradients), global batch {BATCH_SIZE}, SGD; "
        f"{args.rounds} rounds x {args.periods} timed period(s) of "
        f"{SYNC_EVERY} steps per contender; {os.cpu_count()} CPUs",
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
            strategies = [strategy for strategy in CONTENDERS.values() if strategy is not None]
            predicted[link] = {s: predicted_step_seconds(bench_json, doctor_json, s, folder) for s in strategies}
    print(
        f"\nmedian ms per step over whole periods of {SYNC_EVERY} steps (meetings included; of {args.rounds} x "
        f"{args.periods} periods), dpkit plan's prediction, ddp's step / this one's, MB this process put into "
        "collectives per step, ddp's bytes / these"
    )
    print(f"{'link':<15} {'contender':<13} {'step ms':>8} {'plan ms':>8} {'speedup':>8} {'MB / step':>10} {'fewer':>6}")
    for link in links:
        print("\n".join(link_rows(link, measured[link], predicted[link])))
    print(f"{time.perf_counter() - began:.0f} s in all; load average {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"measured": measured, "predicted": predicted}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
