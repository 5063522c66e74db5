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
