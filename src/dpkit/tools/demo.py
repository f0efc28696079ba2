"""The demo behind `make demo` / `dpkit demo`: train an MLP on scikit-learn's bundled digits with
dpkit.DataParallel (every GPU, else two virtual CPU devices), print the report, save and reload the model; then the
lesson's end: the same model under dp and under ddp (dpkit.tools.profile_strategies), memory per device and time
per step measured here, and when ddp is the one to prefer."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dpkit.checkpoint.model_files import load_model, save_model
from dpkit.checks import check_batch_split, check_int, check_output_folder
from dpkit.devices import DeviceLike, resolve_devices
from dpkit.examples.digits import DigitsMLP, load_digits
from dpkit.observe import Observer, Report
from dpkit.observe.side_by_side import step_seconds
from dpkit.parallel import DataParallel
from dpkit.tools.profile import ProfileSpec
from dpkit.tools.profile_strategies import profile_strategies

LEARNED_ACCURACY = 0.95  # what the default settings reach on the held-out digits
# the comparison's steps under each strategy: enough for a mean step that one hiccup of a shared machine cannot
# swamp, few enough that ddp's processes starting up stay the most of its cost
COMPARED_WARMUP, COMPARED_STEPS = 3, 10


def demo(
    accelerator: str = "auto",
    devices: int | Sequence[DeviceLike] | str = "auto",
    epochs: int = 20,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    out: str = "runs/demo",
    progress: bool = True,
    compare: bool = True,
) -> bool:
    """Train, report and round-trip the checkpoint, then (with `compare`, on two devices or more) the same model
    under dp and ddp; whether the reloaded model reproduces the trained one (a note says when held-out accuracy
    stays below LEARNED_ACCURACY, which is not a failure)."""
    check_int(epochs, "epochs")
    check_int(batch_size, "batch_size")
    check_output_folder(out, "out")  # before training: the checkpoint goes there
    device_list = resolve_devices(accelerator, devices)
    check_batch_split(batch_size, len(device_list))
    torch.manual_seed(seed)
    x_train, y_train, x_test, y_test = load_digits(seed)
    primary = device_list[0]
    model = DigitsMLP().to(primary)
    dp = DataParallel(model, device_list)
    optimizer = torch.optim.Adam(dp.parameters(), lr=lr)
    print(
        f"dpkit demo: digits MLP, {len(y_train)} training images, DataParallel over {', '.join(map(str, device_list))}"
    )
    step_seconds, rows_per_device, observer = _train(
        dp,
        model,
        optimizer,
        x_train,
        y_train,
        device_list,
        epochs=epochs,
        batch_size=batch_size,
        seed=seed,
        progress=progress,
    )

    dp.eval()
    with torch.no_grad():
        accuracy = (dp(x_test.to(primary)).argmax(dim=1).cpu() == y_test).float().mean().item()
    median_ms = sorted(step_seconds)[len(step_seconds) // 2] * 1e3
    print(f"held-out accuracy: {accuracy:.4f} on {len(y_test)} images")
    print(f"time per step: median {median_ms:.2f} ms over {len(step_seconds)} steps (batch {batch_size})")
    _print_devices(device_list, rows_per_device, observer)
    same = _save_and_reload(dp, model, out, x_test)
    if accuracy < LEARNED_ACCURACY:  # a quality note, not a failure: the run did what was asked
        print(
            f"note: held-out accuracy {accuracy:.4f} is below {LEARNED_ACCURACY}, which the default 20 epochs reach; "
            "train longer (--epochs) to get there"
        )
    if compare and len(device_list) > 1:
        _compare_dp_and_ddp(device_list, batch_size=batch_size, lr=lr, seed=seed)
    elif compare:
        print(
            "the lesson's end, dp against ddp, needs two devices or more: `dpkit demo --accelerator cpu` shows it on "
            "2 virtual CPU devices"
        )
    return same


def _train(
    dp: DataParallel,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    device_list: list[torch.device],
    *,
    epochs: int,
    batch_size: int,
    seed: int,
    progress: bool,
) -> tuple[list[float], list[int], Observer | None]:
    """Train for `epochs`: each step's seconds, the rows each device processed, and the observer of the last
    step (each device's memory by category)."""
    primary = device_list[0]
    rows_per_device = [0] * len(device_list)
    generator = torch.Generator().manual_seed(seed)
    steps_per_epoch = (len(y_train) + batch_size - 1) // batch_size
    step_seconds: list[float] = []
    total_steps, observer = epochs * steps_per_epoch, None
    with tqdm(total=epochs * steps_per_epoch, desc="training", unit="step", disable=not progress) as bar:
        for epoch in range(epochs):
            order = torch.randperm(len(y_train), generator=generator)
            for start in range(0, len(order), batch_size):
                index = order[start : start + batch_size]
                x, y = x_train[index].to(primary), y_train[index].to(primary)
                began = time.perf_counter()
                if len(step_seconds) == total_steps - 1:  # the last step: each device's memory, by category
                    observer = Observer(primary, timing=False, trace=False, models=[model], optimizers=[optimizer])
                    observer.start()
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(dp(x), y)
                loss.backward()
                optimizer.step()
                if observer is not None:  # stops once; later calls do nothing
                    observer.stop()
                step_seconds.append(time.perf_counter() - began)
                if dp.last_split_sizes is not None:  # (a batch of rows is always split)
                    rows_per_device = [total + rows for total, rows in zip(rows_per_device, dp.last_split_sizes)]
                bar.set_postfix(
                    epoch=epoch + 1, loss=f"{loss.item():.3f}", refresh=False
                )  # redraw at tqdm's pace, not every step
                bar.update()
    return step_seconds, rows_per_device, observer


def _print_devices(device_list: list[torch.device], rows_per_device: list[int], observer: Observer | None) -> None:
    """Per device: the rows it processed, and its peak memory in the last step."""
    peaks = {entry.device: entry.peak_bytes for entry in observer.report().devices} if observer else {}
    print("per device: rows processed, and peak memory in the last step (device 0 also holds the gathered")
    print("outputs, the loss, the gradients' sum and the optimizer state, so it fills first):")
    print(f"  {'device':8s} {'rows':>7s} {'peak MiB':>9s}")
    for device, rows in zip(device_list, rows_per_device):
        peak = peaks.get(str(device))
        print(f"  {str(device):8s} {rows:7d} {'-' if peak is None else f'{peak / 2**20:.2f}':>9s}")


def _save_and_reload(dp: DataParallel, model: torch.nn.Module, out: str, x_test: torch.Tensor) -> bool:
    """Save a clean checkpoint, say how to load it, and reload it: whether the reloaded model reproduces the
    trained one."""
    path = save_model(dp, Path(out) / "model.pt")
    reloaded = load_model(DigitsMLP(), path)
    keys = list(torch.load(path, weights_only=True))
    print(f"saved a clean checkpoint to {path} (keys like {keys[0]!r}, no 'module.' prefix)")
    print("load it into a bare model with:")
    print("  import dpkit")
    print("  from dpkit.examples.digits import DigitsMLP")
    print(f"  model = dpkit.load_model(DigitsMLP(), {str(path)!r})")
    with torch.no_grad():
        same = torch.equal(reloaded(x_test[:8]), model.cpu()(x_test[:8]))
    print(f"reloaded model reproduces the trained one: {same}")
    return same


def _compare_dp_and_ddp(device_list: list[torch.device], *, batch_size: int, lr: float, seed: int) -> None:
    """The same model, batch and devices under dp and under ddp (in processes of its own): each device's peak
    memory and the step's time, measured here, and when ddp is the one to prefer."""
    spec = ProfileSpec(
        example="digits",
        accelerator=device_list[0].type,
        devices=[str(device) for device in device_list],
        steps=COMPARED_STEPS,
        warmup=COMPARED_WARMUP,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        progress=False,
    )
    print("\nthe lesson's end: the same model under dp and under ddp (a process per device), measured here")
    print(f"({COMPARED_STEPS} steps after {COMPARED_WARMUP} of warm-up, batch {batch_size}; peak memory per device):")
    dp, ddp = profile_strategies(spec, ["dp", "ddp"])
    names = [str(device) for device in device_list]
    print(f"  {'strategy':9s}" + "".join(f"{name + ' MiB':>11s}" for name in names) + f"{'step ms':>10s}")
    for strategy, report in (("dp", dp), ("ddp", ddp)):
        peaks = "".join(f"{report.device(name).peak_bytes / 2**20:11.2f}" for name in names)
        print(f"  {strategy:9s}{peaks}{_step_ms(report):10.2f}")
    for line in _lesson(dp, ddp, device_list[0].type):
        print(line)


def _step_ms(report: Report) -> float:
    seconds = step_seconds(report)
    return float("nan") if seconds is None else seconds * 1e3


def _lesson(dp: Report, ddp: Report, device_type: str) -> list[str]:
    """When ddp is the one to prefer, with what was measured here; where to measure or predict one's own model."""
    first, *others = [d.peak_bytes for d in dp.devices]
    ratio = _step_ms(ddp) / _step_ms(dp)
    here = f"here ddp's step took {ratio:.2f}x dp's"
    if ratio > 1:
        where = "virtual CPU devices" if device_type == "cpu" else "GPUs"
        here += f": on {where}, for a model this small, its processes and exchanges cost more than the work they share"
    sentence = (
        f"dp keeps the one copy of the weights, the gradients' sum and the optimizer state on the first device "
        f"({first / max(others):.1f}x what any other holds here) and copies the weights out at every step; ddp keeps "
        f"the weights, their gradients and the optimizer state whole on every device, each in a process of its own, "
        f"and exchanges the gradients during the backward, so prefer it when dp's first device runs out of memory, on "
        f"many GPUs and across machines ({here})."
    )
    return [
        *textwrap.wrap(sentence, width=110),
        "your own model: `dpkit profile --model pkg.module:factory --strategies dp,ddp` measures both here;",
        "`dpkit plan --model pkg.module:factory --input-shape 64 --gpu h100-sxm` predicts them on GPUs.",
    ]
