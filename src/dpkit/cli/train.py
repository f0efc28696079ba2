"""`dpkit train`: train an example (or your model factory) with any strategy; write model.pt and metrics.json.

The recipe is dpkit.recipe.recipe; this module turns the command line into its TrainConfig. With a
strategy that runs one process per device and no launcher around it, the recipe starts this very command
line once per device and waits for the processes.
"""

from __future__ import annotations

import argparse
import shlex

from dpkit.cli.flags import from_args
from dpkit.cli.vocabulary import (
    add_accelerator,
    add_accumulate,
    add_batch_size,
    add_compile,
    add_compress,
    add_devices,
    add_lr,
    add_model_source,
    add_optimizer,
    add_out,
    add_precision,
    add_progress,
    add_restarts,
    add_seed,
    add_steps,
    add_strategy,
    add_strategy_settings,
    add_verb,
    compile_option,
    non_negative_int,
    positive_int,
)
from dpkit.devices import resolve_devices
from dpkit.launch import Command
from dpkit.recipe.config import BEST_BY, CHANGEABLE, TrainConfig
from dpkit.recipe.optimization import SCHEDULES
from dpkit.recipe.recipe import run as run_recipe

# library arguments this command spells differently
SPELLED = {"hang_timeout_seconds": "--hang-timeout"}

DESCRIPTION = """\
Train a built-in example, or your model factory and data loader, with any strategy, and write the run into
--out: model.pt (clean keys, loads into the bare model), metrics.json, metrics.csv (a row per step and per
evaluation; TensorBoard too with --tensorboard), run.json (the settings, kept current), and with
--checkpoint-every the resumable state. The same seed gives the same model with every strategy. Strategies
with a process per device (ddp, fsdp) start their processes themselves. A stopped run continues with
--resume; a resumed run may change the learning rate, schedule or clipping when it says so (--change).
With --devices N > 1 and no --strategy, auto picks the strategy for the model, batch and devices (one device
when data parallelism would be slower) and says why in one line."""

