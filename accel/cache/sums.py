"""Where a deciding cache measures its change and over which ranks it sums it: one decision per
layout, as one process would take it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accel.handle import AccelHandle
    from accel.parallel.engine import ContextParallel


def cache_sums(handle: AccelHandle, attr: str) -> dict[str, Any]:
    """Where a deciding cache on transformer `attr` measures its change, and over which ranks it
    sums it (the keywords `BlockCache` and `MagCache` take): one decision per layout, as one process."""
    stream = handle.family.primary_stream
    return dict(
        primary_stream=stream, group=_cache_group(handle), real_tokens=_real_tokens(handle.parallel.get(attr), stream)
    )


def _cache_group(handle: AccelHandle) -> Any:
    """The ranks that share one transformer call, whose block-0 change the cache sums: the sequence
    ranks (with their TP ranks, which hold the same change whole: the ratio the cache reads is
    unchanged, and every rank of the call reads the same sum), and with batched CFG split over the
    halves the whole mesh (one call, one decision)."""
    mesh = handle.mesh
    if mesh is None:
        return None
    if mesh.degrees.cfg > 1 and handle.family.cfg == "batch":
        return mesh.group
    return mesh.call_group if mesh.degrees.tp > 1 else mesh.sequence_group


def _real_tokens(engine: ContextParallel | None, stream: str) -> Callable[[], int | None] | None:
    """The cache's primary stream is cut like the transformer input of the same name."""
    if engine is None:
        return None
    return lambda: engine.real_tokens(stream)
