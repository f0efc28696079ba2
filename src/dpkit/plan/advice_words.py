"""How the advice says it: the phases of a step, the parts of the state a strategy shards, sizes and device
counts, in the words the recommendation and `auto`'s reason use."""

from __future__ import annotations

from dpkit.strategies import strategy_class

PHASE_WORDS = {
    "scatter": "input scatter",
    "replicate": "per-step parameter broadcast",
    "gather": "output gather",
    "loss": "loss on device 0",
    "reduce": "gradient reduce to device 0",
    "compress": "gradient compression's work",
    "all_reduce": "exposed all-reduce",
    "all_gather": "exposed parameter all-gathers",
    "reduce_scatter": "exposed gradient reduce-scatter",
    "launch": "GIL-serialised kernel launches",
    "overhead": "per-step Python and threads",
    "optimizer": "optimizer step",
    "forward": "forward",
    "backward": "backward",
}
PART_WORDS = {"weights": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state"}


def phase_words(strategy: str) -> dict[str, str]:
    """PHASE_WORDS for a strategy: launches hold the GIL only where one process drives several replicas."""
    if strategy_class(strategy).traits.threads_per_step:
        return PHASE_WORDS
    return {**PHASE_WORDS, "launch": "kernel launches"}


def shards_words(strategy: str) -> str:
    """What the strategy shards, in words: "parameters, gradients and optimizer state"."""
    words = [PART_WORDS[part] for part in strategy_class(strategy).traits.sharded_parts]
    return ", ".join(words[:-1]) + (" and " if len(words) > 1 else "") + words[-1] if words else "nothing"


def gib(nbytes: float) -> str:
    """Bytes in GiB, one decimal: "12.6 GiB"."""
    return f"{nbytes / 2**30:.1f} GiB"


def devices_words(count: int, nodes: int) -> str:
    """A device count in words: 8 devices, or across nodes 8 devices per node (16 in all)."""
    return f"{count} device{'s' if count != 1 else ''}" + (f" per node ({count * nodes} in all)" if nodes > 1 else "")


def milliseconds(seconds: float) -> str:
    """Seconds in milliseconds with the unit, as the phase table shows them: 6,407 ms, 22.7 ms, 1.42 ms."""
    ms = seconds * 1e3
    return f"{ms:,.0f} ms" if ms >= 100 else f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"
