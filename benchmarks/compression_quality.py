"""What gradient compression costs in quality: digits under every strategy x compression, and a tiny GPT-2.

Two tables, the same runs every time (seed 0):

1. digits, `dpkit train --example digits --optimizer adamw --lr 3e-3 --steps 120` on 2 CPU devices, under ddp,
   zero (stage 1 and 2), fsdp, hsdp (its default shard group, and shard groups of one process: the whole model
   in each, gradients all-reduced between the two) and replicated, with every compression the strategy takes
   (asked of dpkit's registry: Traits.compressions; powersgd as powersgd:1 and powersgd:4, from dpkit train's
   default warm-up, a tenth of --steps). Each row: the test accuracy, its difference from the same strategy
   uncompressed, and whether that is within 3 points.
2. a tiny GPT-2 (transformers' GPT2LMHeadModel from a small config, no download) on synthetic tokens from a
   fixed random Markov chain (each token followed by one of a few likely tokens, so there is something to
   learn), trained for --gpt2-steps with AdamW under ddp (2 launched processes) and replicated (2 virtual
   devices, one process), uncompressed, bf16 and powersgd:4 (warm-up a tenth of the steps). Each row: the final
   eval loss on held-out sequences, its difference from uncompressed relative to it, and whether that is
   within 2%.

    .venv/bin/python benchmarks/compression_quality.py                 # both tables, several minutes
    .venv/bin/python benchmarks/compression_quality.py --only gpt2 --gpt2-steps 300
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

HERE = Path(__file__).resolve().parent
DEVICES = 2
DIGITS_FLAGS = ["--example=digits", "--optimizer=adamw", "--lr=3e-3", "--steps=120", f"--devices={DEVICES}"]
DIGITS_POINTS = 3.0  # test accuracy within this many points of the same strategy uncompressed
GPT2_RELATIVE = 0.02  # final eval loss within 2% of uncompressed
GPT2_COMPRESSIONS = ("none", "bf16", "powersgd:4")
TORCH_DDP, TORCH_COMPRESSIONS = "torch DDP", ("none", "powersgd:4")  # the reference loop: torch's DDP and hooks

# (label, strategy, its options as the Engine names them); the flags of dpkit train that set those options
STRATEGIES = [
    ("ddp", "ddp", {}),
    ("zero stage 1", "zero", {"stage": 1}),
    ("zero stage 2", "zero", {"stage": 2}),
    ("fsdp", "fsdp", {}),
    ("hsdp", "hsdp", {}),
    ("hsdp, shard size 1", "hsdp", {"shard_size": 1}),
    ("replicated", "replicated", {}),
]
TRAIN_FLAGS = {"stage": "--zero-stage", "shard_size": "--shard-size"}

# the tiny GPT-2 and its tokens
VOCAB, SEQUENCE, SUCCESSORS = 128, 32, 4  # tokens, tokens per sequence, likely successors of each token
TRAIN_SEQUENCES, EVAL_SEQUENCES, GPT2_BATCH = 4096, 256, 32


def python_env() -> dict[str, str]:
    """This process's environment, dpkit importable from this checkout's src first."""
    source = str(HERE.parent / "src")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([source, *filter(None, [os.environ.get("PYTHONPATH")])]))


# --- 1. digits ----------------------------------------------------------------------------------------------------
def compressions_taken(strategy: str, options: dict) -> list[str]:
    """The compressions to run under this strategy: what its traits say it takes, powersgd at ranks 1 and 4."""
    from dpkit.strategies import strategy_traits

    kinds = []
    for kind in strategy_traits(strategy, **options).compressions:
        kinds += ["powersgd:1", "powersgd:4"] if kind == "powersgd" else [kind]
    return kinds


def train_digits(strategy: str, options: dict, compression: str, out: Path) -> dict:
    """One `dpkit train` of digits; its metrics.json."""
    flags = [f"{TRAIN_FLAGS[name]}={value}" for name, value in options.items()]
    command = [sys.executable, "-m", "dpkit", "train", *DIGITS_FLAGS, f"--strategy={strategy}", *flags,
               f"--compress={compression}", f"--out={out}", "--overwrite", "--no-progress", "--quiet"]  # fmt: skip
    subprocess.run(command, env=python_env(), check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "metrics.json").read_text())


def digits_table(folder: Path) -> list[str]:
    """Every strategy x compression on digits: test accuracy, the points from uncompressed, within 3 points?"""
    rows = [f"{'strategy':<20} {'compress':<11} {'test accuracy':>13} {'vs none':>8} {'within 3 points':>16}"]
    for label, strategy, options in STRATEGIES:
        uncompressed = None
        for compression in compressions_taken(strategy, options):
            began = time.perf_counter()
            out = folder / f"{label.replace(' ', '-').replace(',', '')}-{compression.replace(':', '-')}"
            accuracy = 100 * train_digits(strategy, options, compression, out)["test_accuracy"]
            uncompressed = accuracy if compression == "none" else uncompressed
            points = accuracy - uncompressed
            verdict = "-" if compression == "none" else ("yes" if abs(points) <= DIGITS_POINTS else "NO")
            rows.append(f"{label:<20} {compression:<11} {accuracy:>12.1f}% {points:>+8.1f} {verdict:>16}")
            print(f"  {rows[-1]}   ({time.perf_counter() - began:.0f} s)", flush=True)
    return rows


# --- 2. the tiny GPT-2 --------------------------------------------------------------------------------------------
def tiny_gpt2():
    import torch
    import transformers

    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQUENCE, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def markov_chain():
    """The fixed random Markov chain of the tokens: each token is followed by one of its SUCCESSORS likely tokens
    (90%) or any token (10%); row i of the result is the distribution of the token after token i."""
    import torch

    likely = torch.randint(0, VOCAB, (VOCAB, SUCCESSORS), generator=torch.Generator().manual_seed(1234))
    transitions = torch.full((VOCAB, VOCAB), 0.1 / VOCAB, dtype=torch.float64)
    return transitions.scatter_add_(1, likely, torch.full((VOCAB, SUCCESSORS), 0.9 / SUCCESSORS, dtype=torch.float64))


def chain_entropy_nats() -> float:
    """The chain's entropy rate: the lowest mean next-token loss a model can reach (the first token aside)."""
    transitions = markov_chain()
    stationary = transitions.new_full((VOCAB,), 1 / VOCAB)
    for _ in range(1000):
        stationary = stationary @ transitions
    return float(-(stationary[:, None] * transitions * transitions.log()).sum())


