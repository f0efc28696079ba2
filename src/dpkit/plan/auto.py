"""`strategy="auto"`: which strategy to train with on the devices given, and why, in one line.

    choice = choose_strategy(model, sample_batch, batch_size=32, devices=["cpu:0", "cpu:1"])
    print(choice.reason)   # auto: single — on this model a step is mostly operation launches (…); …
    choice.strategy, choice.devices, choice.candidates

Every strategy of the registry is a candidate: the reference on one device with the whole batch, the others on
every device given with the batch split across them. Each candidate gets a step time (the cost model's
prediction, or a measured one the caller passes in `step_seconds`) and its peak memory, and the rules below
choose, in this order:

1. One device: the reference strategy (single).
2. Never a strategy that does not fit in memory (the fullest device's peak within 90% of a GPU's memory; on
   virtual CPU devices, which share the host's memory, the devices' peaks together within 90% of it) or that
   cannot run at the precision asked (16-mixed needs a GradScaler).
3. A strategy with a process per device (ddp, fsdp) only when `can_launch` (the caller can start or has
   started the processes; on virtual CPU devices, at most 4 processes per core). Never one whose replicas train
   alone and meet every H steps (localsgd, diloco): they change the optimization (shown among the candidates, out).
4. The lightest sharding that fits (Traits: fewer parts of the state sharded, then a shard group of one node before
   every process; unsharded first): a more sharded strategy only when it is predicted at least 10% faster than
   every lighter one that fits (ddp before zero, zero before fsdp), or when nothing lighter fits.
5. Several devices only when they pay: the fastest multi-device candidate must take at most 1/1.1 of the
   reference's step for the same global batch (10% faster); otherwise the reference, with the reason (a step
   that is mostly operation launches, or what the others lose to communication and per-step work).
6. Among multi-device candidates within 10% of the fastest ("equals"): on GPUs one with a process per device
   (ddp), as PyTorch recommends over DataParallel, the least sharded of them, then the fastest; on virtual CPU
   devices the fastest one-process strategy (no processes to start, and the processes' edge on a GPU, no GIL, is
   small on shared cores).
7. When nothing fits: a ValueError naming what was tried and what would fit.

Where the step times come from:
- GPUs: the catalogue's figures for the GPU torch reports (its usual link), or `hardware=`; `calibration=` (a
  GPU bench's Calibration or bench JSONs) fits the host's constants.
- virtual CPU devices: `calibration=` (a Calibration, or `dpkit bench --json` files of this machine), else a probe
  of this machine on two small fixed models (plan/probe.py: about a second, once per process).
- `step_seconds={"single": 0.004, "dp": 0.009, ...}`: measured (or injected) step times of the same global
  batch, which replace the predictions for those strategies (tests use it to fix the numbers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpkit.devices import DeviceLike, parse_device
from dpkit.plan.advice_words import gib, phase_words
from dpkit.plan.advisor import LAUNCH_BOUND_SHARE, is_data_parallel
from dpkit.plan.auto_candidates import Candidate, make_candidate, model_profile, optimizer_name
from dpkit.plan.auto_machine import CalibrationSource, machine_for
from dpkit.plan.configuration import BatchSize, Hardware
from dpkit.plan.lightest_sharding import lightest_sharding, lightest_worthwhile
from dpkit.plan.periodic_sync import meets_periodically
from dpkit.plan.profiles import ModelProfile
from dpkit.strategies import ONE_PROCESS, PER_DEVICE, Traits, available_strategies, reference, strategy_class

PAYS = 1.1  # several devices must be this much faster than one (rule 5)
EQUALS = 1.1  # candidates within this factor of the fastest are equals (rule 6)
STATED_PHASES = ("scatter", "replicate", "gather", "reduce", "all_reduce", "all_gather", "reduce_scatter")


@dataclass
class Choice:
    """The strategy `auto` chose, on how many devices, the one-line reason, and every candidate it weighed."""

    strategy: str
    devices: int
    reason: str
    candidates: list[Candidate]
    hardware: str  # the hardware the step times are for, in words

    def __str__(self) -> str:
        return self.reason

    def candidate(self, strategy: str) -> Candidate | None:
        return next((c for c in self.candidates if c.strategy == strategy), None)

    def table(self) -> list[str]:
        """The candidates, one line each: step, memory, and why a candidate was out."""
        lines = [f"auto on {self.hardware}:"]
        for c in self.candidates:
            status = "chosen" if c.strategy == self.strategy else ("" if c.eligible else f"out: {c.note}")
            lines.append(
                f"  {c.strategy:<12} {c.devices:>2} dev  {c.step_seconds * 1e3:9.2f} ms ({c.source})  "
                f"peak {c.peak_bytes / 2**30:6.2f} GiB  {status}".rstrip()
            )
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "devices": self.devices,
            "reason": self.reason,
            "hardware": self.hardware,
            "candidates": [c.to_dict() for c in self.candidates],
        }


def choose_strategy(
    model: nn.Module | Callable[[], nn.Module] | ModelProfile,
    sample_input: torch.Tensor | Sequence[int] | None,
    batch_size: int,
    devices: Sequence[DeviceLike],
    precision: str = "32",
    optimizer: str | torch.optim.Optimizer = "sgd",
    can_launch: bool = True,
    calibration: CalibrationSource | None = None,
    *,
    hardware: Hardware | None = None,
    step_seconds: Mapping[str, float] | None = None,
    strategies: Sequence[str] | None = None,
) -> Choice:
    """The strategy to train `model` with on `devices`, by the rules of this module's docstring.

    model: the module (traced on the meta device: its weights are not touched), a factory, or a ModelProfile.
    sample_input: a batch of inputs (its first dimension is the batch; dtype kept) or one sample's shape; not
        needed with a ModelProfile.
    batch_size: the global batch, samples per optimizer step over all devices.
    optimizer: "sgd", "adam", "adamw", or the torch optimizer itself (its state counts in memory).
    devices: the devices given ("cpu:0", "cpu:1" are virtual CPU devices; ints and "cuda:N" are GPUs).
    can_launch: whether a strategy with a process per device may be chosen (the caller starts the processes).
    calibration: see the module docstring; hardware: the GPUs and link to plan for (instead of the catalogue's
        match for the GPUs torch reports); step_seconds: measured step times by strategy for this global batch;
        strategies: the candidates (default: every registered strategy).
    """
    parsed = _parse_devices(devices)
    count = len(parsed)
    _check_batch_size(batch_size, count)
    optimizer = optimizer_name(optimizer)
    names = _candidate_names(strategies)
    profile = model_profile(model, sample_input)
    machine, constants, described = machine_for(parsed, calibration, hardware)
    measured = dict(step_seconds or {})
    unknown = sorted(set(measured) - set(names))
    if unknown:
        raise ValueError(f"step_seconds: {unknown[0]!r} is not one of the candidates ({', '.join(names)})")
    batch = BatchSize(batch_size, per_device=False)
    one_device = reference()
    candidates = [
        make_candidate(name, count, profile, machine, constants, batch, precision, optimizer, can_launch, measured)
        for name in names
        if name == one_device or count > 1
    ]
    if count == 1:
        alone = candidates[0]
        if not alone.eligible:
            raise ValueError(f"strategy: auto found nothing that fits on the one device given: {alone.note}")
        return Choice(one_device, 1, f"auto: {one_device} — one device", candidates, described)
    chosen, reason = decide(candidates, on_gpu=parsed[0].type != "cpu")
    return Choice(chosen.strategy, chosen.devices, reason, candidates, described)


def _check_batch_size(batch_size: int, devices: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected a positive number of samples per step, got {batch_size!r}")
    if devices > 1 and batch_size < devices:
        raise ValueError(
            f"batch_size: {batch_size} samples cannot give each of the {devices} devices one; give at least {devices}"
        )


def _candidate_names(strategies: Sequence[str] | None) -> list[str]:
    """The strategies asked (default: every registered one), each checked, with the reference first if missing."""
    names = list(strategies) if strategies is not None else available_strategies()
    for name in names:
        strategy_class(name, argument="strategies")
    one_device = reference()
    if one_device not in names:
        names.insert(0, one_device)
    return names


def decide(candidates: list[Candidate], on_gpu: bool) -> tuple[Candidate, str]:
    """Rules 2-7 over candidates with their step times: (the chosen one, the reason in one line)."""
    one_device = reference()
    eligible = [c for c in candidates if c.eligible]
    if not eligible:
        raise ValueError("strategy: auto found no strategy that fits and can run: " + _nothing_fits(candidates))
    single = next((c for c in eligible if c.strategy == one_device), None)
    multi = [c for c in eligible if c.strategy != one_device]
    pool, notes = _lightest_pool(single, multi, candidates)
    fastest = min(pool, key=lambda c: c.step_seconds, default=None)
    if single is not None and (fastest is None or fastest.step_seconds * PAYS > single.step_seconds):
        return single, f"auto: {one_device} — " + _why_one_device(single, fastest, candidates)
    if fastest is None:  # only the reference could have run, and it does not fit
        raise ValueError("strategy: auto found no strategy that fits and can run: " + _nothing_fits(candidates))
    equals = sorted((c for c in pool if c.step_seconds <= fastest.step_seconds * EQUALS), key=lambda c: c.step_seconds)
    chosen = _among_equals(equals, on_gpu, notes)
    if single is not None:
        gain = f"{single.step_seconds / chosen.step_seconds:.2f}x {one_device}'s throughput ({chosen.source})"
    else:
        gain = f"{one_device} does not fit ({gib(_reference_peak(candidates))} needed)"
    held_back = [
        c.strategy
        for c in candidates
        if c.fits
        and c.runs
        and not c.allowed
        and c.step_seconds < chosen.step_seconds
        and c.strategy != one_device
        and not meets_periodically(c.strategy)
    ]
    if held_back:
        notes.append(f"{held_back[0]} would be faster but needs a process per device (can_launch=False)")
    reason = f"auto: {chosen.strategy} on {chosen.devices} devices — {gain}"
    return chosen, reason + "".join(f"; {note}" for note in notes)


def _among_equals(equals: list[Candidate], on_gpu: bool, notes: list[str]) -> Candidate:
    """Rule 6 over the candidates within EQUALS of the fastest (fastest first): on GPUs one with a process per
    device, the least sharded of them; on virtual CPU devices the fastest in one process. A note when that is not
    the fastest."""
    chosen = equals[0]
    if on_gpu:
        per_device = sorted(
            (c for c in equals if _traits(c).processes == PER_DEVICE),
            key=lambda c: (_sharding(c), c.step_seconds),
        )
        if per_device and per_device[0] is not chosen:
            notes.append(
                f"{per_device[0].strategy} preferred on GPUs (a process per device, no GIL) to {chosen.strategy}, "
                "within 10% of it"
            )
            chosen = per_device[0]
    else:
        in_process = [c for c in equals if _traits(c).processes == ONE_PROCESS]
        if in_process and in_process[0] is not chosen:
            notes.append(f"{in_process[0].strategy} starts no processes; {chosen.strategy} is within 10%")
            chosen = in_process[0]
    return chosen


# ---- the pieces ---------------------------------------------------------------------------------------------


def _traits(candidate: Candidate) -> Traits:
    return strategy_class(candidate.strategy).traits


def _sharding(candidate: Candidate) -> tuple[int, int]:
    return lightest_sharding(_traits(candidate), candidate.devices, candidate.devices)


def _lightest_pool(
    single: Candidate | None, multi: list[Candidate], candidates: list[Candidate]
) -> tuple[list[Candidate], list[str]]:
    """Rule 4: the multi-device candidates of the lightest sharding that fits (the reference, one device, counts as
    unsharded), with every more sharded one that is 10% faster than all the lighter ones that fit (SHARDING_WORTH,
    as in the advisor); and a note when nothing unsharded fits."""
    whole = [single] if single is not None else []
    pool = [c for c in lightest_worthwhile(whole + multi, _sharding, lambda c: c.step_seconds) if c is not single]
    notes: list[str] = []
    lightest = min((_sharding(c) for c in whole + multi), default=(0, 1))
    if lightest[0] > 0:
        unfit = [c for c in candidates if not c.fits and _sharding(c) < lightest]
        notes.append(
            "nothing unsharded fits"
            + (
                f" ({unfit[0].strategy} needs {gib(unfit[0].peak_bytes)} of {gib(unfit[0].usable_bytes)})"
                if unfit
                else ""
            )
        )
    return pool, notes


def _parse_devices(devices: Sequence[DeviceLike]) -> list[torch.device]:
    if isinstance(devices, (str, int, torch.device)) or not isinstance(devices, Sequence) or not devices:
        raise ValueError(f"devices: expected a list of devices such as ['cpu:0', 'cpu:1'] or [0, 1], got {devices!r}")
    parsed = [parse_device(spec, argument=f"devices[{i}]") for i, spec in enumerate(devices)]
    kinds = {device.type for device in parsed}
    if len(kinds) > 1 or kinds - {"cpu", "cuda"}:
        raise ValueError(f"devices: expected only virtual CPU devices or only CUDA devices, got {sorted(kinds)}")
    return parsed


def _launch_share(candidate: Candidate) -> float:
    launches = candidate.breakdown.get("launch", 0.0) + candidate.breakdown.get("overhead", 0.0)
    total = sum(candidate.breakdown.values())
    return launches / total if total > 0 else 0.0


def _why_one_device(single: Candidate, fastest: Candidate | None, candidates: list[Candidate]) -> str:
    """Why the reference: launch-bound, or what the fastest multi-device candidate loses."""
    if fastest is None:
        out = [c for c in candidates if c.strategy != single.strategy]
        return "no multi-device strategy fits or may run here" + (f" ({out[0].strategy}: {out[0].note})" if out else "")
    ratio = fastest.step_seconds / single.step_seconds
    compared = (
        f"{fastest.strategy} on {fastest.devices} devices would take {ratio:.2f}x {single.strategy}'s step"
        if ratio >= 1
        else f"{fastest.strategy} on {fastest.devices} devices would be only {1 / ratio:.2f}x faster, "
        f"under the {PAYS:.1f}x that pays for more devices"
    )
    dp = min(
        (c for c in candidates if is_data_parallel(_traits(c)) and c.fits and c.runs),
        key=lambda c: c.step_seconds,
        default=None,
    )
    if dp is not None and dp is not fastest:
        compared += f", {dp.strategy} {dp.step_seconds / single.step_seconds:.2f}x"
    sources = {c.source for c in (single, fastest, dp) if c is not None}
    compared += f" ({' and '.join(sorted(sources))})"
    share = _launch_share(single)
    if share >= LAUNCH_BOUND_SHARE:
        return f"on this model a step is mostly operation launches ({share:.0%} of it); {compared}"
    lost = _lost(fastest)
    return compared + (f": it spends {lost}" if lost else "")


def _lost(candidate: Candidate) -> str:
    """The per-step work the candidate adds beyond computing, largest first."""
    step = sum(candidate.breakdown.values())
    parts = sorted(
        ((seconds, name) for name, seconds in candidate.breakdown.items() if name in STATED_PHASES + ("launch",)),
        reverse=True,
    )
    words = phase_words(candidate.strategy)
    shown = [f"{words.get(name, name)} {seconds / step:.0%}" for seconds, name in parts[:2] if seconds / step >= 0.05]
    return ", ".join(shown)


def _reference_peak(candidates: list[Candidate]) -> float:
    return next((c.peak_bytes for c in candidates if c.strategy == reference()), 0)


def _nothing_fits(candidates: list[Candidate]) -> str:
    parts = [f"{c.strategy} on {c.devices}: {c.note or 'excluded'}" for c in candidates]
    return "; ".join(parts) + "; try a smaller batch_size, more devices, or can_launch=True for fsdp"


__all__ = ["Choice", "choose_strategy", "decide"]
