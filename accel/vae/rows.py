"""Which latent rows each rank decodes.

Every feature map inside a decoder is the latent scaled by a whole number along its height, so
one split of the latent rows fixes every rank's rows at every resolution.
"""

from __future__ import annotations

from dataclasses import dataclass

from accel.errors import NotAvailableError


@dataclass(frozen=True)
class RowSplit:
    """`rows` latent rows dealt out in order over `world` ranks, the first ones one row more."""

    rows: int
    world: int
    rank: int

    @property
    def counts(self) -> tuple[int, ...]:
        base, extra = divmod(self.rows, self.world)
        return tuple(base + (r < extra) for r in range(self.world))

    def start(self, rank: int) -> int:
        return sum(self.counts[:rank])

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1

    def scale_of_local(self, local_rows: int) -> int:
        """The factor between this rank's latent rows and a local feature map of `local_rows`."""
        own = self.counts[self.rank]
        if local_rows % own:
            raise NotAvailableError(
                f"parallel VAE: a feature map has {local_rows} rows where this rank decodes {own} latent rows; "
                "the decoder resizes by a fraction, which the split cannot follow; set [vae] parallel = false"
            )
        return local_rows // own

    def scale_of_full(self, full_rows: int) -> int:
        if full_rows % self.rows:
            raise NotAvailableError(
                f"parallel VAE: a gathered feature map has {full_rows} rows for {self.rows} latent rows; "
                "set [vae] parallel = false"
            )
        return full_rows // self.rows

    def span(self, scale: int, rank: int | None = None) -> tuple[int, int]:
        """Rows [start, stop) that `rank` (default: this one) holds at `scale`."""
        rank = self.rank if rank is None else rank
        start = self.start(rank)
        return start * scale, (start + self.counts[rank]) * scale
