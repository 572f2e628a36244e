"""The speculation counters `stats()` reports."""

import dataclasses


@dataclasses.dataclass
class SpecStats:
    """Counters since start: how many verify rows drafted each position and how many kept it."""

    num_speculative_tokens: int
    requests_speculating: int = 0  # admissions that speculate
    requests_not_speculating: int = 0  # admissions that do not (the gate, or a hit without the draft's state)
    verifies: int = 0  # sequence-steps that verified at least one draft
    draft_seconds: float = 0.0  # host time proposing
    verify_seconds: float = 0.0  # time of the steps that verified drafts
    drafted: list[int] = dataclasses.field(default_factory=list)  # per draft position
    accepted: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.drafted = [0] * self.num_speculative_tokens
        self.accepted = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.verifies += 1
        for j in range(num_drafts):
            self.drafted[j] += 1
            self.accepted[j] += j < num_accepted

    def as_dict(self) -> dict:
        drafted, accepted = sum(self.drafted), sum(self.accepted)
        return {
            "spec_requests_speculating": self.requests_speculating,
            "spec_requests_not_speculating": self.requests_not_speculating,
            "spec_verifies": self.verifies,
            "spec_draft_tokens": drafted,
            "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
            "spec_acceptance_rate_per_position": [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted)],
            "spec_mean_accepted_length": 1 + accepted / self.verifies if self.verifies else 0.0,
            "spec_draft_seconds": self.draft_seconds,
            "spec_verify_seconds": self.verify_seconds,
        }
