"""DataParallel's replicas kept between calls: the module objects are reused, the weights broadcast anew.

A replica is a new object for every submodule, with a copy of its attribute dict and of each of its hook
dicts and other containers (replicate.py). For a model of many small layers that is most of a step's
`replicate` time, and it is the same every step. `ReplicaCache` keeps each device's replica tree (the
"skeleton") and, at every call:

1. checks that the user's module tree is exactly as it was when the skeletons were built, and rebuilds them
   otherwise (see `TreeSignature`: every module's class, its attribute dict, key by key with the values
   compared by identity, the keys and objects of its parameters, buffers and children, and the contents of
   its hook dicts and other containers). So `.train()`/`.eval()`, a new or replaced parameter, buffer or
   submodule, a hook added or removed, a parametrization, `weight_norm`, `spectral_norm`, a new attribute
   value or a changed class all give new skeletons, built as `replicate` builds them;
2. puts every replica module's attribute dict back to what it was when built, so that whatever a forward
   set on a replica (attributes, flags, caches) is gone at the next call, as on a new replica; and checks
   that no forward changed what a replica owns (its copies of the hook dicts and other containers: a hook
   registered inside a replica; its children; its parameter and buffer slots), else rebuilds that device's
   skeleton;
3. gives the replicas this call's tensors, as `replicate` would: on the source device the parameters
   themselves as differentiable views and the buffers themselves, elsewhere new copies, so device 0's
   weights are broadcast at every call and the optimizer's steps, `load_state_dict`, `requires_grad_`,
   `.to()`/`.half()` and any in-place change are always seen. On virtual CPU devices, in grad mode, the
   parameters that require grad go to every device through one autograd node (`BroadcastParameters`), whose
   backward sums each parameter's gradients over the replicas in one foreach call and hands the parameter
   the sum once: per-parameter aliases and copies would be two nodes per parameter in the backward graph
   and one more accumulation per replica. A call's copies stay in the replicas until the next call takes the
   cache (`acquire` drops them before making new ones, so no device holds two calls' copies): gradient
   checkpointing recomputes a forward in backward, after the call, on the replica modules, and needs their
   weights there, as torch's fresh replicas, kept alive by the checkpoint, have theirs. They are alive
   during the call's forward and backward anyway, so no device's peak grows; between steps the devices
   other than the source keep one copy of the weights they held in the step.

One call at a time uses the cache: a second, concurrent call (another thread, or a forward that calls its own
wrapper) builds fresh replicas instead.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Collection, Sequence
from itertools import chain, compress
from typing import Any

import torch
from torch import nn

from dpkit.parallel import hooks
from dpkit.parallel.replicate import (
    RNN_CONTAINERS,
    TensorCopier,
    check_replicable,
    needs_check,
    point_rnn_at_replica_weights,
    replicate_tree,
)

_dict_of = operator.attrgetter("__dict__")
_INNER = ("_parameters", "_buffers", "_modules")
_inner_of = operator.itemgetter(*_INNER)
_is_cpu = operator.attrgetter("is_cpu")
_requires_grad = operator.attrgetter("requires_grad")
_is_sparse = operator.attrgetter("is_sparse")
# what the calls fill (children are compared on their own), and RNN weight lists (pointed at the replica's)
_REFILLED = RNN_CONTAINERS | {"_parameters", "_buffers", "_former_parameters", "_modules"}


def _containers(module_dicts: Sequence[dict], skip: frozenset[str]) -> list[Collection[object]]:
    """Every dict, list or set held directly in the modules' attribute dicts (hook dicts, ...), but `skip`."""
    return [
        value
        for state in module_dicts
        for name, value in state.items()
        if name not in skip and isinstance(value, (dict, list, set))
    ]


def _content(container: Collection[object]) -> tuple:
    if isinstance(container, dict):
        return id(container), tuple(container), tuple(map(id, container.values()))
    if isinstance(container, list):
        return id(container), tuple(map(id, container))
    return id(container), frozenset(container)  # a set of names (non-persistent buffers)


def _fill(containers: Sequence[Collection[object]]) -> tuple[tuple[int, ...], tuple]:
    """The containers' lengths, and what the non-empty ones hold (keys, and values by identity). Almost all
    are empty, so only the lengths are taken for every one, at C speed."""
    lengths = tuple(map(len, containers))
    return lengths, tuple(map(_content, compress(containers, lengths)))


