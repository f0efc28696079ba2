"""What a measured figure stands beside: a catalogue link's (or GPU memory's) nominal and typical bandwidth,
the ratio, and whether it falls so far short that the machine looks misconfigured."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpkit.plan.catalogue import Catalogue, Link

# a measured figure below this fraction of the catalogue's typically achieved one is flagged
LOW_FRACTION_OF_TYPICAL = 0.5


@dataclass
class Comparison:
    """What a measured figure is compared with: a catalogue entry's nominal and typical bandwidth."""

    name: str | None = None  # e.g. "pcie4", "h100-sxm memory / 2"; None: nothing applies
    nominal_bytes_per_second: float | None = None
    typical_bytes_per_second: float | None = None
    note: str = ""

    def fields(self, measured_bytes_per_second: float, judge: bool = True) -> dict[str, Any]:
        """judge=False where falling short of the link says nothing about the machine (latency-bound
        small messages, pageable copies staged through a pinned buffer)."""
        ratio = measured_bytes_per_second / self.nominal_bytes_per_second if self.nominal_bytes_per_second else None
        low = (
            judge
            and self.typical_bytes_per_second is not None
            and measured_bytes_per_second < LOW_FRACTION_OF_TYPICAL * self.typical_bytes_per_second
        )
        return {
            "compared_with": self.name,
            "nominal_bytes_per_second": self.nominal_bytes_per_second,
            "typical_bytes_per_second": self.typical_bytes_per_second,
            "ratio": ratio,
            "low": low,
        }


def link_comparison(link: Link | None, inferred: bool) -> Comparison:
    if link is None:
        return Comparison()
    how = "inferred from the GPU model" if inferred else "given"
    return Comparison(
        link.name, link.nominal_bytes_per_second, link.achieved_bytes_per_second, f"catalogue link {link.name} ({how})"
    )


def resolve_link(
    catalogue: Catalogue, given: str | None, inferred_name: str | None, argument: str
) -> tuple[Link | None, bool]:
    """(the catalogue link, whether it was inferred): the one `given` by name, else the one `inferred_name`."""
    if given is not None:
        try:
            return catalogue.link(given), False
        except ValueError as error:
            raise ValueError(f"{argument}: {error}") from None
    return (catalogue.link(inferred_name), True) if inferred_name else (None, False)
