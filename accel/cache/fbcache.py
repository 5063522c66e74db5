"""First Block Cache: skip every block after the first while block 0's residual barely changes.

DBCache with one head block and no tail (accel/cache/blocks.py has the mechanics); kept as a name
of its own because it is the method users and peers compare against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from accel.cache.blocks import BlockCache
from accel.models.base import BlockList
from accel.models.parts import blocks_of


class FirstBlockCache(BlockCache):
    def __init__(
        self, transformer: nn.Module, block_lists: Sequence[BlockList], *, threshold: float, **options: Any
    ) -> None:
        if len(blocks_of(transformer, block_lists)) < 2:
            raise ValueError("First Block Cache needs a transformer with at least two blocks")
        super().__init__(transformer, block_lists, threshold=threshold, first_blocks=1, last_blocks=0, **options)
