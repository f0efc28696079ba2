"""What a recipe run records as it trains: every step's loss (reduced across processes a few steps at a time),
its learning rate, gradient norm and time, written to metrics.csv (and TensorBoard) on rank 0 every few steps;
and metrics.json, the run's summary, written at its end.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dpkit.recipe.config import TrainConfig
from dpkit.recipe.evaluation import Best, Scores
from dpkit.recipe.folder import METRICS, MODEL, write_json
from dpkit.recipe.metrics_log import METRICS_CSV, MetricsLog
from dpkit.strategies.compression import parse_compression

if TYPE_CHECKING:
    from dpkit.engine.engine import Engine
    from dpkit.recipe.checks import Plan


class LossLog:
    """The global batch's mean loss of every step, reduced across processes a few steps at a time."""

    def __init__(self, engine: Engine, losses: Sequence[float] = (), rows: Sequence[int] = ()):
        self.engine = engine
        self.losses, self.rows = list(losses), list(rows)  # per step done (reduced): mean loss, global rows
        self._pending_sums: list[torch.Tensor] = []  # this process's loss sums and rows since the last reduce
        self._pending_rows: list[int] = []

    def add_step(self, loss_sum: torch.Tensor, rows: int) -> None:
        self._pending_sums.append(loss_sum)
        self._pending_rows.append(rows)

    def reduce(self) -> None:
        if self._pending_sums:
            sums = self.engine.reduce(torch.stack(self._pending_sums).double(), "sum")
            rows = self.engine.reduce(torch.tensor(self._pending_rows, dtype=torch.float64), "sum")
            self.losses.extend((sums / rows).tolist())
            self.rows.extend(int(r) for r in rows.tolist())
            self._pending_sums.clear()
            self._pending_rows.clear()


class StepRecords:
    """The steps taken so far: their losses, times and rates, and the rows of metrics.csv (rank 0 writes them;
    `log` is None on the other ranks). A resumed run starts from what its state saved."""

    def __init__(
        self,
        engine: Engine,
        losses: Sequence[float] = (),
        rows: Sequence[int] = (),
        step_seconds: Sequence[float] = (),
        seconds_before: float = 0.0,
    ):
        self.losses = LossLog(engine, losses, rows)
        self.step_seconds = list(step_seconds)
        self.seconds_before = seconds_before  # the time of the steps taken before a resume
        self.logged = len(self.losses.losses)  # steps whose row is in metrics.csv
        self.rates: dict[int, tuple[float, float | None]] = {}  # step -> (lr, grad norm) until its row is written
        self.log: MetricsLog | None = None

    def open_log(self, out: Path, config: TrainConfig, resumed: bool, rank_zero: bool) -> None:
        steps = self.logged
        if rank_zero:
            self.log = MetricsLog(
                out,
                tensorboard=config.tensorboard,
                resume_step=steps if resumed else 0,
                evaluates_again=steps >= config.steps,  # a run stopped at its end evaluates its last step again
            )

    def step_taken(self, step: int, loss_sum: torch.Tensor, rows: int, lr: float, norm: float | None, seconds: float):
        self.losses.add_step(loss_sum, rows)
        self.rates[step] = (lr, norm)
        self.step_seconds.append(seconds)

    def write_rows(self) -> None:
        """The steps' rows since the last call, into metrics.csv (reduces the losses: every process calls it)."""
        self.losses.reduce()
        if self.log is not None:
            for step in range(self.logged + 1, len(self.losses.losses) + 1):
                lr, norm = self.rates.pop(step, (None, None))
                self.log.add(step, loss=self.losses.losses[step - 1], lr=lr, grad_norm=norm)
        self.rates.clear()
        self.logged = len(self.losses.losses)

    def evaluated(self, step: int, scores: Scores) -> None:
        if self.log is not None:
            self.log.add(step, eval_loss=scores.loss, eval_accuracy=scores.accuracy)

    def saved(self) -> dict[str, Any]:
        """What the saved state keeps of the records (load_state's extras give them back)."""
        return {
            "losses": list(self.losses.losses),
            "rows": list(self.losses.rows),
            "step_seconds": list(self.step_seconds),
        }

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


def write_summary(
    config: TrainConfig,
    engine: Engine,
    plan: Plan,
    records: StepRecords,
    scores: Scores,
    best: Best | None,
    seconds: float,
    communication_bytes: int = 0,
) -> dict[str, Any]:
    """metrics.json, and the run's last line on stdout (rank 0). `communication_bytes`: what this process put into
    collectives over the run (for replicated, what would cross between its devices)."""
    out = Path(config.out)
    losses = records.losses
    samples_per_second = sum(losses.rows) / seconds if seconds > 0 else 0.0
    step_seconds = records.step_seconds
    metrics = {
        "strategy": config.strategy,
        "devices": [str(d) for d in engine.devices],
        "world_size": engine.world_size,
        "precision": config.precision,
        "accumulate": config.accumulate,
        "steps": config.steps,
        "batch_size": config.batch_size,
        "seed": config.seed,
        "optimizer": config.optimizer,
        "lr": config.lr,
        "schedule": config.schedule,
        "loss": losses.losses,
        "samples_per_second": samples_per_second,
        "seconds": seconds,
        "median_step_seconds": sorted(step_seconds)[len(step_seconds) // 2] if step_seconds else 0.0,
        "test_loss": scores.loss,
        "test_accuracy": scores.accuracy,
        "test_samples": scores.samples,
        "best": best.record() if best is not None else None,
        "compress": str(parse_compression(config.compress)),
        "communication_bytes": communication_bytes,
        # the saves of the state, and the time they held the loop (staging the background ones, waiting for them)
        "saves": engine.saves,
        "save_blocking_seconds": engine.save_blocking_seconds,
        **engine.strategy.run_metrics(),  # (localsgd, diloco: the replicas' spread at each meeting)
        "resumed": plan.resume,
        "changes": list(plan.changes),
    }
    write_json(out / METRICS, metrics)
    print(
        f"final loss {losses.losses[-1]:.4f}, {samples_per_second:.0f} samples/s, test accuracy "
        f"{metrics['test_accuracy']:.4f}"
        + (f" (best {best.metric} {best.value:.4f} at step {best.step})" if best is not None else "")
        + f"; wrote {out / MODEL}, {out / METRICS} and {out / METRICS_CSV}",
        file=sys.stdout,
    )
    return metrics
