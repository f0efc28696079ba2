"""A strategy with one process per device, benched in its own processes: one launch per device count through
dpkit's launcher, each process running this module's worker (`python -m dpkit.tools.bench.processes
--worker SPEC OUT`); rank 0 writes what it measured."""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict
from pathlib import Path

from dpkit.launch import Command, relaunch
from dpkit.launch.environment import process_place
from dpkit.tools.bench.contender import Contender, load_model_source
from dpkit.tools.bench.spec import BenchSpec


def run_in_processes(spec: BenchSpec, strategy: str, devices: int) -> tuple[list[float], dict[str, float]]:
    """Launch `devices` worker processes of `strategy`; rank 0's step times and phase seconds."""
    with tempfile.TemporaryDirectory(prefix="dpkit-bench-") as folder:
        spec_path, out_path = Path(folder, "spec.json"), Path(folder, "out.json")
        worker_spec = asdict(spec)
        worker_spec.update(progress=False, device_counts=[devices], strategies=[strategy])
        spec_path.write_text(json.dumps(worker_spec))
        relaunch(Command("dpkit.tools.bench.processes", ("--worker", str(spec_path), str(out_path))), devices)
        measured = json.loads(out_path.read_text())
    return measured["times"], measured["phase_seconds"]


def worker_main(spec_path: str, out_path: str) -> int:
    """A worker process: warm up, time the steps, observe a few; rank 0 writes what it measured."""
    data = json.loads(Path(spec_path).read_text())
    if data.get("input_shape"):
        data["input_shape"] = tuple(data["input_shape"])
    spec = BenchSpec(**data)
    factory, x, y, _ = load_model_source(spec)
    place = process_place()
    world_size, rank = place.world_size, place.rank
    contender = Contender(spec, spec.strategies[0], world_size, factory, x, y, rank=rank, world_size=1)
    # under the launcher, `devices` is this node's process count; every rank cuts its own share
    contender.share_rows = spec.per_device(world_size)
    contender.global_rows = spec.per_device(world_size) * world_size
    for _ in range(spec.warmup):
        contender.step()
    times = [contender.step() for _ in range(spec.steps)]
    phase_seconds = contender.observe(spec.observed_steps)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"times": times, "phase_seconds": phase_seconds}))
    contender.close()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m dpkit.tools.bench.processes",
        description="dpkit bench's worker for a strategy with a process per device (started by the launcher)",
    )
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), required=True)
    arguments = parser.parse_args()
    code = worker_main(*arguments.worker)
    from dpkit.launch.worker import exit_worker

    exit_worker(code)
