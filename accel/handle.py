"""The handle `accel.apply` returns: what it did to one pipeline, its statistics, `attach` and `remove`.

`APPLIED` maps each accelerated pipeline (and attached sibling) to its handle, so a second apply is
refused and `remove` forgets it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from accel.cache.calls import StepCache
from accel.cache.stats import CacheStats
from accel.errors import UserError
from accel.models.base import Family
from accel.models.parts import transformers_of
from accel.models.variants import variant_of_class
from accel.optimize.compile import CompiledRegions
from accel.optimize.quantize import QuantSummary
from accel.parallel.engine import ContextParallel
from accel.parallel.mesh import Degrees, ParallelMesh
from accel.parallel.plan import ResolvedPlans, refuse_layout
from accel.parallel.plan_format import ParallelPlan
from accel.parallel.tensor import TensorParallel
from accel.recipe import Recipe
from accel.vae import ParallelDecode

APPLIED: weakref.WeakKeyDictionary[Any, AccelHandle] = weakref.WeakKeyDictionary()


@dataclass
class AccelHandle:
    """What `apply` did to one pipeline: statistics while it runs, `remove()` to undo it."""

    pipe: Any
    recipe: Recipe
    family: Family
    caches: list[StepCache[Any]] = field(default_factory=list)
    # The process groups in use (None: one process) and the engine on each transformer attribute.
    mesh: ParallelMesh | None = None
    parallel: dict[str, ContextParallel] = field(default_factory=dict)
    # The plans the parallel engines run, resolved once in _join_mesh (None: no sequence or CFG split).
    resolved: ResolvedPlans | None = None
    # The split VAE decode (None: the decode runs whole on every rank).
    vae_decode: ParallelDecode | None = None
    # Each transformer's tensor-parallel split (empty: tp = 1).
    tensor: dict[str, TensorParallel] = field(default_factory=dict)
    quant: QuantSummary | None = None
    compiled: list[CompiledRegions] = field(default_factory=list)
    # Pipelines built from this one's modules and accelerated with it (attach).
    siblings: list[Any] = field(default_factory=list)
    _undo: list[Callable[[], None]] = field(default_factory=list)
    # The steps that change a pipeline's own methods rather than its modules, as (install on a
    # pipeline -> its undo): attach gives them to a sibling.
    _per_pipeline: list[Callable[[Any], Callable[[], None]]] = field(default_factory=list)
    _attach_refusal: str | None = None  # why no sibling may share these modules (None: any may)

    @property
    def cache_stats(self) -> CacheStats | None:
        """Cache statistics of the last pipeline call (None when the cache is off)."""
        if not self.caches:
            return None
        return sum((cache.stats for cache in self.caches), CacheStats())

    @property
    def plans(self) -> Mapping[str, ParallelPlan]:
        """Each transformer's automatic plan, verified (empty: the family's own plans are used)."""
        return self.resolved.automatic if self.resolved is not None else {}

    @property
    def degrees(self) -> Degrees | None:
        """The parallel layout in use (None: one process)."""
        return self.mesh.degrees if self.mesh is not None else None

    @property
    def active(self) -> bool:
        return APPLIED.get(self.pipe) is self

    def attach(self, sibling: Any) -> None:
        """Accelerate `sibling`, a pipeline built from this one's modules (`FluxInpaintPipeline.from_pipe(pipe)`:
        another task on the same weights), alongside it: the modules' changes (parallel plan, compile,
        cache, quantization, VAE) act for it already, and its own methods get this pipeline's
        per-pipeline steps (agreed arguments and noise, the cache's call boundary, encoder and VAE
        placement). One set of hooks serves both, so a server switches tasks without applying again;
        remove() undoes the sibling's steps with the rest."""
        if sibling in APPLIED:
            raise UserError(
                f"accel attach: this {type(sibling).__name__} is already accelerated; remove() its handle first"
            )
        mine, theirs = transformers_of(self.pipe, self.family), _transformers_or_none(sibling, self.family)
        if theirs is None or {attr: id(t) for attr, t in theirs.items()} != {attr: id(t) for attr, t in mine.items()}:
            raise UserError(
                f"accel attach: a {type(sibling).__name__} must run this {type(self.pipe).__name__}'s transformer; "
                f"build it with {type(sibling).__name__}.from_pipe(pipe)"
            )
        if self._attach_refusal is not None:
            raise UserError(self._attach_refusal)
        if self.mesh is not None:
            refuse_layout(self.family, variant_of_class(self.family, type(sibling)), self.recipe.parallel)
        undo: list[Callable[[], None]] = []
        try:
            for install in self._per_pipeline:
                undo.append(install(sibling))
        except BaseException:
            while undo:
                undo.pop()()
            raise
        self._undo.extend(undo)
        self.siblings.append(sibling)
        APPLIED[sibling] = self

    def remove(self) -> None:
        """Undo every step in reverse order; the pipeline then produces bit-identical output to before."""
        while self._undo:
            self._undo.pop()()
        for pipe in (self.pipe, *self.siblings):
            if APPLIED.get(pipe) is self:
                del APPLIED[pipe]
        self.siblings.clear()

    def on_each_pipeline(self, install: Callable[[Any], Callable[[], None]]) -> None:
        """Install a per-pipeline step on this pipeline now, and on each sibling as it attaches."""
        self._per_pipeline.append(install)
        self._undo.append(install(self.pipe))


def _transformers_or_none(pipe: Any, family: Family) -> dict[str, Any] | None:
    try:
        return transformers_of(pipe, family)
    except (AttributeError, KeyError, TypeError):
        return None