class TreeSignature:
    """What a module tree is, compared at every call in a few bulk operations over its modules' attribute dicts:
    every module's class and dict, every attribute's name and value (by identity), the names and objects of
    its parameters, buffers and children, and the lengths of its hook dicts and other containers, with the
    contents of the few that are not empty. Holds the values it compares, so no identity is reused meanwhile."""

    def __init__(self, originals: Sequence[nn.Module]):
        self.originals = list(originals)
        self.types = tuple(map(type, self.originals))
        self.dicts = list(map(_dict_of, self.originals))
        self.names = tuple(chain.from_iterable(self.dicts))
        self.values = tuple(chain.from_iterable(map(dict.values, self.dicts)))
        inner = list(chain.from_iterable(map(_inner_of, self.dicts)))
        self.inner_names = tuple(chain.from_iterable(inner))
        self.inner_values = tuple(chain.from_iterable(map(dict.values, inner)))
        self.containers = _containers(self.dicts, frozenset(_INNER))
        self.filled = _fill(self.containers)

    def unchanged(self) -> bool:
        try:
            originals = self.originals
            dicts = list(map(_dict_of, originals))
            if not (all(map(operator.is_, dicts, self.dicts)) and tuple(map(type, originals)) == self.types):
                return False
            # the names first: then both sides have as many values, which `is` compares pairwise
            if tuple(chain.from_iterable(dicts)) != self.names:
                return False
            if not all(map(operator.is_, chain.from_iterable(map(dict.values, dicts)), self.values)):
                return False
            inner = list(chain.from_iterable(map(_inner_of, dicts)))
            if tuple(chain.from_iterable(inner)) != self.inner_names:
                return False
            if not all(map(operator.is_, chain.from_iterable(map(dict.values, inner)), self.inner_values)):
                return False
            return _fill(self.containers) == self.filled
        except Exception:  # a module whose containers are not what nn.Module makes: never reuse
            return False


class _Skeleton:
    """One device's replica tree between calls: its module objects, their attribute dicts as built, and where
    each tensor goes."""

    def __init__(self, tree: _Tree, is_source: bool):
        self.modules = replicate_tree(tree.originals, _NoTensors())  # refresh() puts each call's tensors in
        self.dicts = list(map(_dict_of, self.modules))
        for state in self.dicts:  # a plain dict: emptied after every call, where an OrderedDict is slower
            state["_former_parameters"] = dict(state["_former_parameters"])
        self.built = [dict(state) for state in self.dicts]
        self.children = [state["_modules"] for state in self.dicts]
        position = {id(tensor): k for k, tensor in enumerate(tree.tensors)}
        none = len(tree.tensors)  # made[none] is None
        # a replica's slots (its dicts of parameters, former parameters and buffers: tensors, where torch's types
        # say Parameters, as a replica holds non-leaf tensors) and the position of what goes in each in `made`
        self.parameter_slots: list[tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor | None], str, int]] = []
        self.buffer_slots: list[tuple[dict[str, torch.Tensor | None], str, int]] = []
        self.tensor_dicts: list[dict[str, torch.Tensor | None]] = []
        for original, state in zip(tree.originals, self.dicts):
            params, buffers = original._parameters, original._buffers
            replica_params, former, replica_buffers = (
                state["_parameters"],
                state["_former_parameters"],
                state["_buffers"],
            )
            for name, p in params.items():
                self.parameter_slots.append((replica_params, former, name, none if p is None else position[id(p)]))
            for name, b in buffers.items():
                self.buffer_slots.append((replica_buffers, name, none if b is None else position[id(b)]))
            self.tensor_dicts += [replica_params, former, replica_buffers]
        # emptied after each call where they hold copies (the source's aliases and buffers take no memory)
        self.filled = [d for d in self.tensor_dicts if d] if not is_source else []
        self.rnns = [replica for replica in self.modules if isinstance(replica, nn.RNNBase)]
        # what the replicas own: copies of the originals' containers (hook dicts, ...) and children
        self.containers = _containers(self.dicts, _REFILLED)
        self.filled_as_built = _fill(self.containers)
        self.child_names = tuple(chain.from_iterable(self.children))
        self.child_values = tuple(chain.from_iterable(map(dict.values, self.children)))
        self.release()
        self.sizes = tuple(map(len, self.tensor_dicts))

    def intact(self) -> bool:
        """No forward changed what the replicas own since they were built: containers, children, and the sizes
        of the dicts of tensors (a parameter or buffer registered on a replica)."""
        try:
            return (
                tuple(chain.from_iterable(self.children)) == self.child_names
                and all(map(operator.is_, chain.from_iterable(map(dict.values, self.children)), self.child_values))
                and tuple(map(len, self.tensor_dicts)) == self.sizes
                and _fill(self.containers) == self.filled_as_built
            )
        except Exception:
            return False

    def release(self) -> None:
        """Drop the last call's copies: they die with its graph, as a new replica's would."""
        for tensors in self.filled:
            tensors.clear()
        for replica in self.rnns:
            replica.__dict__["_flat_weights"] = []
            replica.__dict__["_flat_weight_refs"] = []

    def refresh(self, made: list[torch.Tensor | None]) -> nn.Module:
        """The replica root with its attribute dicts as built and `made` (this call's tensors, in the order of
        the tree's tensors, then None) in its slots."""
        for state, built in zip(self.dicts, self.built):
            state.clear()
            state.update(built)
        for params, former, name, k in self.parameter_slots:
            params[name] = former[name] = made[k]
        for buffers, name, k in self.buffer_slots:
            buffers[name] = made[k]
        for replica in self.rnns:
            point_rnn_at_replica_weights(replica)
        return self.modules[0]


