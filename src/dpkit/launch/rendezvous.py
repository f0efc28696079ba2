"""A worker's bounded, interruptible rendezvous: the store for init_process_group once every rank arrived."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from dpkit.launch.environment import LAUNCH_VARIABLES

if TYPE_CHECKING:
    import torch.distributed as dist

_joined = [0]  # process groups this process has joined through rendezvous_store


def rendezvous_store(rank: int, world_size: int, *, wait_seconds: float, timeout_seconds: float) -> dist.Store:
    """The store for init_process_group, once every rank has arrived; at most `wait_seconds` of waiting.

    torch's env:// rendezvous blocks in C++ for the whole process-group timeout while a peer is missing,
    deaf to Ctrl-C. Here every wait is short and in Python (so KeyboardInterrupt arrives), and a missing
    peer is named. Under torchrun's agent the agent hosts the store; otherwise rank 0 does, as with env://.
    """
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    deadline = time.monotonic() + wait_seconds
    store: dist.TCPStore | None = None
    while store is None:
        try:
            store = dist.TCPStore(
                host,
                port,
                is_master=(rank == 0 and not agent_store),
                wait_for_workers=False,
                timeout=timedelta(seconds=1),
            )
        except (RuntimeError, TimeoutError) as error:  # DistStoreError / DistNetworkError: nobody listens yet
            if rank == 0 and not agent_store:
                raise RuntimeError(
                    f"ddp: rank 0 cannot host the rendezvous at {host}:{port} ({error}); pick another MASTER_PORT"
                ) from None
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"ddp: rank {rank} found no rendezvous at {host}:{port} after {wait_seconds:g} s; "
                    "start rank 0 (or launch with `dpkit launch`)"
                ) from None
            time.sleep(0.1)
    store.set_timeout(timedelta(seconds=timeout_seconds))
    # keys of an earlier attempt (torchrun restarts the group on the same store), or of an earlier process group
    # of this process (an Engine closed, then another made), must not be read as this one's: gloo would connect
    # to the addresses a closed group left there and wait forever. Every rank makes its groups in the same order.
    _joined[0] += 1
    group_store = dist.PrefixStore(f"dpkit/attempt_{attempt}/group_{_joined[0]}", store)
    group_store.set(f"arrived/{rank}", "1")
    while True:
        missing = [r for r in range(world_size) if not group_store.check([f"arrived/{r}"])]
        if not missing:
            return group_store
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"ddp: rank(s) {', '.join(map(str, missing))} of {world_size} did not join the rendezvous "
                f"at {host}:{port} "
                f"within {wait_seconds:g} s; start every rank (dpkit launch --nproc-per-node N does), or unset "
                f"{', '.join(LAUNCH_VARIABLES)} to run without a launcher"
            )
        time.sleep(0.05)
