"""What each receipt licenses and what it does not (`003` Table 4), as data.

The terminal output, the certificate and the export all read this one table, so the words an
operator sees for a receipt are the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    receipt: str
    measures: str
    licenses: str
    does_not_license: str


TABLE4: tuple[Claim, ...] = (
    Claim(
        "Loss / State3",
        "objective quality on the visited region",
        "falling canary NLL (beyond its bootstrap noise): the objective improved on the visited region",
        "atlas preservation, overlap compatibility, or whether progress came from a narrowed visited region",
    ),
    Claim(
        "Occupancy",
        "breadth of expert usage",
        "the run uses a broad / narrow subset of experts",
        "whether co-active experts are compatible, or that a resume preserved the atlas",
    ),
    Claim(
        "State1 (boundary margin)",
        "boundary-local decisiveness of top-k competitions",
        "top-k competitions are sharper / noisier near the boundary",
        "global routed health; under occupancy collapse it cannot certify healthier routing",
    ),
    Claim(
        "State2 (C2)",
        "co-active overlap compatibility",
        "adjacent co-active experts are becoming more / less compatible",
        "that the atlas is broadly used; C2 alone cannot separate local compatibility from occupancy collapse",
    ),
    Claim(
        "Checkpoint-pair drift",
        "movement of the routed object between checkpoints",
        "coordinates / boundaries / transitions / content moved by this much",
        "whether that motion is acceptable for the stage without a stage-specific margin",
    ),
    Claim(
        "Refinement margin",
        "drift and occupancy loss of protected layers against a budget τ",
        "the candidate refined (r ≥ 0) or repurposed (r < 0) the protected layers",
        "that the candidate is better at its task, or anything about unprotected layers",
    ),
    Claim(
        "Handoff margin",
        "protected-layer C2 and occupancy against a healthy reference",
        "the checkpoint clears (h ≥ 0) or misses the reference overlap-and-occupancy floor",
        "downstream quality after post-training",
    ),
    Claim(
        "Resume baseline",
        "the atlas at a resume or regime change",
        "this is the state of the routed object at resume time",
        "any preservation claim about what happened after the resume",
    ),
)
