"""Hugging Face Trainer's training through dpkit.DataParallel: the same weights as a single-device run.

    import dpkit.integrations.hf_trainer
    trainer = Trainer(model=model, args=args, train_dataset=train_data)
    dpkit.integrations.hf_trainer.data_parallel(trainer, dpkit.cpu_devices(2))   # or [0, 1] for two GPUs
    trainer.train()

Trainer's own multi-GPU path (more than one GPU, no launcher) wraps the model in torch's nn.DataParallel,
multiplies the batch by the GPU count, divides or repeats `num_items_in_batch` per GPU and averages the
replicas' losses with `loss.mean()`, which is wrong when the last batch splits unevenly. `data_parallel`
replaces that path on one Trainer object:

- the model is wrapped in a TrainerDataParallel (below) instead, for training and evaluation;
- Trainer is told it runs on one device (`args._n_gpu = 1`, as it does itself for model parallelism), so
  the batch it builds, the `num_items_in_batch` it counts and the loss it backpropagates are those of a
  single-device run: `per_device_train_batch_size` is the whole batch that dpkit splits;
- each replica's loss is weighted so that their sum is the whole batch's loss: with `num_items_in_batch`
  (the model divides its summed loss by the batch's count) the replicas' losses simply add up; without
  it the model's loss is a mean over its rows, and each replica's counts in proportion to its rows.

A loss that is a mean over something other than rows (tokens, with padding) is exact only when Trainer
passes `num_items_in_batch`, which it does for models that accept loss keyword arguments (GPT-2, BERT
and most transformers models) whenever the batch has `labels`.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from dpkit.devices import DeviceLike
from dpkit.parallel.data_parallel import DataParallel
from dpkit.parallel.scatter import Broadcast, batch_size_of

if TYPE_CHECKING:
    from torch.utils.data import DataLoader
    from transformers import Trainer

TrainerT = TypeVar("TrainerT", bound="Trainer")

COUNT_KEYWORD = "num_items_in_batch"
# travel with the batch to the replicas and never reach the model: each row's counted items (split like
# the batch) and the batch's total
_ITEMS_KEYWORD = "dpkit_items_per_row"
_TOTAL_KEYWORD = "dpkit_items_in_batch"


def _loss_of(output: object) -> torch.Tensor | None:
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)) and output:
        loss = output[0]
    else:
        return None
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


def _with_loss(output: Any, loss: torch.Tensor) -> Any:
    if isinstance(output, MutableMapping):
        output["loss"] = loss  # ModelOutput keeps its attribute and its key in step
        return output
    return type(output)([loss, *output[1:]]) if isinstance(output, list) else (loss, *output[1:])


def loss_shifts_labels(model: nn.Module) -> bool:
    """Whether the model's own loss drops each sequence's first label: a transformers model whose loss
    function is the causal-LM one (which it also uses when its class name does not say so, as GPT-2's)."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return False
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    return getattr(model, "loss_function", None) is ForCausalLMLoss


def items_per_row(kwargs: Mapping[str, object], rows: int, shifts_labels: bool) -> torch.Tensor:
    """How many loss terms each row holds: labels other than -100 (after the shift of a causal LM, or
    `shift_labels` as given); one per row without labels. With num_items_in_batch any positive counts
    would do (see _WeightedLoss); without it they must be the terms the model's own mean runs over."""
    labels = kwargs.get("shift_labels", kwargs.get("labels"))
    if not isinstance(labels, torch.Tensor) or labels.dim() == 0 or labels.shape[0] != rows:
        return torch.ones(rows, dtype=torch.long)
    if "shift_labels" not in kwargs and shifts_labels:
        labels = labels[..., 1:]
    counted = labels.ne(-100)
    return counted.reshape(rows, -1).sum(dim=1) if counted.dim() > 1 else counted.long()


class _WeightedLoss(nn.Module):
    """What each replica runs: the model, then its loss weighted by its share of the batch's items, shape
    (1,), so that the replicas' losses gather into a vector whose sum is the batch's loss.

    The model may divide its summed loss by the num_items_in_batch it is given, or ignore it and take the
    mean over its own items. A replica holding n_i of the batch's n items is given n_i * N / n (N: the
    count Trainer passed), so either way its loss times n_i / n is exactly its share of the batch's loss."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        items = kwargs.pop(_ITEMS_KEYWORD).sum()
        batch_items = kwargs.pop(_TOTAL_KEYWORD)
        count = kwargs.get(COUNT_KEYWORD)
        if count is not None:  # a 0-dim tensor from Trainer, or a plain number
            # a replica without counted items gets 1: its summed loss is 0, and 0 / 0 would be NaN
            kwargs[COUNT_KEYWORD] = count * items / batch_items if items > 0 else torch.ones((), device=items.device)
        output = self.model(*args, **kwargs)
        loss = _loss_of(output)
        if loss is None:
            return output
        loss = loss * (items / batch_items) if items > 0 else loss.new_zeros(())  # no items: no share of the loss
        return _with_loss(output, loss.reshape(1))


class TrainerDataParallel(nn.Module):
    """dpkit.DataParallel for a transformers model called as Trainer calls it: keyword inputs, the loss
    computed by the model, `num_items_in_batch` as a 0-dim tensor (or Trainer's (n_gpu, 1) repetition of it).

    Returns the model's output with the outputs gathered and `loss` the whole batch's loss, so Trainer's
    backward gives a single-device run's gradients. `shifts_labels`: whether the model's loss drops each
    sequence's first label (default: decided from the model's loss function). State dict keys carry a
    `module.` prefix, as with torch's DataParallel.
    """

    wraps_module = True  # dpkit.unwrap_model / save_model / load_model look inside
    data_parallel: DataParallel  # set with object.__setattr__

    def __init__(
        self, module: nn.Module, device_ids: Sequence[DeviceLike] | None = None, *, shifts_labels: bool | None = None
    ):
        super().__init__()
        self.module = module
        self.shifts_labels = loss_shifts_labels(module) if shifts_labels is None else bool(shifts_labels)
        # not registered: its module is the weighting wrapper around self.module, whose keys would repeat
        object.__setattr__(self, "data_parallel", DataParallel(_WeightedLoss(module), device_ids))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        count = kwargs.get(COUNT_KEYWORD)
        if isinstance(count, torch.Tensor):
            if count.dim() > 0:  # Trainer's nn.DataParallel form: the same count repeated per GPU
                count = count.reshape(-1)[0]
            kwargs[COUNT_KEYWORD] = Broadcast(count)  # every replica scales the whole count to its share
        rows = batch_size_of(args, kwargs, 0)
        if rows is None:
            return self.module(*args, **{k: v.tensor if isinstance(v, Broadcast) else v for k, v in kwargs.items()})
        items = items_per_row(kwargs, rows, self.shifts_labels)
        kwargs[_ITEMS_KEYWORD], kwargs[_TOTAL_KEYWORD] = items, max(int(items.sum()), 1)
        output = self.data_parallel(*args, **kwargs)
        # the replicas' weighted losses came back as a vector, one value per replica: their sum is the loss
        if isinstance(output, Mapping):
            losses = output.get("loss")
        else:  # a tuple (return_dict=False) starts with the loss when there are labels
            losses = output[0] if isinstance(output, (tuple, list)) and output and "labels" in kwargs else None
        return output if not isinstance(losses, torch.Tensor) else _with_loss(output, losses.sum())

    @property
    def device_ids(self) -> list[torch.device]:
        return self.data_parallel.device_ids


def data_parallel(trainer: TrainerT, device_ids: Sequence[DeviceLike] | None = None) -> TrainerT:
    """Make `trainer` (a transformers.Trainer, or a subclass) train and evaluate through dpkit.DataParallel
    on `device_ids` (virtual CPU devices from dpkit.cpu_devices(n), or GPUs; default every visible GPU).
    Returns the trainer. See the module docstring for what changes and what is guaranteed."""
    if not callable(getattr(trainer, "_wrap_model", None)) or not hasattr(trainer, "args"):
        raise TypeError(f"trainer: expected a transformers.Trainer, got {type(trainer).__name__}")
    wrappers: dict[int, TrainerDataParallel] = {}

    def wrap_model(model: nn.Module, training: bool = True, dataloader: DataLoader | None = None) -> nn.Module:
        if isinstance(model, TrainerDataParallel):
            return model
        wrapper = wrappers.get(id(model))
        if wrapper is None or wrapper.module is not model:
            wrapper = wrappers[id(model)] = TrainerDataParallel(model, device_ids)
        return wrapper

    # (Trainer types its model as optional: it is set once Trainer() returns, from model= or model_init=)
    wrap_model(trainer.model)  # checks device_ids now, not at the first step
    trainer._wrap_model = wrap_model  # on this one Trainer object
    if trainer.args.n_gpu > 1:  # one device as far as Trainer knows: no nn.DataParallel, no per-GPU counts
        trainer.args._n_gpu = 1
    return trainer
