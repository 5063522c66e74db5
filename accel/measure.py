"""Measuring: warm-up runs, then timed runs with the peak memory sampled and the collective traffic
counted; a recipe applied, measured and undone; --compare's baseline and accelerated runs in order."""

from __future__ import annotations

import resource
import statistics
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from accel.apply_recipe import apply
from accel.generate import generate_with_audio
from accel.media import Audio
from accel.models.call import call_steps
from accel.optimize.compile import compiled_graphs
from accel.parallel.comm import TRAFFIC
from accel.parallel.encoders import ONE_RANK_PLACEMENTS, SHARDED
from accel.parallel.mesh import Degrees
from accel.recipe import Recipe


@dataclass
class Measurement:
    """Timed generations after their warm-up runs (`output`: a latent pass's saved fields where asked)."""

    output: np.ndarray | dict[str, Any] | None  # None on a rank that does not decode ([memory] vae = "rank0")
    times: list[float]
    warmup_seconds: float
    steps: int
    peak_memory_bytes: int
    # Bytes this rank sent through collectives during the timed runs, by kind.
    bytes_sent: dict[str, int]
    # Graphs torch.compile built during the warm-up and during the timed runs (None: not counted).
    graphs_warmup: int | None = None
    graphs_timed: int | None = None
    # The sound the last run made with its video (LTX-2); None: the pipeline makes none.
    audio: Audio | None = None

    @property
    def seconds(self) -> float:
        """The median timed run: robust to one slow repeat."""
        return statistics.median(self.times)


@dataclass
class Measured:
    """One recipe applied to a pipeline and measured: what `run` and each bench variant report."""

    measurement: Measurement
    cache: dict[str, Any] | None
    degrees: Degrees | None
    vae_split: bool
    quant: dict[str, Any] | None
    # Scope, mode, compiled_modules and the graphs built in warm-up / timed runs (None: no compile).
    compile: dict[str, Any] | None
    # Where the context-parallel plan came from: "family", or, learned and verified, "automatic" or
    # "diffusers _cp_plan" (the class's own plan, its streams learned).
    plan: str = "family"
    # Lines for the run's report about how the recipe met the calls (a context-parallel plan that cut none).
    notes: list[str] = field(default_factory=list)

    @property
    def bytes_sent_per_rank(self) -> dict[str, int] | None:
        """This rank's bytes by collective kind; None on one process, and with compile, whose
        collectives inside graphs are not counted (comm.Traffic): no partial figure."""
        if self.degrees is None or self.compile is not None:
            return None
        return dict(self.measurement.bytes_sent)


def measure(
    pipe: Any,
    kwargs: dict[str, Any],
    seed: int,
    warmup: int,
    progress: Callable[[str], AbstractContextManager[Any]] | None = None,
    label: str = "generating",
    repeats: int = 1,
    latents: tuple[str, ...] = (),
) -> Measurement:
    """Warm-up runs, then `repeats` timed runs (the output is the last one's).

    `progress(label)` gives a context in which step events drive a bar (None: no bar)."""
    show = progress or (lambda _label: nullcontext())
    graphs_before = compiled_graphs()
    start = time.perf_counter()
    for index in range(warmup):
        with show(f"{label}: warm-up {index + 1}/{warmup}"):
            generate_with_audio(pipe, kwargs, seed, latents)
    warmup_seconds = time.perf_counter() - start
    graphs_warmed = compiled_graphs()
    device = device_of(pipe)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    TRAFFIC.reset()
    times: list[float] = []
    with PeakMemory(device) as memory:
        for index in range(repeats):
            with show(label if repeats == 1 else f"{label}: run {index + 1}/{repeats}"):
                start = time.perf_counter()
                output, audio = generate_with_audio(pipe, kwargs, seed, latents)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
    graphs_after = compiled_graphs()
    return Measurement(
        output,
        times,
        warmup_seconds,
        call_steps(pipe, kwargs),
        memory.peak,
        dict(TRAFFIC.bytes_sent),
        _difference(graphs_warmed, graphs_before),
        _difference(graphs_after, graphs_warmed),
        audio,
    )


