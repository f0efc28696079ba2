"""Built-in models and data for the demo, tests and benchmarks, and loading a user's model factory."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpkit.examples.digits import DigitsMLP, load_digits
from dpkit.examples.launch_bound import LaunchBoundConvNet, LaunchBoundMLP, load_digit_images, make_launch_bound_data
from dpkit.examples.wide_blocks import WideBlocksNet, make_wide_blocks_data
from dpkit.examples.wide_output import WideOutputNet, make_wide_output_data

TensorSplits = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Example:
    """A named model with its data: `build_model()` and `load_data(seed) -> (x_train, y_train, x_test, y_test)`."""

    name: str
    build_model: Callable[[], nn.Module]
    load_data: Callable[[int], TensorSplits]
    description: str


EXAMPLES: dict[str, Example] = {
    "digits": Example(
        "digits", DigitsMLP, load_digits, "MLP on scikit-learn's bundled 8x8 digits (1797 images, 10 classes)"
    ),
    "wide-output": Example(
        "wide-output",
        WideOutputNet,
        make_wide_output_data,
        "small trunk, 20,000-class head, synthetic data from a seed",
    ),
    "wide-blocks": Example(
        "wide-blocks",
        WideBlocksNet,
        make_wide_blocks_data,
        "4 residual blocks of 960-wide layers (7.4M parameters: weights dominate memory), synthetic data from a seed",
    ),
    "launch-bound": Example(
        "launch-bound",
        LaunchBoundMLP,
        make_launch_bound_data,
        "40 residual Linear(32, 32) + ReLU layers (launch-bound: a step is mostly operator launches), synthetic data",
    ),
    "launch-bound-conv": Example(
        "launch-bound-conv",
        LaunchBoundConvNet,
        load_digit_images,
        "12 small Conv2d(8, 8, 3) + ReLU layers on the bundled 8x8 digits as images (launch-bound)",
    ),
}


def get_example(name: str) -> Example:
    if name not in EXAMPLES:
        raise ValueError(f"example: unknown example {name!r}; choose one of {', '.join(sorted(EXAMPLES))}")
    return EXAMPLES[name]


def load_factory(spec: str) -> Callable[..., Any]:
    """A user's model factory (or data loader) given as 'package.module:factory'."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"model factory: expected 'package.module:factory', got {spec!r}")
    module_name, attribute = spec.split(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        # like `python -m`: a module in the folder the command runs in is found without PYTHONPATH=.
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"model factory {spec!r}: cannot import {module_name!r} ({error}); run from the folder that holds it, "
            "or add its folder to PYTHONPATH"
        ) from error
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"model factory {spec!r}: {module_name} has no callable {attribute!r}")
    return factory
