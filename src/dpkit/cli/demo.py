"""`dpkit demo`: train an MLP on the bundled digits with DataParallel, report, save and reload."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import dpkit
from dpkit.devices import resolve_devices
from dpkit.examples.digits import DigitsMLP, load_digits


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("demo", help="train on the bundled digits with DataParallel and show the report")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"], help="default: every GPU if any, else 2 virtual CPU devices")
    parser.add_argument("--devices", default="auto", help="device count or list; default: all GPUs, else 2 virtual CPU devices")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/demo", help="folder for the checkpoint (default: runs/demo)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def run(args: argparse.Namespace) -> int:
    if args.epochs < 1:
        raise ValueError(f"--epochs: expected at least 1, got {args.epochs}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size: expected at least 1, got {args.batch_size}")
    devices = resolve_devices(args.accelerator, args.devices)
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    primary = devices[0]
    model = DigitsMLP().to(primary)
    dp = dpkit.DataParallel(model, devices)
    optimizer = torch.optim.Adam(dp.parameters(), lr=args.lr)

    rows_per_device = [0] * len(devices)
    generator = torch.Generator().manual_seed(args.seed)
    steps_per_epoch = (len(y_train) + args.batch_size - 1) // args.batch_size
    print(f"dpkit demo: digits MLP, {len(y_train)} training images, DataParallel over {', '.join(map(str, devices))}")
    step_seconds = []
    with tqdm(total=args.epochs * steps_per_epoch, desc="training", unit="step", disable=args.no_progress) as bar:
        for epoch in range(args.epochs):
            order = torch.randperm(len(y_train), generator=generator)
            for start in range(0, len(order), args.batch_size):
                index = order[start:start + args.batch_size]
                x, y = x_train[index].to(primary), y_train[index].to(primary)
                began = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(dp(x), y)
                loss.backward()
                optimizer.step()
                step_seconds.append(time.perf_counter() - began)
                rows_per_device = [total + rows for total, rows in zip(rows_per_device, dp.last_split_sizes)]
                bar.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.3f}", refresh=False)  # redraw at tqdm's pace, not every step
                bar.update()

    dp.eval()
    with torch.no_grad():
        accuracy = (dp(x_test.to(primary)).argmax(dim=1).cpu() == y_test).float().mean().item()
    median_ms = sorted(step_seconds)[len(step_seconds) // 2] * 1e3
    print(f"held-out accuracy: {accuracy:.4f} on {len(y_test)} images")
    print(f"time per step: median {median_ms:.2f} ms over {len(step_seconds)} steps (batch {args.batch_size})")
    print("rows processed per device:")
    for device, rows in zip(devices, rows_per_device):
        print(f"  {str(device):8s} {rows:7d}")

    path = dpkit.save_model(dp, Path(args.out) / "model.pt")
    reloaded = dpkit.load_model(DigitsMLP(), path)
    keys = list(torch.load(path, weights_only=True))
    print(f"saved a clean checkpoint to {path} (keys like {keys[0]!r}, no 'module.' prefix)")
    print("load it into a bare model with:")
    print(f"  model = dpkit.load_model(DigitsMLP(), {str(path)!r})")
    with torch.no_grad():
        same = torch.equal(reloaded(x_test[:8]), model.cpu()(x_test[:8]))
    print(f"reloaded model reproduces the trained one: {same}")
    return 0 if accuracy >= 0.95 and same else 1
