"""Run as a script by tests/engine/test_background_save.py: train a step, save it whole, train another and save it
in the background with the write held at `point` (a function of checkpoint/writes.py), say "held" and wait to be
killed. The first step's weights go to `weights` for the test to compare with what it loads.

    python held_save.py FOLDER WEIGHTS POINT

With POINT "exit_worker" the write is held until the process leaves as a launched worker does (exit_worker, which
skips the atexit handlers): the first thing exit_worker does releases it, and the save must still be written.
"""

import sys
import threading

import torch
from torch import nn

import dpkit.checkpoint.writes as writes
import dpkit.launch.worker as worker
from dpkit.engine.engine import Engine

folder, weights, point = sys.argv[1:]
engine = Engine(accelerator="cpu", devices=1, progress=False)
torch.manual_seed(0)
net = nn.Linear(4, 2)
model, optimizer = engine.setup(net, torch.optim.AdamW(net.parameters(), lr=0.1))


def step() -> None:
    optimizer.zero_grad()
    engine.backward(model(torch.ones(3, 4)).sum())
    optimizer.step()


def held(*args: object, **kwargs: object) -> None:
    print("held", flush=True)  # the test kills this process on reading it
    threading.Event().wait()


step()
engine.save_state(folder)
torch.save(model.state_dict(), weights)
if point == "exit_worker":
    released, real = threading.Event(), writes.write_checked

    def held_until_exit(content: object, handle: object) -> None:
        released.wait()
        real(content, handle)  # type: ignore[arg-type]

    writes.write_checked = held_until_exit  # type: ignore[assignment]
    worker._BEFORE_EXIT.insert(0, released.set)  # exit_worker's first act: the write goes on from there
    step()
    engine.save_state(folder, blocking=False)
    worker.exit_worker(0)
setattr(writes, point, held)
step()
engine.save_state(folder, blocking=False)
threading.Event().wait()