class BroadcastParameters(torch.autograd.Function):
    """Device 0's trainable parameters to every replica on virtual CPU devices, as one autograd node.

    Forward gives the source device's replica the parameters themselves (autograd makes them views: the same
    storage) and every other replica copies. Backward sums each parameter's gradients over the replicas, in
    replica order, in one foreach call, and hands the parameter its sum once. Per-parameter aliases and copies
    would each be a node of the backward graph, and each replica's gradient a separate accumulation into the
    parameter: for a model of many small layers, a large part of the backward."""

    @staticmethod
    def forward(ctx: Any, plan: tuple[tuple[torch.device, bool], ...], *params: torch.Tensor) -> tuple:
        ctx.set_materialize_grads(False)  # a parameter no replica used keeps no gradient, as on one device
        ctx.replicas = len(plan)
        out: list[torch.Tensor] = []
        for device, is_source in plan:
            with hooks.phase("replicate", device):  # each device's copies on its own books
                out.extend(params if is_source else [p.clone() for p in params])
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        n = len(grads) // ctx.replicas
        present = [grad for grad in grads if grad is not None]
        if len(present) == len(grads) and not any(map(_is_sparse, present)):
            summed: list[torch.Tensor] | tuple[torch.Tensor, ...] = present[:n]
            for k in range(1, ctx.replicas):
                summed = torch._foreach_add(summed, present[k * n : (k + 1) * n])
            return (None, *summed)
        columns = [list(grads[k * n : (k + 1) * n]) for k in range(ctx.replicas)]
        total = columns[0]
        for column in columns[1:]:
            total = [a if b is None else b if a is None else a + b for a, b in zip(total, column)]
        return (None, *total)


class _NoTensors:
    """Builds a skeleton: its tensor slots are filled by each call."""

    def parameter(self, tensor: torch.Tensor) -> None:
        return None

    def buffer(self, tensor: torch.Tensor) -> None:
        return None


class _Tree:
    """The user's module tree as the skeletons were built from it."""

    def __init__(self, module: nn.Module):
        originals = list(module.modules())  # each shared submodule once, so sharing is kept
        if needs_check(originals):
            check_replicable(module)
        self.originals = originals
        self.signature = TreeSignature(originals)
        # each tensor once (tied weights stay tied), parameters first: the order of make() and of the slots
        seen: dict[int, bool] = {}
        for original in originals:
            for tensors, is_parameter in ((original._parameters, True), (original._buffers, False)):
                for tensor in tensors.values():
                    if tensor is not None and id(tensor) not in seen:
                        seen[id(tensor)] = is_parameter
        everything = {
            id(t): t for m in originals for t in (*m._parameters.values(), *m._buffers.values()) if t is not None
        }
        self.parameters = [everything[key] for key, is_parameter in seen.items() if is_parameter]
        self.buffers = [everything[key] for key, is_parameter in seen.items() if not is_parameter]
        self.tensors = self.parameters + self.buffers
        self.has_sync_batchnorm = any(isinstance(m, nn.SyncBatchNorm) for m in originals)
        self.skeletons: dict[tuple[str, bool], _Skeleton] = {}

    def make(self, plan: Sequence[tuple[torch.device, bool]], detach: bool) -> list[list[torch.Tensor | None]]:
        """This call's tensors for each device of `plan` ((device, is_source) pairs), each list in the order of
        `tensors`, then None. On virtual CPU devices in grad mode the trainable parameters go through one
        BroadcastParameters; elsewhere each tensor is aliased or copied as `replicate` does (the module's
        tensors are all on the source device: DataParallel checked)."""
        copiers = [TensorCopier(device, is_source, detach) for device, is_source in plan]
        params = self.parameters
        trainable = list(map(_requires_grad, params))
        broadcast = (
            not detach
            and torch.is_grad_enabled()
            and all(device.type == "cpu" for device, _ in plan)
            and any(trainable)
        )
        made: list[list[torch.Tensor | None]]
        if not broadcast:
            made = []
            for copier in copiers:
                with hooks.phase("replicate", copier.device):
                    made.append([copier.parameter(p) for p in params])
        else:
            chosen = list(compress(params, trainable))
            out = BroadcastParameters.apply(tuple(plan), *chosen)
            n = len(chosen)
            made = [list(out[k * n : (k + 1) * n]) for k in range(len(plan))]
            if n < len(params):  # frozen parameters: plain aliases and copies, no gradient to carry
                for k, copier in enumerate(copiers):
                    through = iter(made[k])
                    made[k] = [next(through) if flag else copier.parameter(p) for p, flag in zip(params, trainable)]
        for tensors, copier in zip(made, copiers):
            if self.buffers:
                with hooks.phase("replicate", copier.device):
                    tensors += [copier.buffer(b) for b in self.buffers]
            tensors.append(None)
        return made


