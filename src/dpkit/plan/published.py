"""dpkit plan beside published multi-GPU measurements (the table in docs/cost-model.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from dpkit.plan.catalogue import Catalogue
from dpkit.plan.configuration import Hardware
from dpkit.plan.cost_model import predict_all
from dpkit.plan.profiles import builtin_profile
from dpkit.strategies import reference


@dataclass
class Comparison:
    run: dict[str, Any]
    quantity: str  # "speedup" or "step_seconds"
    measured: float
    predicted: float
    helps: bool  # predicted: N devices give more samples/s than one

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1.0


def published_runs() -> list[dict[str, Any]]:
    text = resources.files("dpkit.plan").joinpath("published_runs.json").read_text()
    return json.loads(text)["runs"]


def compare(run: dict[str, Any], catalogue: Catalogue | None = None) -> Comparison:
    catalogue = catalogue or Catalogue.load()
    profile = builtin_profile(run["model"], seq_len=run.get("seq_len"))
    hardware = Hardware(catalogue.gpu(run["gpu"]), catalogue.link(run["link"]))
    predictions = predict_all(
        profile,
        hardware,
        [reference(), run["strategy"]],
        [1, run["devices"]],
        run["batch_size_per_device"],
        run["precision"],
    )
    prediction = next(p for p in predictions if p.strategy == run["strategy"] and p.devices == run["devices"])
    quantity, measured = next(iter(run["measured"].items()))
    predicted = prediction.speedup if quantity == "speedup" else prediction.step_seconds
    return Comparison(run, quantity, float(measured), predicted, prediction.speedup > 1.0)


def compare_all() -> list[Comparison]:
    catalogue = Catalogue.load()
    return [compare(run, catalogue) for run in published_runs()]


def markdown_table(comparisons: list[Comparison]) -> str:
    lines = [
        "| run | model | batch/GPU | hardware | strategy | measured | predicted | error |",
        "|---|---|---:|---|---|---:|---:|---:|",
    ]
    for c in comparisons:
        r = c.run
        unit = (lambda v: f"{v:.2f}x") if c.quantity == "speedup" else (lambda v: f"{v * 1e3:.0f} ms/step")
        lines.append(
            f"| {r['id']} | {r['model']} ({r['precision']}) | {r['batch_size_per_device']} | "
            f"{r['devices']}x {r['gpu']}, "
            f"{r['link']} | {r['strategy']} | {unit(c.measured)} | {unit(c.predicted)} | {c.error:+.0%} |"
        )
    return "\n".join(lines)
