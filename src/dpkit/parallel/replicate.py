"""Copies of a module on each device, differentiable back to the original parameters.

Every replica is a replica, the first included, as in torch's DataParallel:
- its parameters are differentiable views (on the source device) or copies (elsewhere) of the user's
  parameters, so backward sums each replica's gradient onto them, and `zero_grad()` in a forward does
  nothing to them (it warns, as torch does);
- they are visible: `self.parameters()`, `named_parameters()` and `next(self.parameters())` inside a
  replica's forward yield the replica's own tensors (torch's replicas yield nothing);
- on the source device the buffers are the user's own tensors, so what the first replica updates in place
  (BatchNorm running statistics) persists; elsewhere they are copies;
- nothing set inside a replica reaches the user's module: each replica module has its own attribute dict
  (flags and caches assigned in forward stay there) and its own hook dicts, so a library that installs
  hooks lazily on first forward (transformers' output capturing) installs them on the replica.

A replica is built without calling the module's `__setattr__`: wrappers that forward attribute writes to an
inner module (torch.compile's OptimizedModule) would otherwise write into the user's model.
"""

from __future__ import annotations

import copy
import sys
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, TypeVar

import torch
from torch import nn

from dpkit.compilation import rebind_forward
from dpkit.devices import DeviceLike, parse_device
from dpkit.parallel import sync_batchnorm

ModuleT = TypeVar("ModuleT", bound=nn.Module)

# The containers nn.Module keeps per instance (hook dicts, the non-persistent buffer set, ...): a replica gets
# its own copy of each, so hooks registered inside a replica stay there. The user's own lists and dicts stay
# shared, as in torch (a forward that appends to self.records reaches the original, as it does there).
_MODULE_CONTAINERS = frozenset(
    name for name, value in nn.Module().__dict__.items() if isinstance(value, (dict, list, set))
)
RNN_CONTAINERS = frozenset({"_flat_weights", "_flat_weights_names", "_flat_weight_refs", "_all_weights"})
# _parameters, _buffers and _modules are rebuilt for every replica, not copied
_COPIED = (_MODULE_CONTAINERS | RNN_CONTAINERS) - {"_parameters", "_buffers", "_modules"}
_FAST_COPY = (dict, OrderedDict, list, set)


