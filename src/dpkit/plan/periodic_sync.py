"""Replicas trained alone that meet every H steps (localsgd, diloco: strategies/periodic.py) in the cost model.

Such a strategy exchanges no gradient in a step: each process trains its replica on its rows with its own optimizer,
and every H = Traits.sync_every optimizer steps the replicas meet. The cost model predicts the step averaged over a
period: every step computes and steps its optimizer as ddp's does, and carries 1/H of the meeting:

    all_reduce   the all-reduce of every weight's move since the last meeting (4P bytes, or what the compression
                 leaves: compression_cost.wire_fraction; one collective, PowerSGD's two), and three of a few bytes
                 (the rows trained, the step marks, the spread), all after the optimizer step: nothing hides them
    compress     the compression's own work on the moves, as on a step's gradients
    meeting      the meeting's own passes over the weights (the moves, their average, the spread, the new weights
                 copied into the replica and the anchor) and an outer optimizer's step (diloco), with their launches

Memory beyond the replica's weights, gradients and optimizer state: no DDP gradient buckets; the anchor, the weights
shared at the last meeting (4P); an outer optimizer's weights, the pseudo-gradient torch keeps on them until the
next meeting, and its momentum (diloco: 12P, 8P with outer_momentum=0); and at the meeting its buffers (about four
float32 copies of the weights), which take the place of the step's activations, freed by then.

What makes a strategy one of these is read from its options, not its traits: at sync_every=1 localsgd's traits are
ddp's, yet its optimization is not (each replica's optimizer steps on its own rows' gradient), so the option that
sets the period is what tells them apart. The formulas and their sources are in docs/cost-model.md, "Synchronizing
every H steps".
"""

from __future__ import annotations

import inspect

from dpkit.plan.communication import collective_link
from dpkit.plan.compression_cost import all_reduced_whole, compression_seconds, wire_fraction
from dpkit.plan.configuration import Setup
from dpkit.plan.profiles import FP32_BYTES
from dpkit.plan.transfers import ring_all_reduce_seconds
from dpkit.strategies import available_strategies, strategy_class

PERIOD_OPTION = "sync_every"  # the option of a strategy whose replicas meet every H steps
OUTER_OPTIMIZER_OPTION = "outer_momentum"  # the option of one whose meeting is an outer optimizer's step
# bytes read and written per float32 weight by a meeting (periodic.py's sync): the move (p - anchor, times the rows'
# share: 12 + 8), its flat copy and the copy the all-reduce sums in (8 + 8), the division by the processes (8), the
# average (anchor + move: 12), the spread (|p - average| and its max: 24; |average| and its max: 12), localsgd's new
# weights (anchor + move: 12), and the copies into the replica and the anchor (8 + 8)
MEETING_TRAFFIC_BYTES_PER_PARAMETER = 120
# an outer SGD step with Nesterov momentum instead of the plain average (diloco's meet): the anchor copied into the
# outer weights (8) and the pseudo-gradient made (8), the momentum's update (8 + 12), Nesterov's look-ahead (12), the
# weights' update (12), the new weights cloned (8), less the plain average's 12 it replaces
OUTER_STEP_TRAFFIC_BYTES_PER_PARAMETER = 56
# kernels per parameter tensor: the move (2), the average (1), the spread (5), the new weights (1), the two copies;
# an outer step adds the copy, the negation, four for SGD with momentum, the clone
MEETING_KERNELS_PER_TENSOR = 11
OUTER_STEP_KERNELS_PER_TENSOR = 7
SMALL_ALL_REDUCES = 3  # the rows each process trained in the period, the step marks, every process's spread
MEETING_BUFFER_COPIES = 4  # the moves, and the exchange's flat copies or the average and the new weights, at once


def meets_periodically(strategy: str) -> bool:
    """The strategy's replicas train alone and meet every Traits.sync_every optimizer steps: it takes the period
    as an option (see the module doc)."""
    return PERIOD_OPTION in strategy_class(strategy).options


def periodic_strategies() -> list[str]:
    """Every registered strategy whose replicas meet every H steps, in the registry's order."""
    return [name for name in available_strategies() if meets_periodically(name)]


def outer_optimizer_copies(setup: Setup) -> int:
    """Float32 copies of the weights an outer optimizer keeps between meetings: its weights, the pseudo-gradient
    torch keeps on them after the step, and its momentum buffer (none at outer_momentum=0, as torch's SGD)."""
    cls = strategy_class(setup.strategy)
    if not meets_periodically(setup.strategy) or OUTER_OPTIMIZER_OPTION not in cls.options:
        return 0
    momentum = setup.options.get(OUTER_OPTIMIZER_OPTION, _default(cls, OUTER_OPTIMIZER_OPTION))
    return 2 + (1 if momentum is None or float(momentum) != 0 else 0)


def _default(cls: type, option: str) -> object:
    """The default the strategy's constructor gives an option (None when it has none to read)."""
    parameter = inspect.signature(cls).parameters.get(option)
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def anchor_bytes(setup: Setup) -> float:
    """The weights every replica shared at the last meeting, kept in float32 to measure each move from."""
    return float(FP32_BYTES * setup.profile.parameters) if meets_periodically(setup.strategy) else 0.0


def outer_optimizer_bytes(setup: Setup) -> float:
    return float(outer_optimizer_copies(setup) * FP32_BYTES * setup.profile.parameters)


def meeting_buffer_bytes(setup: Setup) -> float:
    """What a meeting allocates at its peak (MEETING_BUFFER_COPIES float32 copies of the weights), after the
    optimizer step: the step's activations are freed by then, its gradients are not (the next zero_grad frees them)."""
    if not meets_periodically(setup.strategy):
        return 0.0
    return float(MEETING_BUFFER_COPIES * FP32_BYTES * setup.profile.parameters)


def meeting_seconds(setup: Setup, memory_rate: float, flops_rate: float, launch_seconds: float) -> dict[str, float]:
    """One meeting's phases (the module doc), divided by the period: what each step carries of it. `memory_rate`,
    `flops_rate` and `launch_seconds`: one device's, as the step's other terms see them."""
    period = setup.traits.sync_every
    processes = setup.processes
    link = collective_link(setup)
    moves_bytes = setup.profile.parameter_bytes * wire_fraction(setup)
    collectives = 2 if all_reduced_whole(setup.compression) else 1  # PowerSGD: the packed P's, then the Q's
    exchange = ring_all_reduce_seconds(link, moves_bytes, processes, messages=collectives)
    exchange += SMALL_ALL_REDUCES * ring_all_reduce_seconds(link, 8 * processes, processes)
    phases = {"all_reduce": exchange / period, "meeting": own_work_seconds(setup, memory_rate, launch_seconds) / period}
    if setup.compression.compresses and processes > 1:
        phases["compress"] = compression_seconds(setup, memory_rate, flops_rate, launch_seconds) / period
    return phases


def own_work_seconds(setup: Setup, memory_rate: float, launch_seconds: float) -> float:
    """The meeting's passes over the weights at the device's memory rate, plus its launches: the spread reads one
    number back per parameter tensor (a sync with the host), so launching and computing add up."""
    profile = setup.profile
    outer = outer_optimizer_copies(setup) > 0
    traffic = MEETING_TRAFFIC_BYTES_PER_PARAMETER + (OUTER_STEP_TRAFFIC_BYTES_PER_PARAMETER if outer else 0)
    kernels = MEETING_KERNELS_PER_TENSOR + (OUTER_STEP_KERNELS_PER_TENSOR if outer else 0)
    return traffic * profile.parameters / memory_rate + kernels * max(1, profile.parameter_tensors) * launch_seconds
