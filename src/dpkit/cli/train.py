"""`dpkit train`: train an example (or your model factory) with any strategy; write model.pt and metrics.json.

The same --seed gives the same initial weights and the same global batches whatever the strategy, so
model.pt from every strategy is the same model up to float rounding. With --strategy ddp and no launcher
around it, the command starts its own processes through `dpkit launch`, from its own command line, and
waits for them.

Faults: every flag is checked before any work starts (one line, exit code 2), an --out holding a run is
never overwritten without --overwrite, --checkpoint-every K saves the resumable state every K steps and
when SIGINT/SIGTERM arrives, --resume continues from it, a loss that becomes nan/inf stops the run, and
under `dpkit launch --max-restarts` a restarted worker group resumes from the last state by itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from dpkit.cli import flags
from dpkit.devices import check_process_count, resolve_devices
from dpkit.training.engine import Engine
from dpkit.errors import DpkitError
from dpkit.examples import EXAMPLES, get_example, load_factory
from dpkit.launch import LaunchError, StoppedBySignal, launch, launched
from dpkit.precision import PRECISIONS
from dpkit.strategies import available_strategies

# what a run leaves in --out; any of them there means the folder holds a run
RUN_SETTINGS = "run.json"
RUN_FILES = ("model.pt", "metrics.json", RUN_SETTINGS)
STATE_FOLDER = "state"
# settings a resumed run must share with the run it continues (the saved optimizer brings its own lr back)
RESUME_MUST_MATCH = ("example", "model", "data", "seed", "batch_size", "accumulate", "lr", "momentum")
DIVERGED_EXIT_CODE = 3
# set for the workers of train's own ddp relaunch: the launching `dpkit train` reports signals for them
RELAUNCHED_VARIABLE = "DPKIT_TRAIN_RELAUNCHED"


class TrainingDiverged(DpkitError):
    """The loss became nan or inf; training stopped before writing anything from it."""

    exit_code = DIVERGED_EXIT_CODE


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train", help="train an example or your model with any strategy; write model.pt and metrics.json")
    parser.add_argument("--example", default="digits", help=f"data (and model) to train: {', '.join(sorted(EXAMPLES))} (default digits)")
    parser.add_argument("--model", default=None, help="your model instead of the example's, as 'package.module:factory'")
    parser.add_argument("--data", default=None, help="your data instead of the example's, as 'package.module:loader'; "
                        "loader(seed) returns x_train, y_train, x_test, y_test (class labels as integers)")
    parser.add_argument("--strategy", default="single", choices=available_strategies())
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--devices", default="auto", help="device count or list (default: 1 for single; all GPUs, else 2 virtual CPU devices)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps in total, a resumed run included (default 100)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size, split across devices (default 64)")
    parser.add_argument("--seed", type=int, default=0, help=f"0 … {flags.MAX_SEED} (default 0)")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    parser.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0)")
    parser.add_argument("--precision", default="32", choices=list(PRECISIONS))
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    parser.add_argument("--out", default="runs/train", help="folder for model.pt and metrics.json (default runs/train)")
    parser.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                        help="save the resumable state in OUT/state every K steps and when stopped by SIGINT/SIGTERM")
    parser.add_argument("--keep", type=int, default=2, help="saved states to keep (default 2)")
    parser.add_argument("--resume", action="store_true", help="continue the run saved in --out up to --steps in total")
    parser.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    parser.add_argument("--max-restarts", type=int, default=0, help="ddp: restart the processes this many times after a failure, "
                        "resuming from the last saved state (default 0)")
    parser.add_argument("--hang-timeout", type=float, default=None, metavar="SECONDS",
                        help="ddp: stop and name a process that makes no progress for this long (default: off)")
    parser.add_argument("--force", action="store_true", help="ddp: start more processes than a sane multiple of the cores")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


@dataclass
class Prepared:
    """What the checks produced, so nothing is built twice: the model, the data and how the run starts."""

    model: nn.Module
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    resume: bool
    settings: dict[str, Any]


def run(args: argparse.Namespace) -> int:
    prepared = prepare(args)
    if args.strategy == "ddp" and not launched():
        return relaunch(args)
    return train(args, prepared)


# --- checks, all before any work ----------------------------------------------------------------------

def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"example": None if (args.model and args.data) else args.example, "model": args.model, "data": args.data,
            "seed": args.seed, "batch_size": args.batch_size, "accumulate": args.accumulate, "lr": args.lr,
            "momentum": args.momentum, "steps": args.steps}


def saved_states(out: Path) -> list[Path]:
    """The saved states under OUT/state, oldest first."""
    return sorted(path for path in (out / STATE_FOLDER).glob("step-*") if path.is_dir())


def restarted() -> bool:
    """Whether torchrun restarted this worker group (--max-restarts): the run then resumes by itself."""
    return launched() and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def _check_out(args: argparse.Namespace) -> bool:
    """Whether the run resumes; refuses an --out holding a run that is neither resumed nor overwritten."""
    out = flags.output_directory("--out", args.out)
    if args.resume and args.overwrite:
        raise ValueError("--resume/--overwrite: give one: --resume continues the run in --out, --overwrite replaces it")
    holds = [name for name in (*RUN_FILES, STATE_FOLDER) if (out / name).exists()]
    if restarted():
        return bool(saved_states(out))  # a restarted group picks up where the last state left off
    if args.resume:
        if not saved_states(out):
            raise ValueError(f"--resume: no saved state in {str(out / STATE_FOLDER)!r}; a run saves one with --checkpoint-every K")
        taken = max(int(path.name.split("-")[1]) for path in saved_states(out))
        if taken >= args.steps:
            raise ValueError(f"--steps: the run in {str(out)!r} has already taken {taken} steps; give more than {taken} to continue it")
        saved = json.loads((out / RUN_SETTINGS).read_text()) if (out / RUN_SETTINGS).exists() else {}
        for key in RESUME_MUST_MATCH:
            if key in saved and saved[key] != _settings(args)[key]:
                flag = "--" + key.replace("_", "-")
                raise ValueError(f"{flag}: the run in {str(out)!r} was trained with {saved[key]!r}, got {_settings(args)[key]!r}; "
                                 "resume with the same value")
        return True
    if holds and not args.overwrite:
        raise ValueError(f"--out: {str(out)!r} already holds a run ({', '.join(holds)}); pass --resume to continue it, "
                         "--overwrite to replace it, or choose another --out")
    return False


def prepare(args: argparse.Namespace) -> Prepared:
    """Check every flag, build the model and load the data; raise one line on the first bad value."""
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--accumulate", args.accumulate),
                        ("--keep", args.keep)):
        flags.at_least(flag, value)
    if args.checkpoint_every is not None:
        flags.at_least("--checkpoint-every", args.checkpoint_every)
    flags.at_least("--max-restarts", args.max_restarts, 0)
    if args.hang_timeout is not None:
        flags.finite_number("--hang-timeout", args.hang_timeout, minimum=1e-3)
    flags.finite_number("--lr", args.lr)
    flags.finite_number("--momentum", args.momentum)
    flags.seed("--seed", args.seed)
    devices = resolve_devices(args.accelerator, 1 if (args.devices == "auto" and args.strategy == "single") else args.devices,
                              argument="--devices", accelerator_argument="--accelerator")
    if args.strategy == "single" and len(devices) != 1:
        raise ValueError(f"--devices: strategy 'single' runs on one device, got {len(devices)}; pass --devices 1 (devices=1) "
                         "or choose a multi-device strategy")
    if args.strategy == "ddp" and not launched():
        check_process_count(len(devices), argument="--devices", force=args.force)
    resume = _check_out(args)

    example = None if (args.model and args.data) else get_example(args.example)
    torch.manual_seed(args.seed)  # same initial weights in every process and for every strategy
    if args.model:
        model = flags.built_model("--model", load_factory(args.model), args.model)
    else:
        model = example.build_model()
    if args.data:
        loader = load_factory(args.data)
        try:
            raw = loader(args.seed)
        except Exception as error:
            raise ValueError(f"--data: {args.data}(seed) raised {type(error).__name__}: {error}") from error
        data = flags.classification_data("--data", raw, args.data)
    else:
        data = example.load_data(args.seed)
    flags.model_fits_data("--model" if args.model else "--data", model, data[0], data[1])
    rows = len(data[0])
    if args.batch_size > rows:
        raise ValueError(f"--batch-size: {args.batch_size} is larger than the {rows} training rows; use at most {rows}")
    if args.strategy == "ddp":
        processes = int(os.environ["WORLD_SIZE"]) if launched() else len(devices)
        smallest = rows % args.batch_size or args.batch_size
        if smallest < processes:
            raise ValueError(f"--batch-size: {args.batch_size} leaves a last batch of {smallest} row(s) for {processes} processes; "
                             f"each needs at least one (choose a batch size whose last batch of {rows} rows has >= {processes})")
    return Prepared(model, data, resume, _settings(args))


def _remove_run(out: Path) -> None:
    """--overwrite: only what a run writes goes, nothing else the folder holds."""
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / STATE_FOLDER, ignore_errors=True)


def resume_command(args: argparse.Namespace) -> str:
    argv = [a for a in _own_argv(args) if a != "--overwrite"]
    if "--resume" not in argv:
        argv.append("--resume")
    return "dpkit " + shlex.join(argv)


def _own_argv(args: argparse.Namespace) -> list[str]:
    argv = getattr(args, "argv", None)
    return list(sys.argv[1:] if argv is None else argv)


# --- ddp without a launcher: start our own processes ------------------------------------------------

def relaunch(args: argparse.Namespace) -> int:
    """Run this very command line once per device under `dpkit launch`, and report for the processes."""
    n_devices = len(resolve_devices(args.accelerator, args.devices))
    out = Path(args.out)
    if args.overwrite:
        _remove_run(out)
    saved_env = os.environ.get(RELAUNCHED_VARIABLE)
    os.environ[RELAUNCHED_VARIABLE] = "1"
    try:
        launch("dpkit.cli.main", _own_argv(args), nproc_per_node=n_devices, module=True, max_restarts=args.max_restarts,
               hang_timeout_seconds=args.hang_timeout, force=args.force)
    except KeyboardInterrupt:
        raise StoppedBySignal(_stopped_message(args, signal.SIGINT, None, saved_states(out)[-1:]), signal.SIGINT) from None
    except StoppedBySignal as stopped:
        raise StoppedBySignal(_stopped_message(args, stopped.signum, None, saved_states(out)[-1:]), stopped.signum) from None
    except LaunchError as error:
        if DIVERGED_EXIT_CODE in error.exit_codes.values():
            return DIVERGED_EXIT_CODE  # rank 0 said why in one line
        raise
    finally:
        if saved_env is None:
            os.environ.pop(RELAUNCHED_VARIABLE, None)
        else:
            os.environ[RELAUNCHED_VARIABLE] = saved_env
    metrics = json.loads((out / "metrics.json").read_text())
    print(f"dpkit train: ddp over {n_devices} processes done; final loss {metrics['loss'][-1]:.4f}, "
          f"{metrics['samples_per_second']:.0f} samples/s, test accuracy {metrics['test_accuracy']:.4f}")
    return 0


def _stopped_message(args: argparse.Namespace, signum: int, step: int | None, state: list[Path]) -> str:
    name = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name
    at = f" at step {step} of {args.steps}" if step is not None else ""
    if not state:
        how = "--checkpoint-every K" if args.checkpoint_every is None else f"a state every {args.checkpoint_every} steps"
        return f"stopped by {name}{at}; nothing saved yet ({how} saves state to resume from)"
    return f"stopped by {name}{at}; state saved in {state[-1]}; resume with: {resume_command(args)}"


# --- stopping at a step boundary --------------------------------------------------------------------

class StopRequest:
    """SIGINT/SIGTERM ask the loop to stop after the current step (and save, with --checkpoint-every); a
    second Ctrl-C stops at once."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopRequest"]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
        for signum in saved:
            signal.signal(signum, self._handle)
        try:
            yield self
        finally:
            for signum, handler in saved.items():
                signal.signal(signum, handler)


