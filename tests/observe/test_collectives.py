"""The collective record (numbered entries with op, size, step and the user's line, in a ring), the wrapping of
torch.distributed's collectives, and the step marks that carry every rank's place in one collective."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from dpkit.observe.collectives import (
    CLOSING,
    GRADIENTS,
    CollectiveRecord,
    call_site,
    mark_modulus,
    mismatch_message,
    read_marks,
    record_torch_collectives,
    recording_torch_collectives,
    step_marks,
    stop_recording_torch_collectives,
)


def test_the_call_site_is_the_first_frame_outside_dpkit_and_torch():
    line = _this_line() + 1
    site = call_site()
    assert site == f"test_collectives.py:{line} in test_the_call_site_is_the_first_frame_outside_dpkit_and_torch"


def _this_line() -> int:
    import sys

    return sys._getframe(1).f_lineno


def test_entries_are_numbered_kept_in_a_ring_and_inner_collectives_are_part_of_the_outer():
    record = CollectiveRecord(capacity=3)
    for _ in range(5):
        record.add("all_reduce", 16)
    assert [entry.sequence for entry in record.entries] == [3, 4, 5]  # the last three
    with record.issuing("all_gather_object") as outer, record.issuing("all_gather", 8) as inner:
        assert inner is None  # part of all_gather_object, not an entry of its own
    assert outer is not None and record.last() is outer and outer.sequence == 6
    record.batches = 4
    entry = record.add("barrier")
    assert entry.step == 4 and entry.describe().startswith("barrier (collective 7, step 4, test_collectives.py:")
    assert record.add("all_reduce", 3 << 20).describe().startswith("all_reduce of 3.0 MB (collective 8, step 4")


def test_a_pinned_site_names_collectives_issued_from_another_thread():
    import threading

    record = CollectiveRecord()
    with record.pinned() as site:
        thread = threading.Thread(target=record.add, args=("all_reduce",))  # as autograd's thread on a GPU
        thread.start()
        thread.join()
    assert record.last().site == site and site.startswith("test_collectives.py:")


def test_a_step_that_begins_at_a_recorded_collective_gives_it_the_new_step():
    record = CollectiveRecord()
    entry = record.add("all_gather_single")
    assert entry.step == 0
    updated = record.step_begins(entry)
    assert updated.step == 1 and record.last() is updated and record.steps == 1


@pytest.fixture
def one_process_group(tmp_path):
    """A process group of one (gloo), so torch.distributed's functions run here."""
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp_path, 'store')}", rank=0, world_size=1)
    yield
    stop_recording_torch_collectives()
    dist.destroy_process_group()


def test_torch_collectives_are_recorded_while_wrapped_and_restored_after(one_process_group):
    from dpkit.observe.collectives import RECORD

    original = dist.all_reduce
    RECORD.reset()
    record_torch_collectives()
    record_torch_collectives()  # idempotent
    assert recording_torch_collectives() and dist.all_reduce is not original
    assert dist.distributed_c10d.all_reduce is dist.all_reduce  # torch's own code finds the wrapped one too
    dist.all_reduce(torch.ones(4))
    gathered = [None]
    dist.all_gather_object(gathered, {"a": 1})
    dist.barrier()
    assert [(e.op, e.size_bytes) for e in RECORD.entries] == [("all_reduce", 16), ("all_gather_object", 0),
                                                             ("barrier", 0)]  # fmt: skip
    assert all(e.site.startswith("test_collectives.py:") for e in RECORD.entries)
    stop_recording_torch_collectives()
    assert dist.all_reduce is original and dist.distributed_c10d.all_reduce is original
    dist.all_reduce(torch.ones(1))
    assert RECORD.sequence == 3  # no longer recorded
    RECORD.reset()


def _summed(record_of: dict[int, CollectiveRecord], kinds: dict[int, int], dtype=torch.float32) -> torch.Tensor:
    world = len(record_of)
    return sum(step_marks(record_of[r], kinds[r], r, world, dtype, torch.device("cpu")) for r in range(world))


def _record(batches: int, steps: int, sequence: int) -> CollectiveRecord:
    record = CollectiveRecord()
    record.batches, record.steps, record.sequence = batches, steps, sequence
    return record


def test_marks_summed_over_ranks_give_every_rank_s_place_exactly():
    records = {0: _record(3, 3, 40), 1: _record(4, 3, 40), 2: _record(3, 3, 41)}
    marks = read_marks(_summed(records, {0: GRADIENTS, 1: GRADIENTS, 2: CLOSING}), 3)
    assert marks == [(GRADIENTS, 3, 3, 40), (GRADIENTS, 4, 3, 40), (CLOSING, 3, 3, 41)]


def test_marks_are_carried_modulo_what_the_dtype_holds_exactly():
    assert mark_modulus(torch.float32) == 1 << 20 and mark_modulus(torch.bfloat16) == 256
    records = {0: _record(300, 300, 1000), 1: _record(301, 300, 1000)}
    marks = read_marks(_summed(records, {0: GRADIENTS, 1: GRADIENTS}, torch.bfloat16), 2)
    assert marks == [(GRADIENTS, 300 % 256, 300 % 256, 1000 % 256), (GRADIENTS, 301 % 256, 300 % 256, 1000 % 256)]
    assert marks[0] != marks[1]  # one step apart is still told apart


def _entry(op: str, step: int, line: int, sequence: int = 9) -> dict:
    return {"op": op, "step": step, "site": f"train.py:{line} in main", "sequence": sequence, "size_bytes": 0}


def test_the_mismatch_line_names_both_ranks_steps_collectives_and_lines():
    skipped = mismatch_message(
        [(GRADIENTS, 3, 3, 9), (GRADIENTS, 4, 3, 9)],
        {0: _entry("all_reduce of gradient bucket 0", 3, 31), 1: _entry("all_reduce of gradient bucket 0", 4, 31)},
    )
    assert skipped == (
        "rank 1 is at step 4 (all_reduce of gradient bucket 0, train.py:31 in main) while rank 0 is at step 3 "
        "(all_reduce of gradient bucket 0, train.py:31 in main): a rank skipped a step; stopped before the "
        "optimizer step"
    )
    closed = mismatch_message(
        [(GRADIENTS, 0, 6, 12), (CLOSING, 0, 5, 12)],
        {0: _entry("all_reduce of gradient bucket 0", 6, 31), 1: _entry("all_reduce (engine.close)", 5, 40)},
    )
    assert closed.startswith(
        "rank 1 ran out of batches after 5 steps (engine.close, train.py:40 in main) while rank 0 is at step 6 "
        "(all_reduce of gradient bucket 0, train.py:31 in main): the ranks' batch counts differ"
    )
    extra = mismatch_message([(GRADIENTS, 3, 3, 9), (GRADIENTS, 3, 3, 10)], {1: _entry("all_reduce", 3, 35, 10)})
    assert extra.startswith("rank 1 is at step 3 (all_reduce, collective 10, train.py:35 in main) while rank 0")
    assert "call site unknown" in extra and "issued a collective the others did not" in extra
