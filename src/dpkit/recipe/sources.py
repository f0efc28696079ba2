"""Where a run's model and data come from, for `dpkit train`, `profile` and `bench` alike.

A built-in example brings both (dpkit.examples); your own model comes as 'package.module:factory'
(factory() returns an nn.Module) and your own data as 'package.module:loader' (loader(seed) returns
x_train, y_train, x_test, y_test); a model measured without data gets synthetic inputs of a given shape
and regression targets of its output's shape. The loss follows the targets: cross-entropy for class
labels, mean squared error for anything else.

    source = model_source(example="digits")
    model, (x_train, y_train, x_test, y_test) = source.build_model(), source.load_data(seed=0)
"""

from __future__ import annotations

import os
import re
import sysconfig
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dpkit.checks import check_int_list
from dpkit.errors import DpkitError
from dpkit.examples import get_example, load_factory

Tensors = tuple[torch.Tensor, ...]


def built_model(factory: Callable[[], object], name: str) -> nn.Module:
    """Call a model factory and insist on an nn.Module back."""
    try:
        model = factory()
    except Exception as error:  # the user's code: say where it came from, in one line
        raise ValueError(f"model: {name}() raised {type(error).__name__}: {error}") from error
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: {name}() returned {type(model).__name__}, expected a torch.nn.Module")
    return model


@dataclass(frozen=True)
class Source:
    """A named model factory and a data loader; `model_name` and `data_name` are what errors call them."""

    name: str
    factory: Callable[[], object]
    loader: Callable[[int], object]
    model_name: str = "model"
    data_name: str = "data"

    def build_model(self) -> nn.Module:
        """Call the factory and insist on an nn.Module back."""
        return built_model(self.factory, self.model_name)

    def load_data(self, seed: int) -> Tensors:
        """Whatever the loader returns for `seed`, at least (x, y) with matching rows."""
        try:
            data = self.loader(seed)
        except Exception as error:
            raise ValueError(f"data: {self.data_name}(seed) raised {type(error).__name__}: {error}") from error
        if (
            not isinstance(data, (tuple, list))
            or len(data) < 2
            or not all(isinstance(t, torch.Tensor) for t in data[:2])
        ):
            raise TypeError(f"data: {self.data_name}(seed) returned {_described(data)}; expected tensors (x, y, ...)")
        return tuple(data)

    def load_classification_data(self, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_train, y_train, x_test, y_test) as tensors with matching rows, class labels as 1-D integers."""
        try:
            data = self.loader(seed)
        except Exception as error:
            raise ValueError(f"data: {self.data_name}(seed) raised {type(error).__name__}: {error}") from error
        if not isinstance(data, (tuple, list)) or len(data) != 4 or not all(isinstance(t, torch.Tensor) for t in data):
            raise TypeError(
                f"data: {self.data_name}(seed) returned {_described(data)}; expected 4 tensors "
                "(x_train, y_train, x_test, y_test)"
            )
        x_train, y_train, x_test, y_test = data
        for x, y, part in ((x_train, y_train, "train"), (x_test, y_test, "test")):
            if x.dim() < 1 or len(x) == 0 or y.dim() != 1 or len(x) != len(y):
                raise ValueError(
                    f"data: {self.data_name}(seed) gave x_{part} of shape {tuple(x.shape)} and y_{part} of shape "
                    f"{tuple(y.shape)}; expected N rows of features and N labels (shape (N,))"
                )
            if y.is_floating_point() or y.is_complex() or (len(y) and int(y.min()) < 0):
                raise ValueError(
                    f"data: {self.data_name}(seed) gave y_{part} of dtype {y.dtype}; expected class labels "
                    "0 … C-1 as integers"
                )
        if x_train.shape[1:] != x_test.shape[1:]:
            raise ValueError(
                f"data: {self.data_name}(seed) gave train rows of shape {tuple(x_train.shape[1:])} and test rows "
                f"of shape {tuple(x_test.shape[1:])}; expected the same"
            )
        return x_train, y_train, x_test, y_test


def _described(data: object) -> str:
    if not isinstance(data, (tuple, list)):
        return type(data).__name__
    return f"{len(data)} item(s) of {', '.join(type(t).__name__ for t in data)}"


def model_source(
    example: str | None = None,
    model: str | None = None,
    data: str | None = None,
    *,
    input_shape: Sequence[int] | None = None,
    synthetic_rows: int = 256,
) -> Source:
    """The model from `model` ('package.module:factory') or the example's; the data from `data`
    ('package.module:loader'), synthetic rows of `input_shape` (with a model of yours), or the example's."""
    own_data = data is not None or (model is not None and input_shape is not None)
    factory: Callable[[], object]
    loader: Callable[[int], object]
    if model is not None and own_data:  # no example needed
        name = model
        factory = load_factory(model)
        if data is not None:
            loader = load_factory(data)
        else:
            shape = tuple(check_int_list(input_shape, "input_shape", minimum=1))
            loader = _synthetic_regression(lambda: built_model(factory, name), shape, synthetic_rows)
    else:
        chosen = get_example(example if example is not None else "")
        name = model or chosen.name
        factory = load_factory(model) if model is not None else chosen.build_model
        loader = load_factory(data) if data is not None else chosen.load_data
    return Source(name=name, factory=factory, loader=loader, model_name=model or "model", data_name=data or "data")


