"""torch.compile for dpkit: the `compile` argument checked, a missing C++ compiler said before any work, compiled
modules unwrapped (checkpoints keep the bare model's keys) and torch._dynamo's counters read, so that a caller can
assert that a strategy compiles once and does not recompile per step.

    options = check_compile({"backend": "aot_eager", "dynamic": True})   # {} for compile=True, None for eager
    check_cpp_compiler(options, "cpu")         # inductor on CPU writes C++: one line if no compiler is found
    before = compile_counts()
    ...train a few steps...
    assert compile_counts().since(before).frames == 0   # nothing compiled again

What each strategy does with a compiled model, measured, is in docs/compile.md. This module is a leaf: it uses
torch and nothing of dpkit's layers, so the Engine, the strategies and the command can all call it.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import types
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

COMPILED_PREFIX = "_orig_mod."  # torch.compile's OptimizedModule keeps the model under this name
# torch.compile's modes (torch/__init__.py); None and "default" are the same
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_option_names() -> tuple[str, ...]:
    """The keyword options of this torch's torch.compile (everything but the model)."""
    return tuple(name for name in inspect.signature(torch.compile).parameters if name != "model")


def check_compile(value: object, argument: str = "compile") -> dict[str, Any] | None:
    """`value` as torch.compile's keyword options: None (run eagerly) for None or False, {} (torch's defaults) for
    True, a checked copy of a dict. Anything else fails with one line naming `argument`, the value and what is
    accepted, before any work (torch itself would only complain at the first forward, or not at all)."""
    names = compile_option_names()
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{argument}: expected True, False or a dict of torch.compile's options ({', '.join(names)}), "
            f"got {value!r} ({type(value).__name__})"
        )
    options = dict(value)
    for key in options:
        if key not in names:
            raise ValueError(
                f"{argument}: {key!r} is not an option of torch.compile in torch {torch.__version__}; "
                f"accepted: {', '.join(names)}"
            )
    backend = options.get("backend")
    if backend is not None and not callable(backend):
        from torch._dynamo import list_backends  # (torch.compile imports it anyway; a second the first time)

        known = sorted(list_backends(exclude_tags=()))
        if not isinstance(backend, str) or backend not in known:
            raise ValueError(
                f"{argument}: backend {backend!r} is not a torch.compile backend; accepted: a callable or one of "
                f"{', '.join(known)}"
            )
    if options.get("mode") not in MODES:
        raise ValueError(
            f"{argument}: mode {options['mode']!r} is not a torch.compile mode; accepted: "
            f"{', '.join(repr(mode) for mode in MODES)}"
        )
    if options.get("mode") is not None and options.get("options") is not None:
        raise ValueError(
            f"{argument}: 'mode' and 'options' are both given, and torch.compile takes one of them; "
            "keep mode= (a preset) or options= (inductor's settings)"
        )
    if "options" in options and options["options"] is not None and not isinstance(options["options"], Mapping):
        raise TypeError(
            f"{argument}: 'options' is inductor's settings as a dict (e.g. {{'max_autotune': True}}), "
            f"got {options['options']!r}"
        )
    for key, accepted, meaning in (
        ("dynamic", (None, True, False), "None (dynamic after a shape changes), True or False"),
        ("fullgraph", (True, False), "True or False"),
        ("disable", (True, False), "True or False"),
    ):
        if key in options and not any(options[key] is choice for choice in accepted):
            raise ValueError(f"{argument}: {key!r} must be {meaning}, got {options[key]!r}")
    return options