EXAMPLES = (
    "dpkit train --devices 2 --out runs/a              # auto: the strategy that pays, said in one line",
    "dpkit train --strategy ddp --devices 2 --out runs/a",
    "dpkit train --optimizer adamw --lr 3e-3 --schedule cosine --lr-warmup-steps 10 --clip-grad-norm 1 "
    "--eval-every 20 --keep-best accuracy --out runs/b",
    "dpkit train --out runs/b --resume --steps 300 --lr 1e-3 --change lr,steps   # continue at a lower rate",
    "dpkit train --model mymodels:build --data mydata:load --strategy dp --devices 2 --tensorboard --out runs/c",
    "tensorboard --logdir runs/c/tensorboard",
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = add_verb(
        subparsers,
        "train",
        "train an example or your model with any strategy; model, metrics, resumable state",
        DESCRIPTION,
        EXAMPLES,
    )
    add_model_source(parser, "digits")
    run = parser.add_argument_group("devices and strategy")
    add_strategy(
        run,
        None,
        auto="the fastest that fits for this model, batch and these devices, said in one line (default: auto when "
        "--devices gives more than one device, else single)",
    )
    add_accelerator(run)
    add_devices(run)
    add_precision(run)
    add_compile(run)
    run.add_argument(
        "--find-unused-parameters",
        action="store_true",
        help="steps may leave trainable parameters without a gradient (a branch not taken): ddp and zero stage 1 "
        "need it then (they stop with a line saying so); the other strategies need nothing",
    )
    run.add_argument(
        "--static-graph",
        action="store_true",
        help="ddp: every step uses the same parameters (torch's DDP learns which in the first step)",
    )
    add_strategy_settings(run)
    add_compress(run)
    run.add_argument(
        "--compress-warmup",
        dest="compress_warmup_steps",
        type=non_negative_int,
        default=None,
        metavar="STEPS",
        help="powersgd: optimizer steps uncompressed before it compresses (default: a tenth of --steps; a resumed "
        "run keeps its state's)",
    )
    add_restarts(run, " (strategies with a process per device; resumes from the last saved state)")
    steps = parser.add_argument_group("optimization")
    add_steps(steps, 100, "optimizer steps in total, a resumed run's included")
    add_batch_size(steps, "64")
    add_accumulate(steps)
    add_optimizer(steps, "sgd")
    add_lr(steps, 0.1)
    steps.add_argument("--momentum", type=float, default=0.0, help="sgd's momentum")
    steps.add_argument("--weight-decay", type=float, default=0.0, help="weight decay (decoupled with adamw)")
    steps.add_argument(
        "--schedule", default="constant", choices=SCHEDULES, help="learning-rate schedule (cosine: to 0 at --steps)"
    )
    steps.add_argument("--lr-warmup-steps", type=int, default=0, help="linear warm-up to --lr over these first steps")
    steps.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX", help="clip the gradients' norm")
    add_seed(steps)
    outputs = parser.add_argument_group("run folder, evaluation and metrics")
    add_out(outputs, "runs/train", "the run's folder")
    outputs.add_argument("--eval-every", type=positive_int, default=None, metavar="K", help="evaluate every K steps")
    outputs.add_argument(
        "--keep-best",
        choices=list(BEST_BY),
        default=None,
        help="keep OUT/best.pt, the best model by this evaluation metric (needs --eval-every)",
    )
    outputs.add_argument(
        "--log-every", type=positive_int, default=10, metavar="K", help="write metrics.csv rows every K steps"
    )
    outputs.add_argument(
        "--tensorboard", action="store_true", help="also write TensorBoard event files into OUT/tensorboard"
    )
    outputs.add_argument(
        "--checkpoint-every",
        type=positive_int,
        default=None,
        metavar="K",
        help="save the resumable state in OUT/state every K steps, at the last step, and when stopped by "
        "SIGINT/SIGTERM/SIGHUP",
    )
    outputs.add_argument("--keep", type=positive_int, default=2, help="saved states to keep")
    outputs.add_argument(
        "--resume",
        action="store_true",
        help="continue the run saved in --out up to --steps in total (a run stopped at its end is completed, "
        "a finished one left as it is)",
    )
    outputs.add_argument(
        "--resume-from",
        default=None,
        metavar="STEP_DIR",
        help="resume from this step directory of OUT/state (e.g. runs/a/state/step-00000200) instead of the latest "
        "state, with every --resume check; the later states stay until this run's saves of their steps replace "
        "them",
    )
    outputs.add_argument(
        "--change",
        default="",
        metavar="SETTINGS",
        help=f"with --resume: the settings it changes, comma-separated, from {', '.join(CHANGEABLE)} "
        "(recorded in run.json)",
    )
    outputs.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    add_progress(parser)
    return parser


def default_strategy(args: argparse.Namespace) -> str:
    """auto when --devices gives several devices, else single (--devices auto alone keeps one device)."""
    if args.devices == "auto":
        return "single"
    return "auto" if len(resolve_devices(args.accelerator, args.devices)) > 1 else "single"


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    argv = list(args.argv)
    resume_argv = [a for a in argv if a != "--overwrite"] + ([] if "--resume" in argv else ["--resume"])
    change = args.change.replace("-", "_")
    return from_args(
        TrainConfig,
        args,
        strategy=args.strategy or default_strategy(args),
        hang_timeout_seconds=args.hang_timeout,
        change=change,
        batch_size=args.batch_size if args.batch_size is not None else TrainConfig.batch_size,
        progress=not args.no_progress,
        compile=compile_option(args.compile),
        relaunch=Command("dpkit.cli.main", tuple(argv)),
        resume_command="dpkit " + shlex.join(resume_argv),
    )


def run(args: argparse.Namespace) -> int:
    run_recipe(config_from_args(args))
    return 0
