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
class GroupWindow:
    """The whole token groups a rank's shard touches, for a module that works group by group (see
    `base.GroupedTokens`): the shard's `real` tokens sit at `offset` in a window of `groups` groups of
    `size` tokens starting at group `first`; the window's other tokens are zeros."""

    first: int
    groups: int
    size: int
    offset: int
    real: int
    shard: int

    def embed(self, x: Tensor, dim: int) -> Tensor:
        """The window around this rank's shard `x` (`shard` tokens along `dim`)."""
        after = self.groups * self.size - self.offset - self.real
        return torch.cat([_zeros(x, dim, self.offset), x.narrow(dim, 0, self.real), _zeros(x, dim, after)], dim)

    def extract(self, y: Tensor, dim: int) -> Tensor:
        """This rank's shard of what the module returned for the window, its pad slots zero."""
        return torch.cat([y.narrow(dim, self.offset, self.real), _zeros(y, dim, self.shard - self.real)], dim)


def group_window(layout: SequenceLayout, rank: int, groups: int) -> GroupWindow:
    """Where rank `rank`'s shard of `layout` falls among `groups` equal consecutive groups of the
    sequence: host arithmetic only. A shard of padding alone gets the last group, run for nothing."""
    if groups < 1 or layout.length % groups:
        raise ValueError(f"context parallelism: {layout.length} tokens do not fall in {groups} equal groups")
    size, real = layout.length // groups, layout.real(rank)
    if real == 0:
        return GroupWindow(groups - 1, 1, size, 0, 0, layout.shard)
    start = rank * layout.shard
    first, end = start // size, -(-(start + real) // size)
    return GroupWindow(first, end - first, size, start - first * size, real, layout.shard)


def _zeros(x: Tensor, dim: int, tokens: int) -> Tensor:
    shape = list(x.shape)
    shape[dim] = tokens
    return x.new_zeros(shape)
