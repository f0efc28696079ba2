"""ddp's gradient buckets through the compressed exchange (compressed_sum.py), off autograd's thread.

DDP's comm hook must return a future at once, so that backward goes on while a bucket crosses. Here the hook
hands the bucket to one worker thread and returns a future the worker completes: the worker runs each bucket's
exchange (several collectives, some depending on others' results) in the order the hook saw them, which is the
same on every rank, while backward computes the next buckets. The bucket that carries the step marks first
all-reduces the marks alone (a few float64 elements: they must stay exact, and 16-bit or low-rank values would
not), then its gradients.

Each bucket is one entry of the collective record, named with its compression and sized with the bytes this
process put into its collectives (what `communication_bytes` and `gradient_bytes_per_step` count).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from dpkit.observe.collectives import RECORD
from dpkit.strategies.compressed_sum import CompressedSum
from dpkit.strategies.step_marks import StepMarks


class ProcessPeers:
    """The participants of an exchange are the processes of the default group, one each."""

    def __init__(self, world_size: int):
        self.count = world_size
        self.sent_bytes = 0  # what this process put into the collectives since the caller last reset it

    def sum(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        (mine,) = tensors
        summed = mine.contiguous().clone()
        self.sent_bytes += summed.numel() * summed.element_size()
        dist.all_reduce(summed)
        return summed

    def sum_rounded(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype, scale: float) -> torch.Tensor:
        """(Counted as one all-reduce of the 16-bit gradient, as the uncompressed exchange counts its float32 one.)
        A reduce-scatter in 16 bits (each process receives every process's chunk of its share), its chunks summed
        in float32, scaled and rounded, then an all-gather in 16 bits."""
        (mine,) = tensors
        numel, processes = mine.numel(), self.count
        chunk = -(-numel // processes)
        padded = torch.zeros(chunk * processes, dtype=dtype, device=mine.device)
        padded[:numel] = mine.to(dtype)
        received = torch.empty_like(padded)
        dist.all_to_all_single(received, padded)
        share = (received.view(processes, chunk).float().sum(0) * scale).to(dtype)
        gathered = torch.empty_like(padded)
        dist.all_gather_single(gathered, share)
        self.sent_bytes += numel * padded.element_size()  # as an all-reduce of the 16-bit gradient counts it
        return gathered[:numel].float()


class CompressedBuckets:
    """The worker that exchanges ddp's buckets compressed; `submit` from the comm hook, `close` at teardown."""

    def __init__(self, exchange: CompressedSum, world_size: int, marks: StepMarks, names: dict[int, str]):
        self.exchange = exchange
        self.peers = ProcessPeers(world_size)
        self.marks = marks
        self.names = names  # id(parameter) -> its name: the exchange's state is kept by name
        self.bucket_seconds: list[tuple[float, float]] = []  # (started, done) per bucket
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="dpkit-compressed-buckets", daemon=True)
        self._thread.start()

    def submit(self, bucket, timed: bool) -> torch.futures.Future:  # unannotated bucket: torch's GradBucket
        """The future of the bucket's mean gradient, as DDP's comm hook returns it; the worker completes it."""
        buffer = bucket.buffer()
        gradients = bucket.gradients()
        names = [self.names[id(parameter)] for parameter in bucket.parameters()]
        index = bucket.index()
        carries_marks = self.marks.due_in_bucket(index)
        future: torch.futures.Future = torch.futures.Future()

        def job() -> None:
            started = time.perf_counter()
            try:  # (backward's pinned call site names these collectives: DDP waits for them inside backward)
                if carries_marks:
                    self.marks.all_reduce_marks_alone()
                self._exchange_bucket(index, gradients, names)
            except BaseException as error:  # told to backward through the future, which raises it there
                future.set_exception(error)
                return
            if timed:
                self.bucket_seconds.append((started, time.perf_counter()))
            future.set_result(buffer)

        self._jobs.put(job)
        return future

    def _exchange_bucket(self, index: int, gradients: list[torch.Tensor], names: list[str]) -> None:
        label = str(self.exchange.compression) if self.exchange.compressing_now else "uncompressed"
        with RECORD.issuing(f"all_reduce of gradient bucket {index} ({label})") as entry:
            self.peers.sent_bytes = 0
            means = self.exchange(names, [gradients], self.peers)
            if entry is not None:
                entry.size_bytes = self.peers.sent_bytes
        with torch.no_grad():
            for gradient, mean in zip(gradients, means):
                gradient.copy_(mean)  # (views into the bucket's buffer)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
