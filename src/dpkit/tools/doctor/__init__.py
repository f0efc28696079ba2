"""What this machine has and how fast its links really are: the measurements behind `dpkit doctor`.

- Devices: CPU cores and torch threads; each GPU's name, memory, SMs and compute capability.
- Copies: on CUDA, host->device and device->host (pinned and pageable host memory), a copy within each
  GPU and between each pair of GPUs; on CPU, a memory copy (what moving a tensor between virtual CPU
  devices costs) (copies.py).
- Collectives: all-reduce and broadcast over the backend in use (gloo on CPU, NCCL on GPUs), one process
  per device on loopback (collectives.py), with nccl-tests' definitions (bandwidth.py; see PERFORMANCE.md in
  NVIDIA/nccl-tests): algbw = bytes / time; busbw = algbw * factor, the factor being 2(n-1)/n for all-reduce
  and 1 for broadcast, so that busbw is comparable with one link's per-direction bandwidth whatever n is.
- Peer access between GPUs (torch.cuda.can_device_access_peer).

Each figure stands beside the nominal one from the catalogue (dpkit.plan.catalogue) with the ratio, and
beside the typically achieved one, so a misconfigured machine (a GPU in an x4 slot, P2P disabled, NCCL
falling back to sockets) stands out (comparison.py). checkup.py runs the whole check-up: `run_doctor`.
"""
