"""What synchronizing every H steps costs in quality: localsgd and diloco against ddp, on digits and a tiny GPT-2.

Two tables, the same runs every time (seed 0, 2 processes):

1. digits, `dpkit train --example digits --optimizer adamw --lr 3e-3 --steps 240 --devices 2` under ddp,
   localsgd --sync-every 8 and diloco --sync-every 8 (outer SGD, lr 0.7, Nesterov momentum 0.9: Douillard et al.
   2023's defaults, dpkit's). Each row: the test accuracy, its points from ddp's, the bytes this process put into
   collectives over the run (metrics.json's communication_bytes), ddp's bytes / these, and the replicas' parameter
   spread (largest relative difference from their average) at the first and the last meeting.
2. a tiny GPT-2 (transformers' GPT2LMHeadModel from a config, 2 layers, 64 wide, 0.11 M parameters, no download) on
   synthetic tokens from a fixed random Markov chain, the model and data of benchmarks/compression_quality.py,
   trained with AdamW (lr 3e-3) for --gpt2-steps steps (default 512) of 32 sequences x 32 tokens under ddp, then
   localsgd and diloco at H = 4, 16 and 64, and diloco at H = 4 with an outer momentum of 0.5, all in one
   `dpkit launch` of 2 processes, the sequences through engine.setup_dataloader. Each row: the eval loss on
   held-out sequences at a quarter, half and all of the steps (each a meeting of every H) and its difference from
   ddp's relative to it, the bytes this process put into collectives, ddp's / these, and the spread at the first
   and the last meeting.

    .venv/bin/python benchmarks/periodic_quality.py                   # both tables, about 6 minutes on 2 cores
    .venv/bin/python benchmarks/periodic_quality.py --only gpt2 --gpt2-steps 256
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the tiny GPT-2, its Markov-chain tokens and its evaluation: compression_quality.py's, shared
from compression_quality import (  # noqa: E402  (benchmarks/ is the script's folder)
    chain_entropy_nats,
    eval_loss,
    markov_tokens,
    python_env,
    tiny_gpt2,
)

HERE = Path(__file__).resolve().parent
DEVICES = 2
DIGITS_FLAGS = ["--example=digits", "--optimizer=adamw", "--lr=3e-3", "--steps=240", f"--devices={DEVICES}"]
DIGITS_RUNS = [("ddp", None), ("localsgd", 8), ("diloco", 8)]  # (strategy, sync_every)
GPT2_PERIODS = (4, 16, 64)
GPT2_STRATEGIES = ("localsgd", "diloco")
# the paper's outer momentum, 0.9, is meant for hundreds of steps between meetings: at the smallest H also a lower one
GPT2_LOW_MOMENTUM = 0.5

# the tiny GPT-2 and its tokens (benchmarks/compression_quality.py's)
VOCAB, SEQUENCE, SUCCESSORS = 128, 32, 4  # tokens, tokens per sequence, likely successors of each token
TRAIN_SEQUENCES, EVAL_SEQUENCES, GPT2_BATCH = 4096, 256, 32


def contender_name(strategy: str, sync_every: int | None) -> str:
    return strategy if sync_every is None else f"{strategy} H={sync_every}"


def spread_text(spreads: list[float]) -> str:
    """The first and the last meeting's parameter spread, in percent."""
    return f"{100 * spreads[0]:.1f}% -> {100 * spreads[-1]:.1f}%" if spreads else "-"


# --- 1. digits ----------------------------------------------------------------------------------------------------
def train_digits(strategy: str, sync_every: int | None, out: Path) -> dict:
    """One `dpkit train` of digits; its metrics.json."""
    period = [] if sync_every is None else [f"--sync-every={sync_every}"]
    command = [sys.executable, "-m", "dpkit", "train", *DIGITS_FLAGS, f"--strategy={strategy}", *period,
               f"--out={out}", "--overwrite", "--no-progress", "--quiet"]  # fmt: skip
    subprocess.run(command, env=python_env(), check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "metrics.json").read_text())