def _synthetic_regression(
    factory: Callable[[], nn.Module], input_shape: tuple[int, ...], rows: int
) -> Callable[[int], Tensors]:
    """Gaussian inputs of `input_shape` and Gaussian targets of the model's output shape, from the seed."""

    def load(seed: int) -> Tensors:
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn((rows, *input_shape), generator=generator)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            probe = factory()(x[:2])
        if not isinstance(probe, torch.Tensor):
            raise TypeError("model: with input_shape the model must return one tensor (it is regressed on noise)")
        return x, torch.randn((rows, *probe.shape[1:]), generator=generator)

    return load


def criterion_for(target: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Cross-entropy for class labels, mean squared error for anything else."""
    return F.cross_entropy if not target.is_floating_point() else F.mse_loss


def check_model_fits(model: nn.Module, x: torch.Tensor, y: torch.Tensor, argument: str = "model") -> None:
    """One probe forward on two rows: the model takes the data's rows and scores every class it has."""
    probe = x[:2]
    was_training = model.training
    model.eval()  # no batch statistics updated, no dropout drawn from the generators
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            output = model(probe)
    except Exception as error:
        where = your_frames(error)
        if not shapes_are_the_cause(error):  # the user's own exception: theirs, where their code raised it
            raise UserCodeError(
                f"{argument}: the model's forward raised {type(error).__name__}: {first_line(error)}"
                + (f" (in your code: {where})" if where else "")
            ) from error
        raise ValueError(
            f"{argument}: the model cannot take rows of shape {tuple(x.shape[1:])} ({type(error).__name__}: "
            f"{first_line(error)})" + (f" (in your code: {where})" if where else "")
        ) from error
    finally:
        model.train(was_training)
    classes = int(y.max()) + 1
    if (
        not isinstance(output, torch.Tensor)
        or output.dim() != 2
        or output.shape[0] != len(probe)
        or output.shape[1] < classes
    ):
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise ValueError(
            f"{argument}: the model gives {shape} for {len(probe)} rows; expected ({len(probe)}, C) scores with "
            f"C >= {classes}, the classes in the labels"
        )


class UserCodeError(DpkitError):
    """An exception of the user's own model, data or loss code, said as theirs (with the last frames of their
    code) rather than as a bad setting."""

    exit_code = 1


_TORCH = str(Path(torch.__file__).parent.resolve()) + os.sep
# where torch, dpkit and Python itself live: a frame elsewhere is the user's code
_NOT_YOURS = tuple(
    str(Path(path).resolve()) + os.sep
    for path in {
        Path(torch.__file__).parent,
        Path(__file__).parents[1],
        Path(sysconfig.get_paths()["stdlib"]),
        Path(sysconfig.get_paths()["purelib"]),
        Path(sysconfig.get_paths()["platlib"]),
    }
)
# words of the errors torch raises when a tensor's shape does not fit an operation
_SHAPE_WORDS = re.compile(r"shape|size|dimension|\bdims?\b|mat1|mat2|must match|expected input", re.IGNORECASE)


def your_frames(error: BaseException, limit: int = 3) -> str:
    """The last `limit` frames of the traceback that are the user's code (not torch's, dpkit's or Python's),
    innermost last: 'mymodels.py:12 in forward: raise RuntimeError(...)'; '' when none is."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if _yours(frame.filename)]
    said = []
    for frame in frames[-limit:]:
        line = f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"
        said.append(line + (f": {frame.line.strip()}" if frame.line and frame is frames[-1] else ""))
    return " -> ".join(said)


def _yours(filename: str) -> bool:
    return not filename.startswith("<") and not str(Path(filename).resolve()).startswith(_NOT_YOURS)


def raised_in_your_code(error: BaseException) -> BaseException | None:
    """The exception behind `error` that the user's own code (a model's forward, a factory, a loader) raised:
    `error` itself when its innermost frame is theirs, or the original a replica raised, which the replica runner
    re-raises with the replica named and the original chained; None when dpkit, torch or Python raised it."""
    for candidate in (error, error.__cause__ if str(error).startswith("in replica ") else None):
        frames = traceback.extract_tb(candidate.__traceback__) if candidate is not None else []
        if frames and _yours(frames[-1].filename):
            return candidate
    return None


def shapes_are_the_cause(error: BaseException) -> bool:
    """Whether a forward's exception says a tensor's shape did not fit: an error raised inside torch (or by
    one of its operators) whose message speaks of shapes or sizes. The user's own exception is not."""
    innermost = traceback.extract_tb(error.__traceback__)[-1:]
    raised_there = bool(innermost) and (innermost[0].line or "").lstrip().startswith("raise")
    in_torch = bool(innermost) and str(Path(innermost[0].filename).resolve()).startswith(_TORCH)
    # an operator (x @ w, F.linear) raises from inside torch or from C under the user's line; a `raise` of
    # the user's own is theirs, whatever it says
    return bool(_SHAPE_WORDS.search(str(error))) and (in_torch or not raised_there)


def first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else ""