def markov_tokens(sequences: int, seed: int):
    """Sequences of the chain, the first token uniform; `seed` draws the sequences, not the chain."""
    import torch

    transitions = markov_chain()
    draws = torch.Generator().manual_seed(seed)
    tokens = torch.empty(sequences, SEQUENCE, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (sequences,), generator=draws)
    for position in range(1, SEQUENCE):
        tokens[:, position] = torch.multinomial(transitions[tokens[:, position - 1]], 1, generator=draws).squeeze(1)
    return tokens


def eval_loss(model, tokens) -> float:
    """The mean next-token loss over the held-out sequences (every sequence as long: the mean of batch means)."""
    import torch

    model.eval()
    with torch.no_grad():
        losses = [model(input_ids=batch, labels=batch).loss.item() for batch in tokens.split(64)]
    model.train()
    return sum(losses) / len(losses)


def warmup_steps(steps: int) -> int:
    """PowerSGD's uncompressed steps first: a tenth of the run, as dpkit train's default (torch's hook needs 2)."""
    return max(2, steps // 10)


def train_steps(model, optimizer, backward, rank: int, processes: int, steps: int) -> None:
    """The GPT-2's loop, the same under dpkit and torch: each step's global batch of GPT2_BATCH sequences, in a
    fixed order, this process taking its rows of it."""
    import torch

    train = markov_tokens(TRAIN_SEQUENCES, seed=1)
    order = torch.randperm(TRAIN_SEQUENCES, generator=torch.Generator().manual_seed(3))
    share = GPT2_BATCH // processes
    model.train()
    for step in range(steps):
        rows = order[(step * GPT2_BATCH) % TRAIN_SEQUENCES :][:GPT2_BATCH]
        ids = train[rows[rank * share : (rank + 1) * share]]
        optimizer.zero_grad()
        backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()


def train_gpt2(strategy: str, compression: str, steps: int, lr: float) -> float:
    """The tiny GPT-2 trained by dpkit under this strategy and compression; the final eval loss."""
    import torch

    import dpkit

    engine = dpkit.Engine(
        strategy=strategy, accelerator="cpu", devices=DEVICES, progress=False, compress=compression,
        compress_warmup_steps=warmup_steps(steps),
    )  # fmt: skip
    model = tiny_gpt2()
    model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=lr))
    train_steps(model, optimizer, engine.backward, engine.rank, engine.world_size, steps)  # replicated: 1 process
    loss = eval_loss(dpkit.unwrap_model(model), markov_tokens(EVAL_SEQUENCES, seed=2))
    engine.close()
    return loss