def digits_table(folder: Path) -> list[str]:
    """ddp, localsgd and diloco on digits: test accuracy, points from ddp, bytes sent, the spread."""
    header = (
        f"{'strategy':<14} {'test accuracy':>13} {'vs ddp':>7} {'bytes sent':>11} {'fewer':>6}  spread, first -> last"
    )
    rows, reference = [header], {}
    for strategy, sync_every in DIGITS_RUNS:
        began = time.perf_counter()
        metrics = train_digits(strategy, sync_every, folder / f"digits-{strategy}")
        accuracy, sent_bytes = 100 * metrics["test_accuracy"], metrics["communication_bytes"]
        spreads = metrics.get("parameter_spread", [])
        reference = reference or {"accuracy": accuracy, "bytes": sent_bytes}
        rows.append(
            f"{contender_name(strategy, sync_every):<14} {accuracy:>12.2f}% {accuracy - reference['accuracy']:>+7.2f} "
            f"{sent_bytes:>11,} {reference['bytes'] / sent_bytes:>5.1f}x  {spread_text(spreads)}"
        )
        print(f"  {rows[-1]}   ({time.perf_counter() - began:.0f} s)", flush=True)
    return rows


# --- 2. the tiny GPT-2 --------------------------------------------------------------------------------------------
def train_batches(engine):
    """The training sequences as the Engine's loader of global batches of GPT2_BATCH sequences, in a fixed order
    (each process gets its share of each). Through engine.setup_dataloader: localsgd and diloco weight their
    meetings by the rows each replica trained on, which they learn from it."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    train = markov_tokens(TRAIN_SEQUENCES, seed=1)
    order = torch.randperm(TRAIN_SEQUENCES, generator=torch.Generator().manual_seed(3))
    return engine.setup_dataloader(DataLoader(TensorDataset(train[order]), batch_size=GPT2_BATCH))


def eval_steps(steps: int) -> list[int]:
    """Where the eval loss is taken: at a quarter, half and all of the steps (each a meeting of every H)."""
    return [steps // 4, steps // 2, steps]


def train_steps(engine, model, optimizer, steps: int) -> dict[int, float]:
    """The GPT-2's loop, epoch after epoch of the same order, for `steps` optimizer steps; the eval loss at each
    of eval_steps (under localsgd and diloco a meeting has just made every replica's weights the same)."""
    import dpkit

    loader, held_out = train_batches(engine), markov_tokens(EVAL_SEQUENCES, seed=2)
    losses = {}
    model.train()
    while engine.step < steps:
        for (ids,) in loader:
            optimizer.zero_grad()
            engine.backward(model(input_ids=ids, labels=ids).loss)
            optimizer.step()
            if engine.step in eval_steps(steps):
                losses[engine.step] = eval_loss(dpkit.unwrap_model(model), held_out)
            if engine.step == steps:
                break
    return losses


def train_gpt2(strategy: str, options: dict, steps: int, lr: float) -> dict:
    """The tiny GPT-2 trained by dpkit under this strategy: the eval losses, the bytes this process put into
    collectives, the spread at each meeting."""
    import torch

    import dpkit
    from dpkit.observe.collectives import RECORD

    engine = dpkit.Engine(strategy=strategy, accelerator="cpu", devices=DEVICES, progress=False, **options)
    model = tiny_gpt2()
    model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=lr))
    bytes_before = RECORD.total_bytes
    losses = train_steps(engine, model, optimizer, steps)
    sent_bytes = RECORD.total_bytes - bytes_before
    spreads = engine.strategy.run_metrics().get("parameter_spread", [])
    engine.close()
    return {"losses": losses, "bytes": sent_bytes, "spreads": spreads}


def gpt2_contenders() -> list[tuple[str, str, dict]]:
    """(name, strategy, its options): ddp, each strategy at each H, diloco at the smallest H with a lower outer
    momentum."""
    contenders = [("ddp", "ddp", {})]
    for period in GPT2_PERIODS:
        contenders += [(contender_name(s, period), s, {"sync_every": period}) for s in GPT2_STRATEGIES]
    low = {"sync_every": min(GPT2_PERIODS), "outer_momentum": GPT2_LOW_MOMENTUM}
    return [*contenders, (f"diloco H={min(GPT2_PERIODS)} m={GPT2_LOW_MOMENTUM}", "diloco", low)]


