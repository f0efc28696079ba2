"""replicated's optimizers. On GPUs (ReplicaOptimizers) the user's optimizer steps replica 0 and a clone
of it steps each other replica; on virtual CPU devices (SharedOptimizer) the replicas share replica 0's
parameters and the user's optimizer steps once, its parameters split among the replica threads."""

from __future__ import annotations

import bisect
import collections
import copy
import inspect
import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.optim.optimizer as torch_optimizer
from torch import nn

from dpkit.parallel import hooks
from dpkit.parallel.apply import run_replicas


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's defaults its constructor accepts (some defaults are not constructor arguments,
    e.g. AdamW's decoupled_weight_decay); every param group carries its own values anyway."""
    parameters = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in parameters}


def clone_optimizer(
    optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter], replica_params: Sequence[nn.Parameter]
) -> torch.optim.Optimizer:
    """The same optimizer (type, groups, hyperparameters, state) over `replica_params`, which correspond
    position by position to `params`, the parameters `optimizer` was built over."""
    position = {id(p): k for k, p in enumerate(params)}
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in position:
                raise ValueError(
                    f"optimizer: param_groups[{g}] holds a tensor that is not one of the model's parameters; "
                    "build the optimizer from model.parameters() and pass both to engine.setup(model, optimizer)"
                )
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [replica_params[position[id(p)]] for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]
    name = type(optimizer).__name__
    try:
        clone = type(optimizer)(groups, **_constructor_defaults(optimizer))
    except TypeError as error:
        raise TypeError(
            f"optimizer: strategy 'replicated' builds one {name} per replica as {name}(param_groups, **defaults), "
            f"which failed ({error}); use strategy='ddp' for this optimizer"
        ) from error
    clone.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return clone


def copy_hyperparameters(source_groups: Sequence[dict], target_groups: Sequence[dict]) -> None:
    """Every setting but the parameters, group by group (a scheduler's lr reaches the clones)."""
    for mine, theirs in zip(target_groups, source_groups):
        for key, value in theirs.items():
            if key != "params":
                mine[key] = value


def refuse_closure(closure: Callable | None) -> None:
    if closure is not None:
        raise TypeError("optimizer.step(closure): strategy 'replicated' steps every replica once and takes no closure")


class _UsersOptimizer:
    """What the user sees of replicated's optimizers: their own optimizer's groups, state and state dict."""

    user: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.user.param_groups

    @property
    def state(self) -> collections.defaultdict[torch.Tensor, Any]:  # (torch's: anything the optimizer keeps)
        return self.user.state

    @property
    def defaults(self) -> dict:
        return self.user.defaults

    def state_dict(self) -> dict:
        return self.user.state_dict()