def measure_recipe(
    pipe: Any,
    recipe: Recipe,
    kwargs: dict[str, Any],
    warmup: int,
    repeats: int = 1,
    progress: Callable[[str], AbstractContextManager[Any]] | None = None,
    label: str = "generating",
    latents: tuple[str, ...] = (),
) -> Measured:
    """Apply the recipe, measure it, undo it: every measured row of `run` and `bench` comes from here."""
    handle = apply(pipe, recipe)
    try:
        result = measure(pipe, kwargs, recipe.generate.seed, warmup, progress, label, repeats, latents)
        stats = handle.cache_stats
        compiled = None
        if recipe.compile.enabled:
            compiled = {
                "scope": recipe.compile.scope,
                "mode": recipe.compile.mode,
                "backend": recipe.compile.backend,
                "compiled_modules": sum(len(regions.modules) for regions in handle.compiled),
                "graphs_warmup": result.graphs_warmup,
                "graphs_timed": result.graphs_timed,
            }
        return Measured(
            result,
            cache=stats.as_dict() if stats is not None else None,
            degrees=handle.degrees,
            vae_split=handle.vae_decode is not None,
            quant=handle.quant.as_dict() if handle.quant is not None else None,
            compile=compiled,
            plan=next((plan.origin for plan in handle.plans.values() if plan.origin), "automatic")
            if handle.plans
            else "family",
            notes=[note for engine in handle.parallel.values() if (note := engine.uncut_note()) is not None],
        )
    finally:
        handle.remove()


def compare_order(recipe: Recipe) -> str:
    """How --compare orders its timed runs: "interleaved" (baseline, accelerated, baseline, …), so
    that a machine slowing down or speeding up meanwhile touches both sides alike; "sequential" (all
    baseline runs, then all accelerated ones) when the recipe compiles, quantizes, splits the
    weights over TP ranks, or drops or splits the text encoders ("rank0", "cpu", "sharded"), which
    re-applying for every run would redo (and the last three cannot be undone)."""
    split = recipe.parallel.tp > 1 and recipe.parallel.world_size > 1
    dropped = recipe.memory.text_encoder in (*ONE_RANK_PLACEMENTS, SHARDED) and recipe.parallel.world_size > 1
    return "sequential" if recipe.compile.enabled or recipe.quant.type != "none" or split or dropped else "interleaved"


def measure_compared(
    pipe: Any,
    recipe: Recipe,
    kwargs: dict[str, Any],
    warmup: int,
    repeats: int,
    progress: Callable[[str], AbstractContextManager[Any]] | None,
    order: str,
) -> tuple[Measurement, Measured]:
    """The baseline's and the recipe's measurements for --compare, in `order` (`compare_order`)."""
    unaccelerated = recipe.unaccelerated()
    if order == "sequential":
        return (
            measure_recipe(pipe, unaccelerated, kwargs, warmup, repeats, progress, "baseline").measurement,
            measure_recipe(pipe, recipe, kwargs, warmup, repeats, progress, "accelerated"),
        )
    baselines: list[Measurement] = []
    rounds: list[Measured] = []
    for index in range(repeats):
        label = "" if repeats == 1 else f": run {index + 1}/{repeats}"
        first = warmup if index == 0 else 0  # each side warms up once, before its first timed run
        baselines.append(
            measure_recipe(pipe, unaccelerated, kwargs, first, 1, progress, "baseline" + label).measurement
        )
        rounds.append(measure_recipe(pipe, recipe, kwargs, first, 1, progress, "accelerated" + label))
    last = rounds[-1]
    return _joined(baselines), Measured(
        _joined([measured.measurement for measured in rounds]),
        last.cache,
        last.degrees,
        last.vae_split,
        last.quant,
        last.compile,
        last.plan,
    )


def _joined(parts: list[Measurement]) -> Measurement:
    """One-run measurements as one: every time, the first warm-up, the last output, the highest peak, bytes summed."""
    sent: dict[str, int] = {}
    for part in parts:
        for kind, count in part.bytes_sent.items():
            sent[kind] = sent.get(kind, 0) + count
    last = parts[-1]
    return Measurement(
        last.output,
        [time for part in parts for time in part.times],
        parts[0].warmup_seconds,
        last.steps,
        max(part.peak_memory_bytes for part in parts),
        sent,
        parts[0].graphs_warmup,
        last.graphs_timed,
        last.audio,
    )


def _difference(after: int | None, before: int | None) -> int | None:
    return after - before if after is not None and before is not None else None


def device_of(pipe: Any) -> torch.device:
    return next(pipe.transformer.parameters()).device


def peak_memory_kind(device: torch.device) -> str:
    """What `PeakMemory` measures on this device, for the reports."""
    return "CUDA allocated" if device.type == "cuda" else "process RSS"


class PeakMemory:
    """Peak memory while the block runs: CUDA's allocator counter, or on CPU the process RSS sampled
    every 10 ms (the kernel's own peak never goes down, so later bench variants could not differ)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif _rss() is not None:
            self.peak = _rss() or 0
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss() or 0)

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
            return
        if self._sampler is None:  # no /proc: the process' lifetime peak is all there is
            self.peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
            return
        self._stop.set()
        self._sampler.join()
        self.peak = max(self.peak, _rss() or 0)


def _rss() -> int | None:
    """This process' resident set size in bytes (Linux /proc), None where there is no /proc."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return None
