"""What `import dpkit.engine.engine` costs: torch, and not the parts only some runs use (issue 30).

DTensor (with sympy behind it) loads with a sharded strategy, torch.distributed.checkpoint with a sharded
state, the planner when in-process `auto` measures, torch._dynamo with torch.compile: each is imported by the
function that needs it, so a process that imports the Engine pays about 1.5 s of CPU less.
"""

from __future__ import annotations

import subprocess
import sys

LOADED_ON_DEMAND = ["torch.distributed.tensor", "torch.distributed.checkpoint", "dpkit.plan", "sympy", "torch._dynamo"]

# one process (a fresh interpreter costs seconds): after the import, then after a one-process Engine saved and
# loaded a state and a model file. No torch optimizer here: torch.optim.Optimizer's constructor imports
# torch._dynamo, and DTensor with it (torch's own cost, whoever builds the optimizer)
CODE = """
import sys
loaded = lambda: [name for name in {names!r} if name in sys.modules]
import dpkit, dpkit.engine.engine, dpkit.checkpoint.state, dpkit.checkpoint.model_files
print(loaded())
import torch
from torch import nn
engine = dpkit.Engine(strategy="single", accelerator="cpu", devices=1, progress=False)
model = engine.setup(nn.Linear(3, 2))
engine.backward(model(torch.randn(4, 3)).sum())
engine.save_state({folder!r})
engine.load_state({folder!r})
engine.save(model, {folder!r} + "/model.pt")
engine.load({folder!r} + "/model.pt")
print(loaded())
"""


def test_importing_and_running_a_one_process_engine_loads_no_dtensor_dcp_planner_or_dynamo(tmp_path):
    code = CODE.format(names=LOADED_ON_DEMAND, folder=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", "[]"]
