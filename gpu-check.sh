#!/usr/bin/env bash
# The prepared GPU check: every CUDA path of dpkit, once, on one lent GPU, in well under 10 minutes.
# The GPU machine has python3 with a CUDA torch, pytest, scikit-learn, tqdm and matplotlib, and no network.
# Use: copy this file into the project (it travels only from inside the checkout), then with the device
# tool:  run(command="bash gpu-check.sh", timeout_s=540)  and read $OUT/gpu-check.log that comes back.
set -u
OUT=${OUT:-$PWD/gpu-check-out}; mkdir -p "$OUT"; LOG=$OUT/gpu-check.log
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
step() { echo "== $*" | tee -a "$LOG"; timeout 150 "$@" >>"$LOG" 2>&1; echo "   exit $?" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$LOG" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())" >>"$LOG" 2>&1
step python3 -m pytest -q -x -m cuda -p no:cacheprovider tests
step python3 -m pytest -q -p no:cacheprovider tests/parallel tests/checkpoint/test_checkpoint.py
step python3 -m dpkit.cli.main demo
step python3 -m dpkit.cli.main profile --example wide-output --strategy dp --accelerator cuda --devices 1 --json "$OUT/profile-dp.json" --png "$OUT/profile-dp.png"
step python3 -m dpkit.cli.main train --example digits --strategy single --accelerator cuda --devices 1 --steps 50 --precision 16-mixed --out "$OUT/train-16"
step python3 -m dpkit.cli.main train --example digits --strategy ddp --accelerator cuda --devices 1 --steps 50 --out "$OUT/train-ddp"
step python3 -m dpkit.cli.main train --example digits --strategy replicated --accelerator cuda --devices 1 --steps 50 --out "$OUT/train-rep"
# fsdp over NCCL: bf16 gathers, CPU offload of the shards (a CUDA-only option), its sharded state and profile
step python3 -m dpkit.cli.main train --example digits --strategy fsdp --accelerator cuda --devices 1 --steps 50 --precision bf16-mixed --out "$OUT/train-fsdp"
step python3 -m dpkit.cli.main train --example digits --strategy fsdp --accelerator cuda --devices 1 --steps 20 --checkpoint-every 10 --out "$OUT/train-fsdp-state"
step python3 -m dpkit.cli.main ckpt inspect "$OUT/train-fsdp-state/state"
step python3 -m dpkit.cli.main profile --example wide-output --strategy fsdp --accelerator cuda --devices 1 --json "$OUT/profile-fsdp.json"
if python3 -c "import lightning, dpkit.lightning" 2>/dev/null; then
  step python3 -m pytest -q -p no:cacheprovider -k lightning tests
fi
grep -c "exit 0" "$LOG" | sed 's/^/steps that passed: /' | tee -a "$LOG"