def check_replicable(module: nn.Module, argument: str = "module") -> None:
    """Raise a one-line error for a module that cannot be replicated, saying what to do instead.

    A torch.compile'd module (an OptimizedModule, or one after `module.compile()`) runs a compiled function
    bound to the user's own module, so a replica would run the original instead of itself. Lazy modules
    have no parameters to copy yet; a ScriptModule cannot hold Python replicas.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"{argument}: expected a torch.nn.Module, got {type(module).__name__}")
    for name, sub in module.named_modules(remove_duplicate=True):
        path = f"{argument}.{name}" if name else argument
        if _is_compiled_wrapper(sub):
            raise TypeError(
                f"{path}: is a torch.compile'd module, which cannot be replicated (its compiled forward is bound to "
                f"your original module); pass the uncompiled model instead (for c = torch.compile(model), that is "
                f"model, also c._orig_mod) with dpkit.Engine(..., compile=True or a dict of torch.compile's "
                f"options): every replica then runs the compiled forward"
            )
        if sub.__dict__.get("_compiled_call_impl") is not None:
            raise TypeError(
                f"{path}: was compiled in place with .compile(), which cannot be replicated "
                "(the compiled call is bound to your original module); pass a model that was not compiled, with "
                "dpkit.Engine(..., compile=True or a dict of torch.compile's options): every replica then runs the "
                "compiled forward"
            )
        if isinstance(sub, torch.jit.ScriptModule):
            raise TypeError(
                f"{path}: is a TorchScript module, which dpkit cannot replicate; "
                "pass the Python module it was scripted from"
            )
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in sub._parameters.values()):
            raise RuntimeError(
                f"{path}: Modules with uninitialized parameters (lazy modules) cannot be replicated; "
                "run one forward pass on a sample batch first"
            )


def _is_compiled_wrapper(module: nn.Module) -> bool:
    # torch._dynamo is imported by torch.compile; if it never was, no OptimizedModule exists (and importing
    # it here would cost a second)
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


class _ZeroGradInReplica:
    """`zero_grad` of a replica: torch's warning that it has no effect, and nothing else. The replica's
    parameters are not leaves and hold no gradient, and the user's gradients are not the replica's to clear."""

    _stand_in: nn.Module | None = None

    def __call__(self, set_to_none: bool = True) -> None:
        if _ZeroGradInReplica._stand_in is None:
            stand_in = nn.Module()
            stand_in._is_replica = True  # type: ignore[assignment]  # torch types Module attributes as tensors
            _ZeroGradInReplica._stand_in = stand_in
        # torch's own Module.zero_grad on a parameterless replica emits torch's warning, text and category
        nn.Module.zero_grad(_ZeroGradInReplica._stand_in, set_to_none)


_ZERO_GRAD_IN_REPLICA = _ZeroGradInReplica()


def _shallow_replica(module: nn.Module) -> nn.Module:
    """A new module object of the same class whose attribute dict is a copy of the original's, containers
    copied, parameters/buffers/children to be filled in. No __init__, no __setattr__ of the module runs."""
    replica = object.__new__(type(module))
    state = dict(module.__dict__)
    for name in _COPIED.intersection(state):
        value = state[name]
        # the containers' own copy() is C-fast and keeps an OrderedDict one; copy.copy for the rest
        if type(value) in _FAST_COPY:
            state[name] = value.copy()
        elif isinstance(value, (dict, list, set)):
            state[name] = copy.copy(value)
    state["_parameters"] = {}
    state["_buffers"] = {}
    state["_modules"] = {}
    state["_is_replica"] = True
    state["_former_parameters"] = OrderedDict()  # where torch's replicas expose their parameters
    state["zero_grad"] = _ZERO_GRAD_IN_REPLICA
    rebind_forward(module, replica, state)  # a forward compiled by the Engine (compile=) runs the replica's weights
    object.__setattr__(replica, "__dict__", state)
    return replica


class ReplicaTensors(Protocol):
    """What replicate_tree puts in a replica's slots for each tensor of the original (None: an empty slot)."""

    def parameter(self, tensor: torch.Tensor) -> torch.Tensor | None: ...
    def buffer(self, tensor: torch.Tensor) -> torch.Tensor | None: ...