def train_gpt2_torch(compression: str, steps: int, lr: float) -> float:
    """The same loop on torch's own DDP over gloo, with torch's own powerSGD_hook for powersgd:R (rank R, from
    the same step as dpkit's, min_compression_rate 2, error feedback and warm start: dpkit's settings); the final eval
    loss. What dpkit's PowerSGD is checked against (torch's bf16_compress_hook refuses gloo)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    if not dist.is_initialized():  # one group for every torch run of this process (gloo's store keys stay unique)
        dist.init_process_group("gloo")
    model = tiny_gpt2()
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    if compression.startswith("powersgd:"):
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=int(compression.split(":")[1]),
            start_powerSGD_iter=warmup_steps(steps), min_compression_rate=2,
        )  # fmt: skip
        wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=lr)
    train_steps(wrapped, optimizer, torch.Tensor.backward, dist.get_rank(), dist.get_world_size(), steps)
    return eval_loss(model, markov_tokens(EVAL_SEQUENCES, seed=2))


def gpt2_worker(args: argparse.Namespace) -> None:
    """In each launched process (ddp, torch DDP) or in this one (replicated): every GPT-2 compression of this
    contender in turn; rank 0 writes the final eval losses."""
    steps, lr = args.gpt2_steps, args.gpt2_lr
    if args.strategy == TORCH_DDP:
        import torch.distributed as dist

        losses = {kind: train_gpt2_torch(kind, steps, lr) for kind in TORCH_COMPRESSIONS}
        dist.destroy_process_group()
    else:
        losses = {kind: train_gpt2(args.strategy, kind, steps, lr) for kind in GPT2_COMPRESSIONS}
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.result).write_text(json.dumps(losses))


def gpt2_losses(contender: str, args: argparse.Namespace, folder: Path) -> dict[str, float]:
    """The final eval losses of the GPT-2 runs of one contender (a dpkit strategy, or torch DDP), from its
    process: 2 launched ones for a strategy with a process per device and for torch DDP."""
    from dpkit.strategies import strategy_traits
    from dpkit.strategies.base import PER_DEVICE

    result = folder / f"gpt2-{contender.replace(' ', '-')}.json"
    script = [str(Path(__file__).resolve()), "--gpt2-worker", f"--strategy={contender}", f"--result={result}",
              f"--gpt2-steps={args.gpt2_steps}", f"--gpt2-lr={args.gpt2_lr}"]  # fmt: skip
    launch = ["-m", "dpkit", "launch", f"--nproc-per-node={DEVICES}"]
    per_device = contender == TORCH_DDP or strategy_traits(contender).processes == PER_DEVICE
    subprocess.run([sys.executable, *(launch if per_device else []), *script], env=python_env(), check=True)
    return json.loads(result.read_text())


def gpt2_table(args: argparse.Namespace, folder: Path) -> list[str]:
    """The GPT-2's final eval loss per contender and compression, relative to uncompressed, within 2%?"""
    rows = [f"{'contender':<15} {'compress':<11} {'eval loss':>9} {'vs none':>8} {'within 2%':>10}"]
    for contender in ("ddp", "replicated", TORCH_DDP):
        began = time.perf_counter()
        losses = gpt2_losses(contender, args, folder)
        for compression, loss in losses.items():
            relative = loss / losses["none"] - 1
            verdict = "-" if compression == "none" else ("yes" if abs(relative) <= GPT2_RELATIVE else "NO")
            rows.append(f"{contender:<15} {compression:<11} {loss:>9.4f} {relative:>+8.2%} {verdict:>10}")
        print("\n".join(f"  {row}" for row in rows[-len(losses) :]) + f"   ({time.perf_counter() - began:.0f} s)")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["digits", "gpt2"], help="one table only")
    parser.add_argument("--gpt2-steps", type=int, default=300, help="the GPT-2's optimizer steps (default 300)")
    parser.add_argument("--gpt2-lr", type=float, default=3e-3, help="the GPT-2's AdamW learning rate (default 3e-3)")
    parser.add_argument("--gpt2-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gpt2_worker:
        gpt2_worker(args)
        return 0
    sys.path.insert(0, str(HERE.parent / "src"))  # this checkout's dpkit, for the registry's traits
    began = time.perf_counter()
    tables = []
    with tempfile.TemporaryDirectory() as folder_name:
        folder = Path(folder_name)
        if args.only in (None, "digits"):
            print(f"digits: dpkit train {' '.join(DIGITS_FLAGS)} --strategy S --compress C", flush=True)
            tables.append(digits_table(folder))
        if args.only in (None, "gpt2"):
            print(
                f"tiny GPT-2 (2 layers, 64 wide, vocabulary {VOCAB}), Markov-chain tokens, {args.gpt2_steps} steps "
                f"of {GPT2_BATCH} x {SEQUENCE} tokens, AdamW lr {args.gpt2_lr}, {DEVICES} devices; the chain's "
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
