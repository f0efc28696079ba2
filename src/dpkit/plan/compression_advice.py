"""Whether compressing the gradients pays for the recommended configuration, and the lines that say so with the
figures that decide: the recommendation's `compress` and its reasons.

Without a compression asked, the question is open only where the exposed communication is the largest part of
the step: then each compression the strategy takes is predicted (CANDIDATES, the most faithful first) and the
most faithful one that shortens the step by at least PAYS is named, a lossier one only where it is clearly faster
(LOSSIER_WORTH). Where computing (or anything else) is the largest part, a line says compression would not pay,
and which term decides. With a compression asked, the lines say what it changes for the recommended strategy,
or that the strategy does not take it.

    advice = advise_compression(chosen, Compression(), rerun, rivals)   # rerun(prediction, compression)
    advice.compress, advice.reasons
    add_compression_advice(recommendation, predictions, asked, rerun)   # into the recommendation
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dpkit.plan.advice_words import PHASE_WORDS, milliseconds
from dpkit.plan.advisor import Recommendation, usable
from dpkit.plan.cost_model import Prediction
from dpkit.strategies import strategy_traits
from dpkit.strategies.compression import Compression, parse_compression

# the compressions the advice tries, the most faithful first: 16 bits (bf16 rather than fp16: the same bytes, and
# no overflow to scale against), then PowerSGD at rank 4 and at its default rank 2 (Vogels et al. 2019 reach the
# uncompressed accuracy at ranks 2 to 4)
CANDIDATES = ("bf16", "powersgd:4", "powersgd:2")
PAYS = 0.05  # a compression pays when it shortens the step by at least this share
LOSSIER_WORTH = 0.9  # a lossier compression is named only where its step is at most this share of a more faithful one's
RIVAL_WORTH = 1.1  # another strategy, compressed, is named where it is this much faster than the recommended one
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")  # what crosses the link between persistent replicas
EXCHANGE = ("all_reduce", "reduce_scatter")  # what a gradient compression shrinks
COMPUTING = ("forward", "backward")

# rerun(prediction, compression) -> the same configuration predicted with that compression
Rerun = Callable[[Prediction, Compression], Prediction]


@dataclass
class CompressionAdvice:
    compress: str | None = None  # the compression the recommendation names (None: none pays, or none applies)
    reasons: list[str] = field(default_factory=list)


def advise_compression(
    chosen: Prediction, asked: Compression | str | None, rerun: Rerun, rivals: Sequence[Prediction] = ()
) -> CompressionAdvice:
    """The compression for the recommended configuration `chosen` and why: the one asked (if it takes it), or
    without one asked the one that pays; `rivals`: the other configurations on as many devices, which the advice
    tries compressed too, to name one that would then be clearly faster."""
    asked = parse_compression(asked)
    if asked.compresses:
        return _asked(chosen, asked, rerun)
    if chosen.total_devices <= 1:
        return CompressionAdvice(None, _rival_lines(chosen, chosen, rerun, rivals))
    takes = strategy_traits(chosen.strategy, **chosen.options).compressions
    if takes == ("none",):
        return CompressionAdvice(None, _rival_lines(chosen, chosen, rerun, rivals))
    part, seconds = largest_part(chosen)
    if part != "communication":
        exposed = sum(chosen.breakdown.get(name, 0.0) for name in COLLECTIVES)
        return CompressionAdvice(
            None,
            [
                f"compression would not pay: the step is {PART_BOUND.get(part, part + '-bound')}, "
                f"{_part_words(part)} {milliseconds(seconds)} of the {milliseconds(chosen.step_seconds)} step, "
                f"the exposed communication only {milliseconds(exposed)}"
            ],
        )
    tried = _tried(chosen, rerun)
    pick = _most_faithful_that_pays(chosen, tried)
    if pick is None:
        return CompressionAdvice(None, [_none_pays(chosen, tried)] + _rival_lines(chosen, chosen, rerun, rivals))
    compressed = tried[pick]
    lines = [_what_it_changes(pick, chosen, compressed)]
    return CompressionAdvice(pick, lines + _rival_lines(chosen, compressed, rerun, rivals))


PART_BOUND = {"computing": "compute-bound", "launch": "launch-bound", "optimizer": "bound by the optimizer step"}


def largest_part(prediction: Prediction) -> tuple[str, float]:
    """The largest part of the step: "communication" (the exposed collectives together), "computing" (forward and
    backward together), or another phase by its name; with its seconds."""
    parts = {
        "communication": sum(prediction.breakdown.get(name, 0.0) for name in COLLECTIVES),
        "computing": sum(prediction.breakdown.get(name, 0.0) for name in COMPUTING),
    }
    for name, seconds in prediction.breakdown.items():
        if name not in COLLECTIVES and name not in COMPUTING:
            parts[name] = seconds
    return max(parts.items(), key=lambda item: item[1])


def _part_words(part: str) -> str:
    return "forward and backward take" if part == "computing" else f"the {PHASE_WORDS.get(part, part)} takes"


def _tried(prediction: Prediction, rerun: Rerun) -> dict[str, Prediction]:
    """The configuration predicted with each of CANDIDATES its strategy takes."""
    takes = strategy_traits(prediction.strategy, **prediction.options).compressions
    return {kind: rerun(prediction, parse_compression(kind)) for kind in CANDIDATES if kind.split(":")[0] in takes}


def _most_faithful_that_pays(chosen: Prediction, tried: dict[str, Prediction]) -> str | None:
    """Of the compressions tried (most faithful first), the first that pays, or a lossier one where it is clearly
    faster still."""
    pick: str | None = None
    for kind, prediction in tried.items():
        if prediction.step_seconds > (1 - PAYS) * chosen.step_seconds:
            continue
        if pick is None or prediction.step_seconds <= LOSSIER_WORTH * tried[pick].step_seconds:
            pick = kind
    return pick


def exchange_seconds(prediction: Prediction) -> float:
    """The exposed gradient exchange (without the compression's work)."""
    return sum(prediction.breakdown.get(name, 0.0) for name in EXCHANGE)


def _exchange_words(before: Prediction, after: Prediction) -> str:
    """The exchange's phases in words: the one phase it has, or all of them."""
    names = {name for p in (before, after) for name in EXCHANGE if p.breakdown.get(name)}
    return PHASE_WORDS[names.pop()] if len(names) == 1 else "exposed gradient exchange"


def _what_it_changes(kind: str, before: Prediction, after: Prediction) -> str:
    """The line naming the compression: what it does to the exchange, of which step, and the step it leaves."""
    compression = parse_compression(kind)
    words = _exchange_words(before, after)
    work = after.breakdown.get("compress", 0.0)
    faster = after.samples_per_second / before.samples_per_second
    if compression.wire_dtype is not None:
        how = f"{kind} halves the bytes of the {words}"
    else:
        how = f"{kind} sends rank-{compression.rank} factors instead of the gradients in the {words}"
    return (
        f"{how}: {milliseconds(exchange_seconds(before))} -> {milliseconds(exchange_seconds(after))} of a "
        f"{milliseconds(before.step_seconds)} step, plus {milliseconds(work)} of "
        f"compression work: the step {milliseconds(after.step_seconds)} ({faster:.2f}x the samples/s)"
        + ("; after its warm-up (the first steps go uncompressed)" if compression.wire_dtype is None else "")
        + ("; it costs more than it saves here" if faster < 1 else "")
    )


def _none_pays(chosen: Prediction, tried: dict[str, Prediction]) -> str:
    """Why no compression pays although communication is the largest part: what the best one would save, and the
    collective it cannot shrink when that one dominates."""
    largest = max(COLLECTIVES, key=lambda name: chosen.breakdown.get(name, 0.0))
    text = "compression would not pay enough"
    if tried:
        best_kind, best = min(tried.items(), key=lambda item: item[1].step_seconds)
        before, after = milliseconds(chosen.step_seconds), milliseconds(best.step_seconds)
        text += f": the best, {best_kind}, takes the step only from {before} to {after}"
    if largest == "all_gather":
        text += (
            f"; the {PHASE_WORDS[largest]} ({milliseconds(chosen.breakdown[largest])}) carry weights, which no "
            "gradient compression shrinks"
        )
    return text


def _rival_lines(chosen: Prediction, chosen_best: Prediction, rerun: Rerun, rivals: Sequence[Prediction]) -> list[str]:
    """Another configuration on as many devices (or, when one device is recommended, on the most devices) that,
    with a compression it takes, would be RIVAL_WORTH faster than the recommendation at its best."""
    best: tuple[str, Prediction, Prediction] | None = None
    for rival in rivals:
        if rival.strategy == chosen.strategy or rival.total_devices <= 1:
            continue
        tried = _tried(rival, rerun)
        pick = _most_faithful_that_pays(rival, tried)
        if pick is not None and (best is None or tried[pick].step_seconds < best[2].step_seconds):
            best = (pick, rival, tried[pick])
    if best is None:
        return []
    kind, rival, compressed = best
    gain = compressed.samples_per_second / chosen_best.samples_per_second
    if gain < RIVAL_WORTH:
        return []
    speedup = rival.speedup * compressed.samples_per_second / rival.samples_per_second
    would = "help" if chosen.total_devices <= 1 else "be faster still"
    return [
        f"with compression {rival.strategy} on {rival.total_devices} devices would {would}: {kind} takes its "
        f"step from {milliseconds(rival.step_seconds)} to {milliseconds(compressed.step_seconds)} "
        f"({speedup:.2f}x one device, "
        f"{gain:.2f}x the samples/s of {chosen_best.strategy}"
        + (f" with {chosen_best.compress}" if chosen_best.compress != "none" else "")
        + f"); plan it with --compress {kind}"
    ]


def _asked(chosen: Prediction, asked: Compression, rerun: Rerun) -> CompressionAdvice:
    """A compression asked: what it changes for the recommended configuration, or that its strategy does not take
    it (then predicted uncompressed)."""
    if chosen.total_devices <= 1:
        return CompressionAdvice(None, [])
    if chosen.compress != str(asked):
        takes = strategy_traits(chosen.strategy, **chosen.options).compressions
        return CompressionAdvice(
            None,
            [
                f"{chosen.strategy} takes no {asked} (it takes {', '.join(takes)}): predicted and recommended "
                "uncompressed"
            ],
        )
    uncompressed = rerun(chosen, Compression())
    return CompressionAdvice(str(asked), [_what_it_changes(str(asked), uncompressed, chosen)])


def add_compression_advice(
    recommendation: Recommendation, predictions: Sequence[Prediction], asked: Compression, rerun: Rerun
) -> None:
    """The advice for the recommended configuration in `recommendation`: its `compress`, and the lines after the
    bottleneck link's (or last). Nothing when nothing is recommended."""
    if recommendation.strategy is None:
        return
    chosen = next(
        (
            p
            for p in predictions
            if p.strategy == recommendation.strategy and p.total_devices == recommendation.devices and usable(p)
        ),
        None,
    )
    if chosen is None:
        return
    # the rivals: the configurations on as many devices, or, when one device is recommended, on the most devices
    most = max(p.total_devices for p in predictions if usable(p))
    target = chosen.total_devices if chosen.total_devices > 1 else most
    rivals = [p for p in predictions if usable(p) and p.total_devices == target]
    advice = advise_compression(chosen, asked, rerun, rivals)
    recommendation.compress = advice.compress
    bottleneck = next(
        (i for i, reason in enumerate(recommendation.reasons) if reason.startswith("bottleneck link")), None
    )
    at = len(recommendation.reasons) if bottleneck is None else bottleneck + 1
    recommendation.reasons[at:at] = advice.reasons
