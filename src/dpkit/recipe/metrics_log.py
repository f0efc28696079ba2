"""A recipe run's metrics as they happen, on rank 0: OUT/metrics.csv, and TensorBoard's event files in
OUT/tensorboard when asked (`tensorboard --logdir OUT/tensorboard` shows them).

One CSV row per optimizer step (loss, learning rate, gradient norm when clipping) and one per evaluation
(eval_loss, eval_accuracy), appended and flushed as they come, so a run can be watched and a killed run keeps
what it logged (metrics.csv alone does not make a folder hold a run). A resumed run first drops the rows after
the step it resumes from (they belong to steps it will take again), and that step's evaluation when it evaluates
there again (a run stopped at its end repeats its final evaluation). TensorBoard purges every point at a step >=
purge_step, so its writer purges from the resume step and writes that step's kept rows again: every step once.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    import _csv

    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger("dpkit")

METRICS_CSV = "metrics.csv"
TENSORBOARD_FOLDER = "tensorboard"
COLUMNS = ("step", "loss", "lr", "grad_norm", "eval_loss", "eval_accuracy")


def tensorboard_writer_class() -> type[SummaryWriter]:
    """torch's SummaryWriter, or one line saying how to install what it needs."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's writer imports the tensorboard package
        raise ValueError(
            "tensorboard: the tensorboard package is not installed; pip install 'dpkit[tensorboard]' "
            "(or pip install tensorboard), or leave out --tensorboard"
        ) from None
    return SummaryWriter


class MetricsLog:
    """Rows of COLUMNS in OUT/metrics.csv and scalars in TensorBoard, from the step `resume_step` on."""

    def __init__(self, out: Path, *, tensorboard: bool, resume_step: int = 0, evaluates_again: bool = False):
        """`evaluates_again`: the resumed run evaluates at `resume_step` again (its final evaluation)."""
        self.path = out / METRICS_CSV
        self.resume_step = resume_step
        self._kept = self._rows_kept(evaluates_again) if resume_step else []
        # opened with the first row: a run that logged nothing leaves no file
        self._file: TextIO | None = None
        self._csv: _csv.Writer | None = None
        self._tensorboard = None
        if tensorboard:
            writer = tensorboard_writer_class()
            folder = out / TENSORBOARD_FOLDER
            if not resume_step:
                shutil.rmtree(folder, ignore_errors=True)  # a new run's curves, not mixed with an old run's
            self._tensorboard = writer(str(folder), purge_step=resume_step or None)
            for row in self._kept:  # purged with every later step: written again, once
                if int(row[0]) == resume_step:
                    self._add_scalars(resume_step, dict(zip(COLUMNS[1:], (_value(cell) for cell in row[1:]))))

    def _open(self) -> tuple[TextIO, _csv.Writer]:
        self._write_whole(self._kept)
        file = open(self.path, "a", newline="")  # noqa: SIM115 - kept open for the run, closed by close()
        return file, csv.writer(file)

    def _rows_kept(self, evaluates_again: bool) -> list[list[str]]:
        """The rows up to the resume step, without its evaluation if the run evaluates there again."""
        if not self.path.is_file():
            return []
        with open(self.path, newline="") as file:
            rows = list(csv.reader(file))
        if not rows or tuple(rows[0]) != COLUMNS:
            log.warning("%s has other columns than %s; it starts again", self.path, ", ".join(COLUMNS))
            return []
        kept = []
        evaluation = [COLUMNS.index(name) for name in COLUMNS if name.startswith("eval_")]
        for row in rows[1:]:
            if not (row and row[0].isdigit() and int(row[0]) <= self.resume_step):
                continue
            if evaluates_again and int(row[0]) == self.resume_step:
                row = ["" if index in evaluation else cell for index, cell in enumerate(row)]
                if not any(row[1:]):
                    continue
            kept.append(row)
        return kept

    def _write_whole(self, rows: list[list[str]]) -> None:
        temporary = self.path.with_name(self.path.name + ".tmp")
        with open(temporary, "w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(COLUMNS)
            writer.writerows(rows)
        os.replace(temporary, self.path)

    def add(self, step: int, **values: float | None) -> None:
        """One row at `step` (1-based: the step just taken), written and flushed now."""
        unknown = set(values) - set(COLUMNS)
        if unknown:
            raise ValueError(f"metrics: unknown column(s) {', '.join(sorted(unknown))}; known: {', '.join(COLUMNS)}")
        if self._file is None or self._csv is None:
            self._file, self._csv = self._open()
        self._csv.writerow([step] + [_cell(values.get(name)) for name in COLUMNS[1:]])
        self._file.flush()
        self._add_scalars(step, values)

    def _add_scalars(self, step: int, values: dict[str, float | None]) -> None:
        if self._tensorboard is not None:
            for name, value in values.items():
                if value is not None and math.isfinite(value):
                    self._tensorboard.add_scalar(_tag(name), value, step)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
        if self._tensorboard is not None:
            self._tensorboard.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _cell(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def _value(cell: str) -> float | None:
    return None if cell == "" else float(cell)


def _tag(name: str) -> str:
    """TensorBoard's grouping: train/loss, train/lr, eval/loss, eval/accuracy."""
    if name.startswith("eval_"):
        return "eval/" + name.removeprefix("eval_")
    return "train/" + name


def read_metrics_csv(path: str | os.PathLike) -> list[dict[str, float | None]]:
    """metrics.csv back as dicts (empty cells None), e.g. for a plot or a test."""
    with open(path, newline="") as file:
        return [
            {name: (float(cell) if cell != "" else None) for name, cell in row.items()} for row in csv.DictReader(file)
        ]
