"""What a save of the training state holds the loop for: background (engine.save_state(blocking=False)) against
blocking, on the wide-blocks example (a saved state of 89.5 MB with AdamW: weights and two moments), single, and
ddp and fsdp on 2 processes.

Each mode trains the same steps, saving every 5th; the loop's time is measured per step. Reported per mode: the
median time the loop was held by a save (for background saves: staging the copy, and waiting at the next save for
the previous one), the median step time on save steps against the median of the other steps, and their ratio.
Rounds alternate the modes so that machine load hits them alike; medians over every round.

    .venv/bin/python benchmarks/checkpoint_overlap.py [--strategy single|ddp|fsdp] [--rounds 3] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

BACKGROUND, BLOCKING = "background", "blocking"
SAVE_EVERY = 5


def one_round(engine, model, optimizer, x, y, steps: int, folder: str, blocking: bool) -> tuple[list, list, list]:
    """(step seconds on save steps, on the others, seconds the loop was held by saves) for one round."""
    import torch.nn.functional as F

    save_steps, other_steps, held = [], [], []
    for step in range(1, steps + 1):
        began = time.perf_counter()
        optimizer.zero_grad()
        engine.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        if step % SAVE_EVERY == 0:
            before = engine.save_blocking_seconds
            engine.save_state(folder, keep=2, blocking=blocking)
            held.append(engine.save_blocking_seconds - before)
        seconds = time.perf_counter() - began
        (save_steps if step % SAVE_EVERY == 0 else other_steps).append(seconds)
    before = engine.save_blocking_seconds
    engine.wait_for_saves()  # the last one, counted as held: the loop would wait for it at its next save
    if held:
        held[-1] += engine.save_blocking_seconds - before
    return save_steps, other_steps, held


def worker(args: argparse.Namespace) -> None:
    import torch

    from dpkit.engine.engine import Engine
    from dpkit.examples.wide_blocks import WideBlocksNet

    engine = Engine(
        strategy=args.strategy, accelerator="cpu", devices=1 if args.strategy == "single" else 2, progress=False
    )
    torch.manual_seed(0)
    bare = WideBlocksNet()
    model, optimizer = engine.setup(bare, torch.optim.AdamW(bare.parameters(), lr=1e-3))
    generator = torch.Generator().manual_seed(engine.rank)
    x, y = torch.randn(64, 64, generator=generator), torch.randint(0, 10, (64,), generator=generator)
    measured: dict[str, tuple[list, list, list]] = {mode: ([], [], []) for mode in (BACKGROUND, BLOCKING)}
    with tempfile.TemporaryDirectory(prefix="dpkit-overlap-") as scratch:
        folder = os.path.join(scratch, f"state-{args.strategy}")
        if engine.world_size > 1:  # every process writes into one folder: rank 0's scratch, told to the others
            folder = engine.gather_object(folder)[0]
        one_round(engine, model, optimizer, x, y, SAVE_EVERY, folder, True)  # warm up every path
        for round_ in range(args.rounds):
            for mode in (BACKGROUND, BLOCKING) if round_ % 2 == 0 else (BLOCKING, BACKGROUND):
                result = one_round(engine, model, optimizer, x, y, args.steps, folder, mode == BLOCKING)
                for kept, new in zip(measured[mode], result):
                    kept.extend(new)
    if engine.rank == 0:
        print(f"{args.strategy}: wide-blocks (7.4 M parameters, AdamW), a save every {SAVE_EVERY} steps, {args.rounds} "
              f"rounds of {args.steps} steps; medians, ms")  # fmt: skip
        print(f"  {'mode':<11} {'held per save':>13} {'save step':>10} {'other step':>11} {'ratio':>6}")
        for mode, (save_steps, other_steps, held) in measured.items():
            save_ms, other_ms = statistics.median(save_steps) * 1e3, statistics.median(other_steps) * 1e3
            print(
                f"  {mode:<11} {statistics.median(held) * 1e3:13.1f} {save_ms:10.1f} {other_ms:11.1f} "
                f"{save_ms / other_ms:6.2f}"
            )
    engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="single", choices=("single", "ddp", "fsdp"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.strategy == "single" or "RANK" in os.environ:
        worker(args)
        return
    from dpkit.launch import launch

    launch(os.path.abspath(__file__), sys.argv[1:], nproc_per_node=2)


if __name__ == "__main__":
    main()
