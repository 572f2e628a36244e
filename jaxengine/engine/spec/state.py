"""A sequence's speculation state (`Sequence.spec`; None in an engine without speculation)."""

import dataclasses

from jaxengine.engine.spec.gate import ProbeBackoff
from jaxengine.engine.spec.ngram import NgramIndex


@dataclasses.dataclass
class SpecState:
    """Whether the sequence speculates (decided as it is admitted: `Speculator.admits`), the
    drafts made for its next step (by its last step with the MTP module or a draft model, or by
    ngram's lookup), the ones it offers this step (`Speculator.before_step`; what the scheduler
    verifies, budget permitting), and ngram's index over its tokens, with whether its last
    lookup found drafts and, if not, when the next is due (`Speculator.looks_up`)."""

    speculates: bool = False
    allowed: bool = True  # False: the request may never speculate (it follows a grammar)
    drafts: list[int] = dataclasses.field(default_factory=list)
    offered: list[int] = dataclasses.field(default_factory=list)
    ngram: NgramIndex | None = None
    found: bool = True
    lookups_off: ProbeBackoff | None = None  # set by its first lookup that found nothing

    def forget_drafts(self) -> None:
        """Drops drafts made from a state the sequence no longer has (it was preempted)."""
        self.drafts, self.offered = [], []
