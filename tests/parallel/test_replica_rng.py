"""Per-replica generators on virtual CPU devices, given only while a call site's replicas draw."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

import dpkit
from dpkit.parallel.apply import run_replicas
from dpkit.parallel.replica_rng import RandomnessWatch

DEVICES = [torch.device("cpu", i) for i in range(3)]


def test_a_watch_protects_until_a_run_draws_nothing_then_stops():
    watch = RandomnessWatch()
    modes_seen = []

    def job(i: int):
        modes_seen.append(torch._C._get_dispatch_stack_at(0) if torch._C._len_torch_dispatch_stack() else None)
        return torch.ones(2) * i

    assert watch.protects()
    run_replicas(DEVICES, job, generators=watch)
    assert watch.draws is False and all(mode is not None for mode in modes_seen)
    modes_seen.clear()
    run_replicas(DEVICES, job, generators=watch)
    assert modes_seen == [None, None, None]  # no per-operator dispatch any more


def test_replicas_that_draw_keep_their_generators_and_repeat_bitwise():
    watch = RandomnessWatch()

    def draw(i: int):
        return F.dropout(torch.ones(1000), 0.5)

    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append([run_replicas(DEVICES, draw, generators=watch) for _ in range(3)])
    assert watch.draws is True
    for first, again in zip(*runs):
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_randomness_that_starts_later_is_caught_named_once_and_protected_from_then_on(caplog):
    watch = RandomnessWatch("the test's replicas")
    drawing = [False]

    def maybe_draw(i: int):
        return F.dropout(torch.ones(1000), 0.5) if drawing[0] else torch.ones(1000)

    run_replicas(DEVICES, maybe_draw, generators=watch)
    assert watch.draws is False
    drawing[0] = True
    with caplog.at_level(logging.WARNING, logger="dpkit"):
        run_replicas(DEVICES, maybe_draw, generators=watch)  # unprotected: the shared generator moved
    assert watch.draws is True
    assert [r.message for r in caplog.records if "not repeatable" in r.message] and "the test's replicas" in caplog.text
    torch.manual_seed(9)
    first = run_replicas(DEVICES, maybe_draw, generators=watch)
    torch.manual_seed(9)
    again = run_replicas(DEVICES, maybe_draw, generators=watch)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_data_parallel_learns_per_training_mode_so_dropout_after_eval_repeats_from_its_first_step():
    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = dpkit.DataParallel(nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5)), DEVICES[:2])
        x = torch.ones(8, 4)
        model.eval()
        model(x), model(x)  # no dropout in eval: the eval watch stops protecting
        model.train()
        return [model(x) for _ in range(2)]

    first, again = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], first[1])  # dropout did draw


def test_replicas_that_never_draw_leave_the_callers_random_stream_as_one_device_does():
    """The first run's seeds are given back when no replica drew, so what the caller draws afterwards (a
    shuffle, an augmentation) is the same as without replicas, and the same after a resume, whose watch
    learns again."""
    model = dpkit.DataParallel(nn.Linear(4, 2), DEVICES[:2])
    torch.manual_seed(3)
    for _ in range(3):
        model(torch.ones(6, 4))
    after_replicas = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(after_replicas, torch.rand(4))
    assert model.randomness(model.module).draws is False