def gpt2_worker(args: argparse.Namespace) -> None:
    """In each launched process: every contender in turn; rank 0 writes the results."""
    rank = int(os.environ["RANK"])
    results = {}
    for name, strategy, options in gpt2_contenders():
        began = time.perf_counter()
        results[name] = train_gpt2(strategy, options, args.gpt2_steps, args.gpt2_lr)
        if rank == 0:
            final_loss = results[name]["losses"][args.gpt2_steps]
            print(
                f"  {name:<17} final eval loss {final_loss:.4f}   ({time.perf_counter() - began:.0f} s)",
                flush=True,
            )
    if rank == 0:
        Path(args.result).write_text(json.dumps(results))


def gpt2_table(args: argparse.Namespace, folder: Path) -> list[str]:
    """The GPT-2's final eval loss per contender, relative to ddp's, the bytes sent, the spread."""
    result = folder / "gpt2.json"
    script = [str(Path(__file__).resolve()), "--gpt2-worker", f"--result={result}",
              f"--gpt2-steps={args.gpt2_steps}", f"--gpt2-lr={args.gpt2_lr}"]  # fmt: skip
    launch = [sys.executable, "-m", "dpkit", "launch", f"--nproc-per-node={DEVICES}"]
    subprocess.run([*launch, *script], env=python_env(), check=True)
    results = json.loads(result.read_text())
    reference = results["ddp"]
    steps = [str(step) for step in eval_steps(args.gpt2_steps)]
    losses_header = " ".join(f"{'loss @ ' + step:>10} {'vs ddp':>7}" for step in steps)
    rows = [f"{'strategy':<17} {losses_header} {'MB sent':>8} {'fewer':>6}  spread, first -> last"]
    for name, measured in results.items():
        losses = " ".join(
            f"{measured['losses'][step]:>10.4f} {measured['losses'][step] / reference['losses'][step] - 1:>+7.1%}"
            for step in steps
        )
        rows.append(
            f"{name:<17} {losses} {measured['bytes'] / 1e6:>8.1f} {reference['bytes'] / measured['bytes']:>5.1f}x  "
            f"{spread_text(measured['spreads'])}"
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["digits", "gpt2"], help="one table only")
    parser.add_argument("--gpt2-steps", type=int, default=512, help="the GPT-2's optimizer steps (default 512)")
    parser.add_argument("--gpt2-lr", type=float, default=3e-3, help="the GPT-2's AdamW learning rate (default 3e-3)")
    parser.add_argument("--gpt2-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gpt2_worker:
        gpt2_worker(args)
        return 0
    quarter = 4 * max(GPT2_PERIODS)
    if args.gpt2_steps <= 0 or args.gpt2_steps % quarter:
        parser.error(
            f"--gpt2-steps: expected a multiple of {quarter} (each quarter a meeting of every H), got {args.gpt2_steps}"
        )
    began = time.perf_counter()
    tables = []
    with tempfile.TemporaryDirectory() as folder_name:
        folder = Path(folder_name)
        if args.only in (None, "digits"):
            print(f"digits: dpkit train {' '.join(DIGITS_FLAGS)} --strategy S [--sync-every 8]", flush=True)
            tables.append(digits_table(folder))
        if args.only in (None, "gpt2"):
            print(
                f"tiny GPT-2 (2 layers, 64 wide, vocabulary {VOCAB}), Markov-chain tokens, {args.gpt2_steps} steps "
                f"of {GPT2_BATCH} x {SEQUENCE} tokens, AdamW lr {args.gpt2_lr}, {DEVICES} processes; the chain's "
                f"entropy rate (the lowest loss reachable) {chain_entropy_nats():.3f} nats, uniform "
                f"{math.log(VOCAB):.3f}",
                flush=True,
            )
            tables.append(gpt2_table(args, folder))
    for table in tables:
        print("\n" + "\n".join(table))
    print(f"\n{time.perf_counter() - began:.0f} s in all; load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
