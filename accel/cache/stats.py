"""What a cache did during one pipeline call, for `--verbose`, `--json` and the timing table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CallRecord:
    """One transformer call: where it was, how much the decision signal moved, and whether it was cached."""

    step: int
    branch: int
    change: float | None
    cached: bool


@dataclass
class CacheStats:
    """Statistics of the last pipeline call (state and statistics reset at each call)."""

    records: list[CallRecord] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.records)

    @property
    def cached(self) -> int:
        return sum(record.cached for record in self.records)

    @property
    def hit_rate(self) -> float:
        return self.cached / self.calls if self.calls else 0.0

    def __add__(self, other: CacheStats) -> CacheStats:
        return CacheStats(self.records + other.records)

    def as_dict(self) -> dict[str, Any]:
        return {
            "transformer_calls": self.calls,
            "cached_calls": self.cached,
            "hit_rate": self.hit_rate,
            "calls": [record.__dict__ for record in self.records],
        }