class ReplicaOptimizers(_UsersOptimizer):
    """The user's optimizer (replica 0's) and a clone per other replica; step() steps each replica in its
    device's thread, after copying the user's hyperparameters (a scheduler's lr) to the clones."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], devices: Sequence[torch.device], threads: int | None):
        self.optimizers = optimizers
        self.user = optimizers[0]
        self.devices = list(devices)
        self.threads = threads

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable | None = None) -> None:
        refuse_closure(closure)
        for optimizer in self.optimizers[1:]:
            copy_hyperparameters(self.user.param_groups, optimizer.param_groups)

        def step_one(i: int) -> None:
            with hooks.replica_phase("optimizer"):
                self.optimizers[i].step()

        run_replicas(self.devices, step_one, generators=False, threads=self.threads)

    def load_state_dict(self, state_dict: dict) -> None:
        for optimizer in self.optimizers:
            optimizer.load_state_dict(copy.deepcopy(state_dict))


# torch.optim's optimizers whose step treats every parameter on its own (state keyed by the parameter,
# nothing computed across parameters): stepping disjoint shards of the parameters does the same arithmetic
# as one step over all of them. LBFGS (one state for all parameters, closures) is not one of them.
PER_PARAMETER = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adagrad",
        "Adadelta",
        "Adamax",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Rprop",
        "ASGD",
        "Adafactor",
    )
    if hasattr(torch.optim, name)
)


# the optimizers of PER_PARAMETER whose step is also elementwise inside a parameter: every state tensor of
# the parameter's shape is updated element by element, and the rest of its state (the step count) is the
# same for every element. Their parameters may be cut in pieces, each stepped with views of its state.
# (Adafactor's factored state is not elementwise.)
ELEMENTWISE = tuple(optimizer for optimizer in PER_PARAMETER if optimizer.__name__ != "Adafactor")

# below this many parameter elements the whole step is a few microsecond-sized kernels: handing shards to
# the replica threads costs more than it saves, and the user's optimizer steps whole on the calling thread
MIN_SHARDED_ELEMENTS = 1 << 20

# a cut inside a parameter falls on a multiple of this many elements from its start, so a vectorised kernel
# walks a piece in the same chunks as the whole tensor and computes the same bits; parameters under
# MIN_CUT_ELEMENTS are never cut (moving the cut to one of their edges unbalances the shards little)
CUT_ALIGN_ELEMENTS = 4096
MIN_CUT_ELEMENTS = 1 << 16


def balanced_shards(params: Sequence[torch.Tensor], shards: int) -> list[list[int]]:
    """Parameter positions in `shards` groups of about equal element count (largest first to the lightest
    group), each group in position order; groups left empty are dropped."""
    groups: list[list[int]] = [[] for _ in range(shards)]
    load = [0] * shards
    for position in sorted(range(len(params)), key=lambda k: (-params[k].numel(), k)):
        lightest = load.index(min(load))
        groups[lightest].append(position)
        load[lightest] += params[position].numel()
    return [sorted(group) for group in groups if group]


def even_runs(sizes: Sequence[int], shards: int, cuttable: Sequence[bool]) -> list[list[tuple[int, int, int]]]:
    """The parameters laid end to end in position order and cut into `shards` runs of about equal element
    count. Run k lists (position, lo, hi): elements lo:hi of that flattened parameter, (0, size) when whole.
    A cut falling inside a parameter that may not be cut (or is under MIN_CUT_ELEMENTS) moves to its
    nearer edge; runs left empty are dropped."""
    starts = list(itertools.accumulate(sizes, initial=0))
    total = starts[-1]
    cuts = [0]
    for k in range(1, shards):
        target = total * k // shards
        j = min(bisect.bisect_right(starts, target) - 1, len(sizes) - 1)
        start, size = starts[j], sizes[j]
        if cuttable[j] and size >= MIN_CUT_ELEMENTS:
            cut = min(start + round((target - start) / CUT_ALIGN_ELEMENTS) * CUT_ALIGN_ELEMENTS, start + size)
        else:
            cut = start if target - start < start + size - target else start + size
        cuts.append(max(cut, cuts[-1]))
    cuts.append(total)
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(shards)]
    for position, (start, size) in enumerate(zip(starts, sizes)):
        for k in range(shards):
            lo, hi = max(cuts[k], start), min(cuts[k + 1], start + size)
            if hi > lo:
                runs[k].append((position, lo - start, hi - start))
        if size == 0:  # an empty parameter still gets its (empty) state, in the run where it starts
            k = max(k for k in range(shards) if cuts[k] <= start)
            runs[min(k, shards - 1)].append((position, 0, 0))
    return [run for run in runs if run]


def _global_step_hooks() -> bool:
    """Whether torch.optim.optimizer.register_optimizer_step_pre_hook / _post_hook hooks are registered: they
    would see each shard optimizer instead of the user's, once per shard. dpkit's own observer's hooks are
    marked `dpkit_shard_aware` (they time each shard in its thread) and do not count."""
    hooks = [
        *getattr(torch_optimizer, "_global_optimizer_pre_hooks", {}).values(),
        *getattr(torch_optimizer, "_global_optimizer_post_hooks", {}).values(),
    ]
    return any(not getattr(hook, "dpkit_shard_aware", False) for hook in hooks)


class _SteppedPiece(NamedTuple):
    param: nn.Parameter
    size: int
    state: dict  # the piece's state after the step
    lent: dict  # what it was lent before (views of the user's tensors, copies of the rest)


def _piece_state(value: Any, param: torch.Tensor, lo: int, hi: int) -> Any:
    """A cut parameter's state entry for its piece lo:hi: a view of an elementwise tensor (updated in place
    in the user's state), a copy of anything else (the step count, the same in every piece)."""
    if isinstance(value, torch.Tensor):
        return value.view(-1)[lo:hi] if value.shape == param.shape else value.clone()
    return copy.copy(value)


