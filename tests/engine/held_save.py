"""Run as a script by tests/engine/test_background_save.py: train a step, save it whole, train another and save it
in the background with the write held at `point` (a function of checkpoint/writes.py), say "held" and wait to be
killed. The first step's weights go to `weights` for the test to compare with what it loads.

    python held_save.py FOLDER WEIGHTS POINT
"""

import sys
import threading

import torch
from torch import nn

import dpkit.checkpoint.writes as writes
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
setattr(writes, point, held)
step()
engine.save_state(folder, blocking=False)
threading.Event().wait()
