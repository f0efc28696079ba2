"""The launched groups the tests share (launched_group.py): a job runs in every rank, a failing job names its
rank and error and ends the group, and the next job gets a fresh group."""

from __future__ import annotations

import os

import pytest

from launched_group import JobFailed


def rank_and_world() -> tuple[int, int, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.getpid()


def fails_on_rank_1() -> int:
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 refuses this job")
    return 0


def test_a_job_runs_in_every_rank_and_a_failure_names_the_rank_and_ends_the_group(groups):
    first = groups(2).run(rank_and_world)
    assert [(rank, world) for rank, world, _ in first] == [(0, 2), (1, 2)]
    assert groups(2).run(rank_and_world) == first  # the same processes: the group is kept between jobs

    with pytest.raises(JobFailed, match=r"(?s)--- rank 1 ---.*ValueError: rank 1 refuses this job"):
        groups(2).run(fails_on_rank_1)
    fresh = groups(2).run(rank_and_world)
    assert [(rank, world) for rank, world, _ in fresh] == [(0, 2), (1, 2)]
    assert {pid for *_, pid in fresh}.isdisjoint(pid for *_, pid in first)