class SharedOptimizer(_UsersOptimizer):
    """replicated on virtual CPU devices: every replica's parameters share replica 0's storage, so the
    user's optimizer steps once per step and every replica sees the result.

    That step runs on all the replica threads at once: the parameters are split into one shard per thread,
    and a shard optimizer (the user's type and hyperparameters over that shard) steps each, in the user's
    optimizer's own state dict, so optimizer.state_dict(), checkpoints and schedulers see one ordinary
    optimizer. Hyperparameters (a scheduler's lr) are copied from the user's groups before every step.
    For the ELEMENTWISE optimizers the shards are equal runs of elements, cutting a large parameter in
    pieces where needed (a piece steps views of the parameter, its gradient and its state); for the other
    PER_PARAMETER ones they are whole parameters, balanced by size. It is the same arithmetic. For other
    optimizers, for models under MIN_SHARDED_ELEMENTS parameters, or when step hooks are registered (on the
    user's optimizer or for every optimizer) or step() is replaced, the user's optimizer.step() runs whole
    on the calling thread.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        replica_params: Sequence[Sequence[nn.Parameter]],
        devices: Sequence[torch.device],
        threads: int | None,
    ):
        self.user = optimizer
        self.replica_params = [list(params) for params in replica_params]
        self.devices = list(devices)
        self.threads = threads
        self._layout: tuple | None = None  # the param groups (and cut parameters' storage) the shards were built for
        self._shards: list[tuple[torch.optim.Optimizer, list[int]]] = []  # (shard optimizer, its user group per group)
        self._pieces: list[tuple[torch.Tensor, nn.Parameter, int, int]] = []  # (piece, parameter, lo, hi) of cut ones

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.user.zero_grad(set_to_none=set_to_none)
        for params in self.replica_params[1:]:
            for p in params:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    def shardable(self) -> bool:
        """Whether the step may run in shards (see the class doc)."""
        optimizer = self.user
        step = vars(optimizer).get("step")  # an instance attribute: someone replaced step()
        elements = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
        return (
            len(self.devices) > 1
            and elements >= MIN_SHARDED_ELEMENTS
            and type(optimizer) in PER_PARAMETER
            and not optimizer._optimizer_step_pre_hooks
            and not optimizer._optimizer_step_post_hooks
            and not _global_step_hooks()
            and (step is None or getattr(step, "_wrapped_by_lr_sched", False))
        )

    def _layout_now(self) -> tuple:
        """What the shards depend on: the parameters of each group, and where the cut ones' storage is (a
        parameter whose .data was replaced needs new pieces)."""
        return (
            tuple(tuple(id(p) for p in group["params"]) for group in self.user.param_groups),
            tuple((id(p), p.data_ptr()) for _, p, _, _ in self._pieces),
        )

    def _build_shards(self) -> None:
        if self._layout_now() == self._layout:
            return
        groups = self.user.param_groups
        params = [p for group in groups for p in group["params"]]
        group_of = [g for g, group in enumerate(groups) for _ in group["params"]]
        if type(self.user) in ELEMENTWISE:
            cuttable = [p.dim() > 0 and p.is_contiguous() for p in params]
            runs = even_runs([p.numel() for p in params], len(self.devices), cuttable)
        else:
            runs = [[(k, 0, params[k].numel()) for k in shard] for shard in balanced_shards(params, len(self.devices))]
        self._shards, self._pieces = [], []
        for run in runs:
            chosen: dict[int, list[torch.Tensor]] = {}
            for position, lo, hi in run:
                p = params[position]
                if (lo, hi) != (0, p.numel()):
                    piece = p.detach().view(-1)[lo:hi]  # a leaf over the parameter's storage
                    self._pieces.append((piece, p, lo, hi))
                    p = piece
                chosen.setdefault(group_of[position], []).append(p)
            shard_groups = [
                {**{key: v for key, v in groups[g].items() if key != "params"}, "params": chosen[g]} for g in chosen
            ]
            shard = type(self.user)(shard_groups, **_constructor_defaults(self.user))
            self._shards.append((shard, list(chosen)))
        self._layout = self._layout_now()

    def _cut_now(self) -> bool:
        """Whether the cut parameters' gradients and state can be viewed piece by piece this step."""
        state = self.user.state
        for _, p, _, _ in self._pieces:
            if p.grad is not None and (
                p.grad.layout != torch.strided or p.grad.shape != p.shape or not p.grad.is_contiguous()
            ):
                return False
            for value in state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and value.shape == p.shape and not value.is_contiguous():
                    return False
        return True

    def step(self, closure: Callable | None = None) -> None:
        refuse_closure(closure)
        if not self.shardable():
            self.user.step()
            return
        self._build_shards()
        if not self._cut_now():  # a sparse or oddly laid out gradient or state: one whole step, as the user's
            self.user.step()
            return
        optimizer = self.user
        state, known = optimizer.state, len(optimizer.state)
        lent = self._lend_pieces(state)
        for shard, user_groups in self._shards:
            shard.state = state  # the user's entries, whatever load_state_dict put there last
            copy_hyperparameters([optimizer.param_groups[g] for g in user_groups], shard.param_groups)

        def step_shard(k: int) -> None:
            with hooks.replica_phase("optimizer"):
                self._shards[k][0].step()

        try:
            run_replicas(self.devices[: len(self._shards)], step_shard, generators=False, threads=self.threads)
        finally:
            self._take_back_pieces(state, lent)
        if len(state) != known:  # new entries arrived in thread order: keep the order one step would give
            ordered: collections.defaultdict[torch.Tensor, Any] = collections.defaultdict(dict)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p in state:
                        ordered[p] = state[p]
            ordered.update((key, value) for key, value in state.items() if key not in ordered)
            optimizer.state = ordered
        if getattr(vars(optimizer).get("step"), "_wrapped_by_lr_sched", False):
            # what the scheduler's wrapper of step() records (an attribute torch's Optimizer type does not declare)
            optimizer._opt_called = True  # type: ignore[attr-defined]

    def _lend_pieces(self, state: dict) -> dict:
        """Each piece of a cut parameter gets views of its gradient and state, as entries of its own in the
        user's state dict for the length of the step; returns what was lent."""
        lent = {}
        for piece, p, lo, hi in self._pieces:
            piece.grad = None if p.grad is None else p.grad.view(-1)[lo:hi]
            state[piece] = {key: _piece_state(value, p, lo, hi) for key, value in state.get(p, {}).items()}
            lent[piece] = dict(state[piece])
        return lent

    def _take_back_pieces(self, state: dict, lent: dict) -> None:
        """The pieces' entries leave the user's state; a cut parameter's state becomes the pieces' joined:
        elementwise tensors updated in place stay the user's, new or replaced ones are concatenated, the rest
        (the step count) comes from the first piece."""
        by_param: dict[int, list[_SteppedPiece]] = {}
        for piece, p, lo, hi in self._pieces:  # in lo order within each parameter
            piece.grad = None
            by_param.setdefault(id(p), []).append(_SteppedPiece(p, hi - lo, state.pop(piece, {}), lent.get(piece, {})))
        for parts in by_param.values():
            if not any(part.state for part in parts):
                continue  # no gradient this step: nothing was stepped or created
            joined: dict[str, Any] = {}
            for key in parts[0].state:
                values = [part.state.get(key) for part in parts]
                pieces = [
                    v
                    for v, part in zip(values, parts)
                    if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == part.size
                ]
                if len(pieces) == len(values):
                    if any(v is not part.lent.get(key) for v, part in zip(pieces, parts)):
                        joined[key] = torch.cat(pieces).view(parts[0].param.shape)
                    # else: views of the user's tensor, updated in place
                else:
                    joined[key] = values[0]
            state[parts[0].param].update(joined)  # the entry is created here if the parameter had no state yet

    def load_state_dict(self, state_dict: dict) -> None:
        self.user.load_state_dict(state_dict)
