"""How a sequence of any length is spread over P ranks: padded to a multiple of P, cut in equal shards.

Real prompts give lengths like 1241 tokens; padding (and masking the pad keys) makes every
length work on every world size, where an unpadded split would refuse or drop tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class SequenceLayout:
    """`length` tokens over `world` shards of `shard` tokens each; the last `pad` slots are padding."""

    length: int
    world: int

    @property
    def shard(self) -> int:
        return -(-self.length // self.world)

    @property
    def padded(self) -> int:
        return self.shard * self.world

    @property
    def pad(self) -> int:
        return self.padded - self.length

    def valid(self, device: torch.device | str = "cpu") -> Tensor:
        """(world, shard) bool: which slots of each shard hold real tokens."""
        return (torch.arange(self.padded, device=device) < self.length).view(self.world, self.shard)

    def real(self, rank: int) -> int:
        """How many of shard `rank`'s slots hold real tokens (they come first)."""
        return min(self.shard, max(0, self.length - rank * self.shard))

    def split(self, x: Tensor, dim: int, rank: int) -> Tensor:
        """Rank `rank`'s shard of `x` (full length along `dim`), zero-padded where needed."""
        if x.shape[dim] != self.length:
            raise ValueError(f"expected {self.length} tokens along dim {dim}, got {x.shape[dim]}")
        if self.pad:
            dim = dim % x.dim()
            widths = [0, 0] * (x.dim() - 1 - dim) + [0, self.pad]
            x = F.pad(x, widths)
        return x.narrow(dim, rank * self.shard, self.shard)

    def join(self, shards: list[Tensor], dim: int) -> Tensor:
        """The full sequence back from every rank's shard, padding dropped."""
        return torch.cat(shards, dim=dim).narrow(dim, 0, self.length)


@dataclass(frozen=True)
class GroupRun:
    """A stretch of a rank's shard that a module working group by group (see `plan_format.GroupedTokens`)
    can take in one call: `tokens` tokens from shard position `start`, lying in the `groups` groups
    from group `first` on (whole groups, or part of one group)."""

    start: int
    tokens: int
    first: int
    groups: int


def group_runs(layout: SequenceLayout, rank: int, groups: int) -> list[GroupRun]:
    """Rank `rank`'s real tokens cut where the sequence's `groups` equal consecutive groups begin,
    into at most three runs: the end of a group the previous rank began, whole groups, the start of
    a group the next rank ends. Host arithmetic only; no runs for a shard of padding alone."""
    if groups < 1 or layout.length % groups:
        raise ValueError(f"context parallelism: {layout.length} tokens do not fall in {groups} equal groups")
    size = layout.length // groups
    begin = rank * layout.shard
    end = begin + layout.real(rank)
    runs, position = [], begin
    while position < end:
        group = position // size
        whole = (end - position) // size if position % size == 0 else 0
        stop = position + whole * size if whole else min(end, (group + 1) * size)
        runs.append(GroupRun(position - begin, stop - position, group, max(whole, 1)))
        position = stop
    return runs