class ReplicaCache:
    """The replicas of one module, kept between calls (see the module docstring). DataParallel holds one.

    cache = ReplicaCache(module)
    if cache.acquire():              # False while another call uses it: build fresh replicas then
        try:
            replicas = [cache.replica(device, device == source) for device in devices]
            ...                      # run them
        finally:
            cache.release()
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self._tree: _Tree | None = None
        self._lock = threading.Lock()
        self.builds = 0  # skeletons built: a test and a benchmark read it
        self._in_use: list[_Skeleton] = []  # the skeletons this call filled
        self._holding: list[_Skeleton] = []  # the skeletons the last call filled, still holding its tensors

    def __reduce__(self) -> tuple:
        # a copied or pickled wrapper gets an empty cache of its own module (deepcopy maps the module through)
        return (type(self), (self.module,))

    def acquire(self) -> bool:
        """Take the cache for one call and check the module (rebuilding what changed); False when another
        call holds it."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            # the last call's copies go before this call makes its own (their graph keeps what it still needs)
            holding, self._holding = self._holding, []
            for skeleton in holding:
                skeleton.release()
            tree = self._tree
            if tree is None or not tree.signature.unchanged():
                self._tree = _Tree(self.module)
        except BaseException:
            self._lock.release()
            raise
        return True

    def release(self) -> None:
        """After the call: let the next call in. The replicas keep this call's tensors until the next acquire(),
        for a backward that recomputes the forward on them (gradient checkpointing)."""
        try:
            if not torch.is_grad_enabled():  # no backward will recompute this call's forward
                for skeleton in self._in_use:
                    skeleton.release()
                self._in_use = []
        finally:
            self._holding, self._in_use = self._in_use, []
            self._lock.release()

    def _acquired(self) -> _Tree:
        """The module's tree, checked by acquire()."""
        if self._tree is None:
            raise RuntimeError("ReplicaCache: call acquire() before using the cache")
        return self._tree

    def all_on(self, device: torch.device) -> bool:
        """Whether every parameter and buffer is on `device` (a CPU tensor is on every virtual CPU device)."""
        tensors = self._acquired().tensors
        if device.type == "cpu":
            return all(map(_is_cpu, tensors))
        return all(t.device == device for t in tensors)

    @property
    def has_sync_batchnorm(self) -> bool:
        return self._acquired().has_sync_batchnorm

    def replicas(self, devices: Sequence[torch.device], source: torch.device, detach: bool = False) -> list[nn.Module]:
        """A replica for each device, with this call's tensors (between acquire and release). Each device's
        share is announced as its "replicate" phase on the observation seam."""
        tree = self._acquired()
        plan = [(device, device == source) for device in devices]
        made = tree.make(plan, detach)
        out = []
        for (device, is_source), tensors in zip(plan, made):
            with hooks.phase("replicate", device):
                key = (str(device), is_source)
                skeleton = tree.skeletons.get(key)
                if skeleton is None or not skeleton.intact():
                    skeleton = tree.skeletons[key] = _Skeleton(tree, is_source)
                    self.builds += 1
                self._in_use.append(skeleton)
                out.append(skeleton.refresh(tensors))
        return out
