"""Moving rows between the ranks of a split decode: halos from neighbours, and whole feature maps.

Halos travel point to point and only between neighbours, started before the caller computes so
the transfer overlaps the local convolution.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from accel.errors import NotAvailableError
from accel.parallel.comm import TRAFFIC, global_rank
from accel.vae.rows import RowSplit


class Halo:
    """The `above` rows that end the previous rank's map and the `below` rows that start the next
    one's, for an operation that reaches that far past this rank's own rows."""

    def __init__(self, x: Tensor, above: int, below: int, split: RowSplit, group: dist.ProcessGroup | None) -> None:
        scale = split.scale_of_local(x.shape[-2])
        fewest = min(split.counts) * scale
        if max(above, below) > fewest:
            raise NotAvailableError(
                f"parallel VAE: an operation reaches {max(above, below)} rows past a rank that holds only {fewest} "
                f"at this resolution; decode on fewer ranks or a larger image"
            )
        self.above: Tensor | None = None
        self.below: Tensor | None = None
        ops: list[dist.P2POp] = []
        sent = 0

        if not split.first:
            if above:
                self.above = x.new_empty(_with_rows(x, above))
                ops.append(dist.P2POp(dist.irecv, self.above, global_rank(group, split.rank - 1), group))
            if below:
                head = x[..., :below, :].contiguous()
                ops.append(dist.P2POp(dist.isend, head, global_rank(group, split.rank - 1), group))
                sent += head.numel() * head.element_size()
        if not split.last:
            if below:
                self.below = x.new_empty(_with_rows(x, below))
                ops.append(dist.P2POp(dist.irecv, self.below, global_rank(group, split.rank + 1), group))
            if above:
                tail = x[..., x.shape[-2] - above :, :].contiguous()
                ops.append(dist.P2POp(dist.isend, tail, global_rank(group, split.rank + 1), group))
                sent += tail.numel() * tail.element_size()
        self._works = dist.batch_isend_irecv(ops) if ops else []
        TRAFFIC.add("halo_p2p", sent)

    def wait(self) -> tuple[Tensor | None, Tensor | None]:
        for work in self._works:
            work.wait()
        return self.above, self.below


def _with_rows(x: Tensor, rows: int) -> tuple[int, ...]:
    return (*x.shape[:-2], rows, x.shape[-1])


def pad_rows(x: Tensor, rows: int) -> Tensor:
    """`x` with zero rows appended up to `rows` (dim -2), as equal-shape collectives need."""
    if x.shape[-2] == rows:
        return x.contiguous()
    padded = x.new_zeros(_with_rows(x, rows))
    padded[..., : x.shape[-2], :] = x
    return padded


def gather_rows(x: Tensor, split: RowSplit, group: dist.ProcessGroup | None, to: int | None) -> Tensor | None:
    """The whole map from every rank's rows, on every rank (`to=None`) or on global rank `to` only
    (the others get None)."""
    scale = split.scale_of_local(x.shape[-2])
    most = max(split.counts) * scale
    padded = pad_rows(x, most)
    world = split.world
    nbytes = padded.numel() * padded.element_size()
    if to is None:
        pieces = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(pieces, padded, group=group)
        TRAFFIC.add("all_gather", nbytes * (world - 1))
    else:
        receiving = dist.get_rank() == to
        pieces = [torch.empty_like(padded) for _ in range(world)] if receiving else None
        dist.gather(padded, pieces, dst=to, group=group)
        TRAFFIC.add("gather", 0 if receiving else nbytes)
        if not receiving:
            return None
    assert pieces is not None
    return torch.cat([piece[..., : count * scale, :] for piece, count in zip(pieces, split.counts)], dim=-2)
