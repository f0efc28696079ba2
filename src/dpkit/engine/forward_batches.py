"""Which batch a loss came from: the loss weight of the forward that produced it, in any fetch order.

Under ddp, fsdp, zero and hsdp each process scales its mean loss by its share of the global batch (rows * world /
global rows: strategies/process_shares.py). The share belongs to the batch the loss was computed on. A loop that
fetches the next batch before backward (nanoGPT's) holds batch k+1 when it calls engine.backward on batch k's
loss, so "the batch the loader yielded last" is the wrong one whenever the two shares differ (the last batch of
an epoch).

So the Engine's model wrapper marks the output nodes of each forward in the autograd graph with the record of the
batch in hand at that forward (`Node.metadata`: the graph carries the mark, nothing here keeps a graph alive),
and engine.backward walks the loss's graph down to the marks: only the few nodes between the loss and the model's
outputs, since a path stops at its first mark. A loss over forwards of batches with different weights is refused
before anything steps; a loss that reaches no marked forward (the model called around the wrapper) takes the
batch yielded last, as a loop that fetches after backward has it.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from dpkit.engine.resumable_loader import BatchRecord
from dpkit.parallel.nested import leaves

MARK = "dpkit.batch"  # the key of a marked node's metadata


class ForwardBatches:
    """The batch in hand (the record a loader yielded last) and the marks that tie each loss to its forward."""

    def __init__(self) -> None:
        self.yielded: BatchRecord | None = None
        self.marking = False  # whether any forward was marked: only then is a loss's graph walked

    def batch_yielded(self, record: BatchRecord) -> None:
        self.yielded = record

    def stream_ended(self) -> None:
        """A per-process stream's pass ended on every rank: the code after the loop is nobody's shadow step."""
        if self.yielded is not None and self.yielded.from_stream and self.yielded.rows == 0:
            self.yielded = None

    def forward_ran(self, output: Any) -> None:
        """Mark the nodes that produced `output`'s tensors with the batch in hand (a forward that records a graph)."""
        record = self.yielded
        if record is None or not torch.is_grad_enabled():
            return
        for _, value in leaves(output, "output"):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                _metadata(value.grad_fn)[MARK] = record
                self.marking = True

    def loss_weight(self, loss: torch.Tensor) -> float:
        """The loss weight of the batch `loss` was computed on (1 without an Engine loader)."""
        record = self.loss_record(loss)
        return record.loss_weight if record is not None else 1.0

    @property
    def in_shadow(self) -> bool:
        """Whether the batch in hand is a shadow: a per-process stream's rank that ran out, sitting out a step."""
        return self.yielded is not None and self.yielded.from_stream and self.yielded.rows == 0

    def loss_record(self, loss: torch.Tensor) -> BatchRecord | None:
        """The record of the batch `loss` was computed on (None without an Engine loader)."""
        if self.marking and loss.grad_fn is not None:
            records = sorted(_marks_above(loss.grad_fn), key=lambda r: (r.epoch, r.index))
            weights = {record.loss_weight for record in records}
            if len(weights) > 1:
                batches = ", ".join(f"batch {r.index} of epoch {r.epoch} ({r.rows} rows here)" for r in records)
                raise ValueError(
                    f"loss: it is computed from forwards of batches whose shares of the global batch differ ({batches})"
                    "; the step's weight belongs to one batch: call engine.backward on each batch's loss"
                )
            if records:
                return records[0]
        return self.yielded


def _metadata(node: torch.autograd.graph.Node) -> dict[str, Any]:
    """A node's own dict of metadata (a property; torch's stubs declare it as a method)."""
    return cast(dict[str, Any], node.metadata)


def _marks_above(top: torch.autograd.graph.Node) -> list[BatchRecord]:
    """The records of the marked nodes `top` reaches, each path followed down to its first mark."""
    found: dict[int, BatchRecord] = {}
    seen = {id(top)}
    stack = [top]
    while stack:
        node = stack.pop()
        record = _metadata(node).get(MARK)
        if record is not None:
            found.setdefault(id(record), record)
            continue
        for child, _ in node.next_functions:
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return list(found.values())