class TensorCopier:
    """Each tensor of the original once per device: an alias on the source device, a copy elsewhere;
    differentiable unless `detach` (tied weights stay tied: the same tensor maps to the same copy)."""

    def __init__(self, device: torch.device, is_source: bool, detach: bool):
        self.device = device
        self.is_source = is_source
        self.detach = detach
        self.copies: dict[int, torch.Tensor] = {}

    def parameter(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._once(tensor, differentiable=not self.detach)

    def buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        # a buffer that requires grad flows back like a parameter; the rest are plain data
        return self._once(tensor, differentiable=tensor.requires_grad and not self.detach)

    def _once(self, tensor: torch.Tensor, *, differentiable: bool) -> torch.Tensor:
        key = id(tensor)
        if key not in self.copies:
            self.copies[key] = self._make(tensor, differentiable)
        return self.copies[key]

    def _make(self, tensor: torch.Tensor, differentiable: bool) -> torch.Tensor:
        on_source = self.is_source and (
            self.device.type == "cpu" and tensor.device.type == "cpu" or tensor.device == self.device
        )
        if on_source:
            if not differentiable:
                # a buffer: the tensor itself, so in-place updates (running statistics) persist
                return tensor if not isinstance(tensor, nn.Parameter) else tensor.detach()
            # a non-leaf alias: gradients reach the original (sparse ones too: alias passes the gradient
            # through unchanged, where view_as would reshape it), and in grad mode the replica cannot write into it
            return torch.ops.aten.alias.default(tensor)
        source = tensor if differentiable else tensor.detach()
        if self.device.type == "cpu":
            # a virtual CPU device gets its own copy: its replica may update buffers in place
            return source.clone() if source.device.type == "cpu" else source.to("cpu", copy=True)
        return source.to(self.device, non_blocking=True, copy=True)


def needs_check(originals: Sequence[nn.Module]) -> bool:
    """A quick look for what check_replicable refuses (it then finds and names the module)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    compiled_type = eval_frame.OptimizedModule if eval_frame is not None else ()
    for module in originals:
        if isinstance(module, compiled_type) or module.__dict__.get("_compiled_call_impl") is not None:
            return True
        if isinstance(module, torch.jit.ScriptModule):
            return True
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module._parameters.values()):
            return True
    return False


def _replicate_one(
    module: ModuleT, device: torch.device, is_source: bool, detach: bool, originals: Sequence[nn.Module] | None = None
) -> ModuleT:
    if originals is None:
        originals = list(module.modules())  # each shared submodule once, so sharing is kept
    replica = replicate_tree(originals, TensorCopier(device, is_source, detach))[0]
    if not isinstance(replica, type(module)):  # (never: a replica is of its original's class)
        raise TypeError(f"replicate: the replica of a {type(module).__name__} is a {type(replica).__name__}")
    return replica


def replicate_tree(originals: Sequence[nn.Module], copier: ReplicaTensors) -> list[nn.Module]:
    """A replica of every module of a tree (`originals[0]` its root, each module once), in that order."""
    replicas = {id(m): _shallow_replica(m) for m in originals}
    for original in originals:
        replica = replicas[id(original)]
        parameters, buffers, children = replica._parameters, replica._buffers, replica._modules
        for name, child in original._modules.items():
            children[name] = None if child is None else replicas[id(child)]
        for name, param in original._parameters.items():
            # a replica's parameters are non-leaf tensors, as in torch's replicate (torch types them as Parameters),
            # and _former_parameters is an attribute of Module that torch's stubs leave out
            parameters[name] = None if param is None else copier.parameter(param)  # type: ignore[assignment]
            replica._former_parameters[name] = parameters[name]  # type: ignore[operator, index, assignment]
        for name, buffer in original._buffers.items():
            buffers[name] = None if buffer is None else copier.buffer(buffer)
        if isinstance(replica, nn.RNNBase):  # (of its original's class)
            point_rnn_at_replica_weights(replica)
        sync_batchnorm.link_replica(original, replica)  # SyncBatchNorm: whole-batch statistics inside a step
    return [replicas[id(m)] for m in originals]


def point_rnn_at_replica_weights(replica: nn.RNNBase) -> None:
    # RNNs keep a list of their weights beside _parameters; it must hold the replica's, not the original's
    weights = [replica._parameters.get(name) for name in replica._flat_weights_names]
    replica.__dict__["_flat_weights"] = weights
    replica.__dict__["_flat_weight_refs"] = [weakref.ref(w) if w is not None else None for w in weights]


def replicate_to(
    module: nn.Module, device: torch.device, *, is_source: bool = False, detach: bool = False
) -> nn.Module:
    """One replica of `module` on `device` (see the module docstring). `is_source`: `device` is where the
    module lives and the replica aliases its tensors there."""
    originals = list(module.modules())
    if needs_check(originals):
        check_replicable(module)
    return _replicate_one(module, device, is_source, detach, originals)


def replicate(network: ModuleT, devices: Sequence[DeviceLike], detach: bool | torch.device = False) -> list[ModuleT]:
    """torch.nn.parallel.replicate's verb: one replica of `network` per device, in device order.

    `devices` are dpkit device specs (ints are CUDA indices, "cpu:3", torch.device). As in torch the first
    device is the source: its replica aliases the module's tensors (buffer updates persist), the others
    get copies. `detach=True` makes replicas whose parameters are cut from autograd.

    For dpkit's own callers, a torch.device in place of `detach` names the source device explicitly (the
    device whose replica aliases the module); devices without it all get copies.
    """
    if isinstance(detach, torch.device):
        source, detach = detach, False
    elif isinstance(detach, bool):
        source = None
    else:
        raise TypeError(f"detach: expected a bool, got {detach!r} ({type(detach).__name__})")
    if not isinstance(network, nn.Module):
        raise TypeError(f"network: expected a torch.nn.Module, got {type(network).__name__}")
    originals = list(network.modules())  # each shared submodule once, so sharing is kept
    if needs_check(originals):
        check_replicable(network, "network")
    if not devices:
        return []
    parsed = [
        d if isinstance(d, torch.device) and d.index is not None else parse_device(d, argument=f"devices[{i}]")
        for i, d in enumerate(devices)
    ]
    if source is None:
        source = parsed[0]
    return [_replicate_one(network, device, device == source, detach, originals) for device in parsed]