def describe_compile(options: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`options` as plain JSON values, for a run's record (run.json): a callable backend by its name."""
    if options is None:
        return None

    def plain(value: object) -> Any:
        if isinstance(value, (str, int, float, bool, type(None))):
            return value
        if isinstance(value, Mapping):
            return {str(key): plain(item) for key, item in value.items()}
        if callable(value):
            return getattr(value, "__qualname__", None) or type(value).__name__
        return repr(value)

    return {key: plain(value) for key, value in options.items()}


def backend_name(options: Mapping[str, Any] | None) -> str | None:
    """The backend torch.compile would use with `options` ("inductor" by default), None for a callable."""
    backend = (options or {}).get("backend")
    if backend is None:
        return "inductor"
    return backend if isinstance(backend, str) else None


def check_cpp_compiler(options: Mapping[str, Any] | None, device_type: str, argument: str = "compile") -> str | None:
    """The C++ compiler inductor will use on CPU, found as inductor finds it (torch._inductor.cpp_builder: its
    config.cpp.cxx, i.e. $CXX or g++); None when none is needed (eager, another backend, a GPU). Without one,
    inductor would fail at the first forward with a long traceback: this says so in one line, before any work."""
    if options is None or options.get("disable") or device_type != "cpu" or backend_name(options) != "inductor":
        return None
    from torch._inductor import config, cpp_builder, exc

    try:
        return cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        searched = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
        tried = ", ".join(str(name) for name in searched if name is not None) or "none"
        raise RuntimeError(
            f"{argument}: torch.compile's inductor backend writes C++ on CPU and no C++ compiler was found (tried "
            f"{tried}); install g++ (or set CXX to one), or compile with another backend, e.g. "
            f"{{'backend': 'aot_eager'}}"
        ) from None


# --- compiled modules ------------------------------------------------------------------------------------
def _optimized_module_type() -> type | None:
    # torch.compile imports torch._dynamo; if nothing did, no module is compiled (and importing it costs a second)
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def is_compiled(module: nn.Module) -> bool:
    """`module` is torch.compile(m) (an OptimizedModule) or was compiled in place with m.compile()."""
    compiled = _optimized_module_type()
    return (compiled is not None and isinstance(module, compiled)) or (
        module.__dict__.get("_compiled_call_impl") is not None
    )


def uncompiled(module: nn.Module) -> nn.Module:
    """The module torch.compile wraps (torch.compile(torch.compile(m)) gives m); `module` itself otherwise. A
    module compiled in place with .compile() is its own bare module: its state dict has no `_orig_mod.`."""
    compiled = _optimized_module_type()
    while compiled is not None and isinstance(module, compiled):
        module = module._orig_mod  # type: ignore[assignment]  # torch types a module's attributes as Tensor | Module
    return module


def compiled_submodules(module: nn.Module) -> list[str]:
    """The names of the compiled modules in `module` ("" for itself), e.g. the blocks of a model whose blocks were
    replaced by torch.compile(block), as torchtitan does."""
    return [name for name, sub in module.named_modules() if is_compiled(sub)]


def without_compiled_prefixes(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `state_dict` with every `_orig_mod.` segment removed from its keys, leading or inside (a block
    compiled on its own: `blocks.0._orig_mod.weight` -> `blocks.0.weight`), so the bare model loads it."""
    clean: dict[str, Any] = OrderedDict()
    for key, value in state_dict.items():
        plain = _without_compiled_segments(key)
        if plain in clean:
            raise ValueError(
                f"state_dict: keys {key!r} and another both become {plain!r} without torch.compile's "
                f"'{COMPILED_PREFIX}'; save one model, compiled or not, not both"
            )
        clean[plain] = value
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # module versions that load_state_dict reads, under the same clean names
        clean._metadata = OrderedDict(  # type: ignore[attr-defined]
            (_without_compiled_segments(key), value) for key, value in metadata.items()
        )
    return clean


def _without_compiled_segments(key: str) -> str:
    return ".".join(part for part in key.split(".") if part != COMPILED_PREFIX[:-1])


# --- dynamo's counters -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CompileCounts:
    """What torch._dynamo counted in this process, from its start or its last reset (or, from `since`, between two
    readings).

    frames: functions dynamo converted: each first compile and each recompile (a guard failed: a new shape, a
        new dtype, a changed attribute), with a graph or without one (a frame it gave up on counts too).
    graphs: graphs handed to the backend; 0 with frames > 0 means the code ran eagerly.
    captured_calls: operations captured into those graphs.
    graph_breaks: places where dynamo split a function and ran Python in between; `break_reasons` says why,
        the most frequent first.
    compile_seconds: time spent compiling (dynamo's trace and the backend, forward and backward).
    """

    frames: int
    graphs: int
    captured_calls: int
    graph_breaks: int
    break_reasons: tuple[tuple[str, int], ...]
    compile_seconds: float

    def since(self, earlier: CompileCounts) -> CompileCounts:
        """The counts between `earlier` and this reading (after warm-up steps, frames == 0: no recompiles)."""
        before = dict(earlier.break_reasons)
        reasons = tuple(
            (reason, count - before.get(reason, 0))
            for reason, count in self.break_reasons
            if count - before.get(reason, 0) > 0
        )
        return CompileCounts(
            frames=self.frames - earlier.frames,
            graphs=self.graphs - earlier.graphs,
            captured_calls=self.captured_calls - earlier.captured_calls,
            graph_breaks=self.graph_breaks - earlier.graph_breaks,
            break_reasons=reasons,
            compile_seconds=max(0.0, self.compile_seconds - earlier.compile_seconds),
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain values for a report (`dpkit profile`, run.json)."""
        return {
            "frames": self.frames,
            "graphs": self.graphs,
            "captured_calls": self.captured_calls,
            "graph_breaks": self.graph_breaks,
            "break_reasons": dict(self.break_reasons),
            "compile_seconds": round(self.compile_seconds, 3),
        }


def compile_counts() -> CompileCounts:
    """torch._dynamo's counters now (all zero if nothing was ever compiled: this never imports torch._dynamo)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return CompileCounts(0, 0, 0, 0, (), 0.0)
    counters = utils.counters
    breaks = counters.get("graph_break", {})
    # a reason is a paragraph (explanation, hints): its first line names it
    reasons: dict[str, int] = {}
    for reason, count in breaks.items():
        first_line = str(reason).strip().splitlines()[0] if str(reason).strip() else "unknown"
        reasons[first_line] = reasons.get(first_line, 0) + int(count)
    times = getattr(utils, "compilation_time_metrics", {})
    seconds = sum(sum(values) for key, values in times.items() if key == "_compile.compile_inner") + sum(
        sum(values) for key, values in times.items() if key.startswith("backward.")
    )
    return CompileCounts(
        frames=int(counters.get("frames", {}).get("ok", 0)),
        graphs=int(counters.get("stats", {}).get("unique_graphs", 0)),
        captured_calls=int(counters.get("stats", {}).get("calls_captured", 0)),
        graph_breaks=sum(reasons.values()),
        break_reasons=tuple(sorted(reasons.items(), key=lambda item: (-item[1], item[0]))),
        compile_seconds=float(seconds),
    )


# --- a compiled forward for every strategy ---------------------------------------------------------------
CompileFn = Callable[[Callable[..., Any]], Callable[..., Any]]


def take_compiled(model: nn.Module, options: Mapping[str, Any] | None) -> tuple[nn.Module, CompileFn | None]:
    """(the bare model, the function that compiles a forward with the user's options, or None to run eagerly).

    A model compiled before engine.setup (torch.compile(model) or model.compile(...)) keeps its own options: its
    compiled wrapper is dropped (the strategies copy, wrap or shard the bare module, and checkpoints keep its keys)
    and its forward is compiled again the strategy's way. `options` are the Engine's compile= (check_compile's)."""
    compiled_type = _optimized_module_type()
    if compiled_type is not None and isinstance(model, compiled_type):
        if options is not None:
            raise ValueError(
                "model: is compiled already (torch.compile(model)) and compile= was given; pass one: the model "
                "uncompiled with compile=, or the compiled model without it"
            )
        context: CompileFn = model.dynamo_ctx  # type: ignore[assignment]  # (an OptimizeContext: callable)
        return uncompiled(model), context
    call = model.__dict__.get("_compiled_call_impl")
    if call is not None:
        if options is not None:
            raise ValueError(
                "model: was compiled in place (model.compile()) and compile= was given; pass one: the model "
                "uncompiled with compile=, or the compiled model without it"
            )
        # model.compile(**options) keeps torch.compile's context (its options) in the compiled call's closure
        contexts = [cell.cell_contents for cell in call.__closure__ or () if _is_dynamo_context(cell.cell_contents)]
        del model.__dict__["_compiled_call_impl"]
        return model, contexts[0] if contexts else torch.compile
    if options is None:
        return model, None
    return model, functools.partial(torch.compile, **options)


def _is_dynamo_context(value: object) -> bool:
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(value, eval_frame._TorchDynamoContext)


class CompiledForward:
    """A module class's forward compiled once and called by every replica with itself (bound on each as its
    `forward`): dynamo guards on the replica's type and its tensors' shapes, not on which replica calls, so the
    replicas share the compiled code (measured: a torch.compile wrapper made per replica per step costs 0.5 ms,
    and torch.func.functional_call swaps weights on one shared module, unsafe across replica threads).

    A call with inputs not seen before runs one thread at a time: two replica threads compiling the same code
    at once race in dynamo's cache (an "unexpected recompilation"); once that signature compiled, replicas run
    it in parallel."""

    def __init__(self, compiled: Callable[..., Any]):
        self.compiled = compiled
        self._turn = threading.Lock()
        self._seen: set[tuple[object, ...]] = set()

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        key = _signature(module, args, kwargs)
        if key in self._seen:
            return self.compiled(module, *args, **kwargs)
        with self._turn:
            out = self.compiled(module, *args, **kwargs)
            self._seen.add(key)
        return out


def _signature(module: nn.Module, args: tuple, kwargs: dict) -> tuple[object, ...]:
    # what dynamo's guards mostly look at: the inputs' shapes, dtypes and devices, grad mode, train or eval
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    return (
        torch.is_grad_enabled(),
        module.training,
        *(
            (tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad)
            if isinstance(leaf, torch.Tensor)
            else type(leaf)
            for leaf in leaves
        ),
    )


def compile_forward(module: nn.Module, compile_fn: CompileFn) -> None:
    """Compile `module`'s class forward with `compile_fn` and bind it on `module` as its forward (an instance
    attribute, so its state dict keeps its keys); a replica made from `module` rebinds it to itself."""
    compiled = compile_fn(type(module).forward)
    module.__dict__["forward"] = types.MethodType(CompiledForward(compiled), module)


def rebind_forward(original: nn.Module, replica: nn.Module, state: dict[str, object]) -> None:
    """In a replica's attribute dict `state` (a copy of `original`'s): a forward compile_forward bound on the
    original, bound on the replica instead (else the replica would run the original's weights)."""
    forward = state.get("forward")
    if isinstance(forward, types.MethodType) and forward.__self__ is original:
        state["forward"] = types.MethodType(forward.__func__, replica)


def has_compiled_forward(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, types.MethodType) and isinstance(forward.__func__, CompiledForward)