# --- training -----------------------------------------------------------------------------------------

def train(args: argparse.Namespace, prepared: Prepared | None = None) -> int:
    prepared = prepared or prepare(args)
    out = Path(args.out)
    engine = Engine(strategy=args.strategy, accelerator=args.accelerator, devices=args.devices, precision=args.precision,
                    accumulate=args.accumulate, progress=not args.no_progress)
    if engine.is_global_zero and not prepared.resume and args.overwrite and not restarted():
        _remove_run(out)

    def write_settings() -> None:
        # with the first saved state or the final model: a run that wrote nothing else leaves nothing behind
        if engine.is_global_zero and not (out / RUN_SETTINGS).exists():
            out.mkdir(parents=True, exist_ok=True)
            (out / RUN_SETTINGS).write_text(json.dumps(prepared.settings, indent=2) + "\n")

    model, (x_train, y_train, x_test, y_test) = prepared.model, prepared.data
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    model, optimizer = engine.setup(model, optimizer)
    criterion = engine.setup_criterion(nn.CrossEntropyLoss())
    train_data = TensorDataset(x_train, y_train)
    # the batch order comes from its own seeded generator: the same global batches for every strategy
    order = RandomSampler(train_data, generator=torch.Generator().manual_seed(args.seed))
    loader = engine.setup_dataloader(DataLoader(train_data, batch_size=args.batch_size, sampler=order))

    losses: list[float] = []           # global sample-weighted mean loss of each step done, reduced
    step_rows: list[int] = []          # global rows of each step done
    step_seconds: list[float] = []
    seconds_before = 0.0
    if prepared.resume:
        extras = engine.load_state(out / STATE_FOLDER)
        losses, step_rows = list(extras["losses"]), list(extras["rows"])
        step_seconds, seconds_before = list(extras["step_seconds"]), float(extras["seconds"])
        if engine.step >= args.steps:
            raise ValueError(f"--steps: the run in {str(out)!r} has already taken {engine.step} steps; give more than {engine.step} to continue it")

    engine.print(f"dpkit train: {prepared.settings['model'] or args.example} with strategy {args.strategy} on {engine.world_size} process(es), "
                 f"devices {', '.join(map(str, engine.devices))}, global batch {args.batch_size}, precision {args.precision}"
                 + (f", resuming at step {len(losses)}" if prepared.resume else ""))
    pending_losses: list[torch.Tensor] = []   # this process's loss sums since the last reduce
    pending_rows: list[int] = []
    micro_losses, micro_rows = [], 0
    steps_done = len(losses)
    saved_at: int | None = None
    saved_path: Path | None = None
    bar = engine.progress(total=args.steps, initial=steps_done, desc="training", unit="step")
    stop = StopRequest()

    def reduce_pending() -> None:
        if pending_losses:
            sums = engine.reduce(torch.stack(pending_losses).double(), "sum")
            rows = engine.reduce(torch.tensor(pending_rows, dtype=torch.float64), "sum")
            losses.extend((sums / rows).tolist())
            step_rows.extend(int(r) for r in rows.tolist())
            pending_losses.clear()
            pending_rows.clear()

    def save_state(seconds: float) -> Path:
        reduce_pending()
        write_settings()
        return engine.save_state(out / STATE_FOLDER, keep=args.keep, losses=list(losses), rows=list(step_rows), step_seconds=list(step_seconds),
                                 seconds=seconds)

    started = time.perf_counter()
    step_started = started
    try:
        with stop.installed():
            while steps_done < args.steps:
                for x, y in loader:
                    optimizer.zero_grad()
                    loss = criterion(model(x), y)
                    engine.backward(loss)
                    optimizer.step()
                    micro_losses.append(loss.detach().float() * len(y))
                    micro_rows += len(y)
                    if len(micro_losses) < args.accumulate:
                        continue
                    step_loss = torch.stack(micro_losses).sum().cpu()  # one optimizer step done
                    pending_losses.append(step_loss)
                    pending_rows.append(micro_rows)
                    micro_losses, micro_rows = [], 0
                    steps_done += 1
                    now = time.perf_counter()
                    step_seconds.append(now - step_started)
                    step_started = now
                    bar.update()
                    # every process stops at the same step: a signal or a non-finite loss on any one counts
                    flags = torch.tensor([float(stop.signum is not None), float(not torch.isfinite(step_loss))])
                    if engine.world_size > 1:
                        flags = engine.reduce(flags, "sum")
                    if flags[1] > 0:
                        raise TrainingDiverged(f"--lr {args.lr:g}: the loss became {float(step_loss):g} at step {steps_done}; "
                                               "training stopped and wrote nothing from it; try a smaller --lr")
                    seconds = seconds_before + time.perf_counter() - started
                    if args.checkpoint_every and (steps_done % args.checkpoint_every == 0 or flags[0] > 0 or steps_done == args.steps):
                        saved_path, saved_at = save_state(seconds), steps_done
                    if flags[0] > 0:
                        signum = stop.signum if stop.signum is not None else signal.SIGTERM  # a peer was stopped
                        quiet = not engine.is_global_zero or os.environ.get(RELAUNCHED_VARIABLE)
                        raise StoppedBySignal("" if quiet else _stopped_message(args, signum, steps_done, [saved_path] if saved_path else []),
                                              signum)
                    if steps_done == args.steps:
                        break
    except (StoppedBySignal, TrainingDiverged, KeyboardInterrupt):
        raise
    except Exception:
        if stop.signum is not None:  # a peer stopped first and its collective broke: the stop, not the error, is the news
            raise StoppedBySignal("", stop.signum) from None
        raise
    finally:
        bar.close()
    seconds = seconds_before + time.perf_counter() - started
    reduce_pending()
    samples_per_second = sum(step_rows) / seconds if seconds > 0 else 0.0

    model.eval()
    test_loader = engine.setup_dataloader(DataLoader(TensorDataset(x_test, y_test), batch_size=256))
    correct = []
    with torch.no_grad():
        for x, y in test_loader:
            correct.append(engine.gather(model(x).argmax(dim=1) == y))
    correct = torch.cat(correct)

    write_settings()
    engine.save(model, out / "model.pt")
    if engine.is_global_zero:
        metrics = {
            "strategy": args.strategy, "devices": [str(d) for d in engine.devices], "world_size": engine.world_size,
            "precision": args.precision, "accumulate": args.accumulate, "steps": args.steps,
            "batch_size": args.batch_size, "seed": args.seed, "lr": args.lr, "loss": losses,
            "samples_per_second": samples_per_second, "seconds": seconds,
            "median_step_seconds": sorted(step_seconds)[len(step_seconds) // 2],
            "test_accuracy": float(correct.float().mean()), "test_samples": int(correct.numel()),
            "resumed": prepared.resume,
        }
        # allow_nan=False: a nan that slipped through is an error here, never invalid JSON on disk
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2, allow_nan=False) + "\n")
        print(f"final loss {losses[-1]:.4f}, {samples_per_second:.0f} samples/s, test accuracy "
              f"{metrics['test_accuracy']:.4f}; wrote {out / 'model.pt'} and {out / 'metrics.json'}", file=sys.stdout)
    engine.close()
    return 0
