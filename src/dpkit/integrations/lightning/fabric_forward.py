"""What a model's forward means under Fabric: a LightningModule method Fabric routes through `forward`
(redirected_method), or, in training under a strategy's criterion, a forward deferred until the criterion runs
it in the replicas together with the loss (DeferredForward)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

from torch import nn

if TYPE_CHECKING:
    from dpkit.integrations.lightning.replicas import StepReplicas


def redirected_method(module: nn.Module) -> str | None:
    """The LightningModule method Fabric routes through `forward` (fabric_model.training_step(...)), or None.

    Fabric patches the module's forward with a closure that calls `module.<method_name>`: run in replicas,
    it would run the original module's method in every replica. The patch is undone here and the method's
    name returned, so the replicas run their own."""
    patched = module.__dict__.get("forward")
    if patched is None:
        return None
    if getattr(patched, "__self__", None) is module:
        if getattr(patched, "__func__", None) is type(module).forward:
            # what an earlier redirect leaves behind: per-step replicas would copy it and run the original
            del module.__dict__["forward"]
        return None
    code, cells = getattr(patched, "__code__", None), getattr(patched, "__closure__", None)
    if code is None or not cells:
        return None
    found = {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
    method, original = found.get("method_name"), found.get("original_forward")
    if not isinstance(method, str) or original is None:
        return None
    if getattr(original, "__self__", None) is module and getattr(original, "__func__", None) is type(module).forward:
        del module.__dict__["forward"]  # the class's forward again, with nothing left in the instance
    else:
        module.forward = original
    return method


class DeferredForward:
    """What a Fabric model returns in training under a strategy's criterion (setup_criterion): nothing has
    run yet; the criterion runs the forward and the loss in each replica."""

    def __init__(self, replicas: StepReplicas, args: tuple, kwargs: dict):
        self.replicas, self.args, self.kwargs = replicas, args, kwargs

    def __getattr__(self, name: str) -> NoReturn:
        raise AttributeError(
            f"model(x) returns a deferred output (no .{name}) while training with a criterion from "
            "strategy.setup_criterion(criterion): the forward runs inside the replicas together with the loss. "
            "Pass it to that criterion; for plain outputs call model.eval() or use torch.no_grad()"
        )
