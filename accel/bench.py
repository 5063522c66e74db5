"""`accel bench`: a recipe's variants measured side by side in one process group.

Every variant is the recipe with its overrides, measured by the same code as `accel run`
(`runner.measure_recipe`: warm-up, repeats, apply, remove) and compared with the first variant,
the baseline, for speed and for quality (PSNR, SSIM of its output against the baseline's).

One job runs them all. A variant that needs fewer processes than the job runs on its first ranks
(the others wait at a barrier); one that needs more, or hardware this machine lacks, is skipped
with the reason. Quantization and the tensor-parallel split cannot be undone, so the pipeline is
reloaded when a variant needs it unquantized (or quantized differently), or split otherwise, after one that changed it.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import re
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from accel.errors import RecipeError, UserError
from accel.figures import Tile, shown_frames
from accel.preflight import cpu_cores
from accel.recipe import Recipe, BenchVariant

Progress = Callable[[str], AbstractContextManager[Any]]
# What a refused bench file tells the user (accel.files).
BENCH_HINT = "bench never overwrites, choose another name"


@dataclass(frozen=True)
class PlannedVariant:
    """One row of the bench: the concrete recipe it runs, or why it cannot run in this job."""

    name: str
    recipe: Recipe
    overrides: dict[str, Any]
    world_size: int
    skip: str | None = None
    planned_peak: int | None = None  # accel plan's estimate of its peak per GPU (fit_bench), where one applied


@dataclass(frozen=True)
class BenchPlan:
    """What a bench job will run, checked before any rank starts."""

    recipe: Recipe
    world_size: int
    variants: tuple[PlannedVariant, ...]

    @property
    def baseline(self) -> PlannedVariant:
        return self.variants[0]


@dataclass
class VariantResult:
    """One variant's numbers (all None when it was skipped); `as_dict()` is its JSON object."""

    name: str
    overrides: dict[str, Any]
    world_size: int
    layout: str
    skip_reason: str | None = None
    times_s: list[float] = field(default_factory=list)
    warmup_s: float | None = None
    steps: int | None = None
    speedup: float | None = None
    # The speedup's spread over the repeats (runner.speedup_range); None when skipped or without a baseline.
    speedup_min: float | None = None
    speedup_max: float | None = None
    cache_hit_rate: float | None = None
    peak_memory_bytes: int | None = None
    planned_peak_bytes: int | None = None
    psnr_db: float | None = None
    ssim: float | None = None
    output_path: str | None = None
    quant: dict[str, Any] | None = None
    compile: dict[str, Any] | None = None
    bytes_sent_per_rank: dict[str, int] | None = None

    @property
    def ran(self) -> bool:
        return self.skip_reason is None

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.times_s) if self.times_s else None

    @property
    def per_step_s(self) -> float | None:
        median = self.median_s
        return median / self.steps if median is not None and self.steps else None

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(
            status="ran" if self.ran else "skipped",
            median_s=self.median_s,
            min_s=min(self.times_s) if self.times_s else None,
            max_s=max(self.times_s) if self.times_s else None,
            per_step_s=self.per_step_s,
        )
        return data


@dataclass
class BenchResult:
    """The whole bench; `as_dict()` is the JSON document (its fields are listed in the README)."""

    recipe: str
    model: str
    family: str
    output_kind: str
    device: str
    dtype: str
    world_size: int
    repeats: int
    warmup: int
    settings: dict[str, Any]
    peak_memory_kind: str
    baseline: str
    variants: list[VariantResult]
    folder: str | None = None
    files: dict[str, str] = field(default_factory=dict)
    # CPU threads each rank computed with and what chose them (accel.threads.Threads.as_dict).
    threads: dict[str, Any] | None = None
    # What the comparison grid shows, for each variant that ran (a video's three frames, not all).
    tiles: list[Tile] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("variants", "tiles")}
        data["variants"] = [v.as_dict() for v in self.variants]
        return data


# --- planning: everything a user can get wrong is found here, before any rank starts ---------


def plan_bench(recipe: Recipe, gpus: int | None = None, only: list[str] | None = None) -> BenchPlan:
    """Check every variant and choose the job's size: `gpus`, or as many processes as the largest
    variant needs, at most the GPUs visible (CPU cores on a machine without CUDA)."""
    from accel.models.loading import resolve_device, resolve_model

    ref = resolve_model(recipe.model.name)
    if gpus is not None and gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {gpus}")
    chosen = _chosen_variants(recipe, only)
    device = resolve_device(recipe.model.device)
    world = gpus or _default_world(max(variant.world_size for _, _, variant in chosen), device.type)
    planned = []
    for name, overrides, variant in chosen:
        _check_variant(ref, name, variant)
        skip = _skip_reason(variant, ref, world, device)
        planned.append(PlannedVariant(name, variant, overrides, variant.world_size, skip))
    return BenchPlan(recipe, world, tuple(planned))


def fit_bench(plan: BenchPlan, gpu_memory: float | None) -> BenchPlan:
    """The memory plan (accel/memory/fit.py) on each variant that will run, on the launcher before any
    rank starts: on a flagship checkpoint a variant that leaves its layout to accel takes the plan's,
    one whose layout will not fit refuses the bench in one line; the ranks take the same from the launcher."""
    from accel.memory.fit import planned_each

    running = {variant.name: variant.recipe for variant in plan.variants if variant.skip is None}
    fits = planned_each(running, gpu_memory, lambda name: f"{plan.recipe.source}: [bench] variant {name!r}")
    variants = tuple(
        dataclasses.replace(variant, recipe=fits[variant.name].recipe, planned_peak=fits[variant.name].peak)
        if variant.name in fits
        else variant
        for variant in plan.variants
    )
    return dataclasses.replace(plan, variants=variants)


def _chosen_variants(recipe: Recipe, only: list[str] | None) -> list[tuple[str, dict[str, Any], Recipe]]:
    """(name, overrides as written, concrete recipe) in recipe order. Without variants: the recipe
    against itself with every accelerator off, as `run --compare` measures it."""
    variants: tuple[BenchVariant, ...] = recipe.variants
    if not variants:
        if only:
            raise UserError(f"--only: {recipe.source} defines no [bench] variants to choose from")
        return [("baseline", {}, recipe.unaccelerated()), ("recipe", {}, recipe)]
    names = [v.name for v in variants]
    for name in only or ():
        if name not in names:
            recipe.variant(name)  # raises the message with the valid names
    chosen = [v for v in variants if not only or v.name == names[0] or v.name in only]
    return [(v.name, _plain(v.overrides), _variant_recipe(recipe, v.name)) for v in chosen]


def _variant_recipe(recipe: Recipe, name: str) -> Recipe:
    variant = recipe.variant(name)
    for key in ("name", "device", "pipeline", "lora"):
        if getattr(variant.model, key) != getattr(recipe.model, key):
            raise RecipeError(
                f"{recipe.source}: [bench] variant {name!r} changes [model] {key}; every variant runs on the "
                f"pipeline the recipe loads (only [model] dtype may change), so use a second recipe"
            )
    return variant


def _check_variant(ref: Any, name: str, variant: Recipe) -> None:
    """The checks `accel run` makes before start-up, naming the variant."""
    from accel.models.refs import heads_before_start
    from accel.models.lora import parse_loras
    from accel.parallel.mesh import resolve_degrees
    from accel.parallel.plan import plan_of, refuse_untaught_before_start
    from accel.runner import generation_kwargs

    try:
        parse_loras(variant.model.lora)
        if ref.family is not None:
            generation_kwargs(ref.family, ref.tiny, variant, loads_as=ref.pipeline)
            if variant.world_size > 1:
                plan_of(ref.family, "[parallel]")
        if variant.world_size > 1:
            refuse_untaught_before_start(ref, "[parallel]", variant.parallel)
            resolve_degrees(variant.parallel, heads_before_start(ref), ref.name)
    except UserError as error:
        raise type(error)(f"{variant.source}: [bench] variant {name!r}: {error}") from None


def _skip_reason(variant: Recipe, ref: Any, world: int, device: Any) -> str | None:
    from accel.models.loading import resolve_dtype
    from accel.optimize.quantize import check_hardware

    if variant.world_size > world:
        return f"needs {variant.world_size} processes; this run has {world} (--gpus {variant.world_size})"
    try:
        check_hardware(variant.quant.type, device, resolve_dtype(variant.model.dtype, ref))
    except UserError as error:
        return str(error)
    return None


def _default_world(needed: int, device_type: str) -> int:
    import torch

    available = torch.cuda.device_count() if device_type == "cuda" else cpu_cores()
    return max(1, min(needed, available))


def _plain(overrides: Any) -> dict[str, Any]:
    return {section: dict(keys) for section, keys in overrides.items()}


# --- running: on every rank of the job ------------------------------------------------------


def run_bench(
    plan: BenchPlan,
    folder: Path | None,
    progress: Progress | None = None,
    announce: Callable[[str], None] | None = None,
) -> BenchResult | None:
    """Run the plan on this rank; rank 0 returns the result (others None) and, with `folder`,
    writes each variant's output there as it finishes. `progress(label)` gives a context whose
    step events drive a bar; `announce(line)` reports each variant as it starts and ends."""
    from accel.models.loading import resolve_device
    from accel.threads import cpu_threads

    device = resolve_device(plan.recipe.model.device)
    rank, barrier = _join(plan, device.type)
    # Rank 0 claims the folder before the load: a second bench aiming at it is refused now, not
    # after measuring (the claim ends here; by then the folder holds outputs, so it is not "empty").
    held = _claim_folder(folder) if rank == 0 and folder is not None else None
    try:
        with cpu_threads(device) as threads:
            result = _run_variants(plan, folder, device, rank, barrier, progress, announce or (lambda _line: None))
        if result is not None:
            result.threads = threads.as_dict()
        return result
    finally:
        if held is not None:
            held.release()


def _claim_folder(folder: Path) -> Any:
    """Claim the bench folder (accel.files.claim) and create it; refuse one that is no longer empty.
    A folder that cannot be made (ENOSPC, EACCES) is one line, and the claim's lock goes with it."""
    from accel.files import claim, make_folder

    held = claim(folder)
    try:
        make_folder(folder)
        if any(folder.iterdir()):
            raise UserError(
                f"--out {folder} is no longer empty (another run wrote into it); bench never overwrites, choose another"
            )
    except BaseException:
        held.release()
        raise
    return held


def _run_variants(
    plan: BenchPlan,
    folder: Path | None,
    device: Any,
    rank: int,
    barrier: Callable[[], None],
    progress: Progress | None,
    say: Callable[[str], None],
) -> BenchResult | None:
    """`run_bench` once the job is joined: every variant in turn, then rank 0's result."""
    import torch

    from accel.models.loading import resolve_model
    from accel.models.registry import family_of
    from accel.models.variants import variant_of_class
    from accel.runner import generation_kwargs, measure_recipe, peak_memory_kind, step_progress

    recipe = plan.recipe
    lead = rank == 0
    pipelines = _Pipelines(recipe.model.name, device, recipe.model.pipeline, recipe.model.lora)
    pipe = pipelines.get(plan.baseline.recipe, say)
    family = family_of(pipe)
    kind = family.output_of(variant_of_class(family, type(pipe)).pipeline_class)  # a variant may make another kind
    ref = resolve_model(recipe.model.name)

    results: list[VariantResult] = []
    tiles: list[Tile] = []
    baseline: tuple[float, np.ndarray, list[float]] | None = None
    count = len(plan.variants)
    for index, planned in enumerate(plan.variants, 1):
        layout = _layout(planned, pipe)
        row = VariantResult(
            planned.name,
            planned.overrides,
            planned.world_size,
            layout,
            planned.skip,
            planned_peak_bytes=planned.planned_peak,
        )
        results.append(row)
        if planned.skip is not None:
            say(f"[{index}/{count}] {planned.name}: skipped ({planned.skip})")
            continue
        variant = planned.recipe
        if planned.world_size > 1:  # group creation is collective: every rank of the job takes part
            from accel.parallel.mesh import build_mesh, parallel_degrees

            build_mesh(parallel_degrees(pipe, variant.parallel), device.type, first_ranks=True)
        if rank < planned.world_size:
            if planned.world_size == 1 and variant.vae.parallel:  # one process: nothing to split
                variant = variant.with_overrides({"vae": {"parallel": False}})
            say(f"[{index}/{count}] {planned.name}: {layout}")
            pipe = pipelines.get(variant, say)
            kwargs = generation_kwargs(family, ref.tiny, variant, pipe)
            measured = measure_recipe(
                pipe,
                variant,
                kwargs,
                recipe.bench.warmup,
                recipe.bench.repeats,
                step_progress(pipe, progress),
                f"[{index}/{count}] {planned.name}",
            )
            if lead:
                baseline = _record(row, measured, variant, index == 1, baseline, folder, index, family, kind)
                tiles.append(_tile(planned.name, _caption(row, index == 1), measured.measurement.output, kind))
                say(f"[{index}/{count}] {planned.name}: {_summary(row)}")
            if variant.compile.enabled:
                torch.compiler.reset()  # the next variant compiles afresh, within dynamo's recompile limit
        barrier()
    if not lead:
        return None
    return BenchResult(
        recipe=recipe.source,
        model=recipe.model.name,
        family=family.name,
        output_kind=kind,
        device=str(device),
        dtype=str(pipelines.dtype).removeprefix("torch."),
        world_size=plan.world_size,
        repeats=recipe.bench.repeats,
        warmup=recipe.bench.warmup,
        settings=dict(generation_kwargs(family, ref.tiny, plan.baseline.recipe, pipe), seed=recipe.generate.seed),
        peak_memory_kind=peak_memory_kind(device),
        baseline=plan.baseline.name,
        variants=results,
        folder=str(folder) if folder is not None else None,
        tiles=tiles,
    )


def _join(plan: BenchPlan, device_type: str) -> tuple[int, Callable[[], None]]:
    """This rank and a barrier for ranks a smaller variant leaves idle. The barrier runs on its own
    gloo group with a day's timeout: a one-GPU baseline of a long video outlasts the job's timeout."""
    if plan.world_size == 1:
        return 0, lambda: None
    import torch.distributed as dist

    from accel import watchdog
    from accel.parallel.mesh import init_distributed

    rank, world = init_distributed(device_type, plan.recipe.parallel.timeout)
    if world != plan.world_size:
        raise UserError(f"this job has {world} processes but the bench plans {plan.world_size}; pass --gpus {world}")
    waiting = dist.new_group(backend="gloo", timeout=timedelta(days=1))

    def barrier() -> None:
        with watchdog.idle():  # the launcher must not take these ranks for stuck ones
            dist.barrier(group=waiting)

    return rank, barrier


def _record(
    row: VariantResult,
    measured: Any,
    variant: Recipe,
    is_baseline: bool,
    baseline: tuple[float, np.ndarray, list[float]] | None,
    folder: Path | None,
    index: int,
    family: Any,
    kind: str,
) -> tuple[float, np.ndarray, list[float]] | None:
    """Fill the row from a measurement (rank 0); returns the baseline (median, output, times) to compare with."""
    from accel.media import viewable
    from accel.quality import psnr, ssim
    from accel.runner import speedup_range

    result = measured.measurement
    row.times_s = list(result.times)
    row.warmup_s = result.warmup_seconds
    row.steps = result.steps
    row.peak_memory_bytes = result.peak_memory_bytes
    row.cache_hit_rate = measured.cache["hit_rate"] if measured.cache is not None else None
    row.quant = measured.quant
    row.compile = measured.compile
    row.bytes_sent_per_rank = measured.bytes_sent_per_rank
    if is_baseline:
        baseline = (result.seconds, result.output, list(result.times))
    if baseline is not None:
        row.speedup = baseline[0] / result.seconds if result.seconds > 0 else None
        row.speedup_min, row.speedup_max = speedup_range(baseline[2], result.times)
        if not is_baseline and baseline[1].shape == result.output.shape:  # as shown: an HDR video's SDR preview
            row.psnr_db = psnr(viewable(result.output, kind), viewable(baseline[1], kind))
            row.ssim = ssim(viewable(result.output, kind), viewable(baseline[1], kind))
    if folder is not None:
        row.output_path = str(_save_output(result.output, folder, index, row.name, family, kind, result.audio))
    return baseline


def _save_output(
    output: np.ndarray, folder: Path, index: int, name: str, family: Any, kind: str, audio: Any = None
) -> Path:
    """Written whole (with its sound, where it has one), never over an existing file; an HDR video as
    its SDR preview, the viewable form (accel run --out X.npy keeps the linear frames)."""
    from accel.files import write_file
    from accel.media import output_writer
    from accel.models.base import OUTPUT_FILES

    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "variant"
    suffix = OUTPUT_FILES[kind][1][0][0]
    return write_file(
        folder / f"{index:02d}-{slug}{suffix}",
        output_writer(output, kind, suffix, family.fps, audio),
        replace=False,
        hint=BENCH_HINT,
    )


def _layout(planned: PlannedVariant, pipe: Any) -> str:
    """How the variant's processes are used, in words."""
    if planned.world_size == 1:
        return "1 process"
    from accel.parallel.mesh import parallel_degrees

    try:
        return parallel_degrees(pipe, planned.recipe.parallel).describe()
    except UserError:
        return f"{planned.world_size} processes"


def _tile(name: str, caption: str, output: np.ndarray, kind: str) -> Tile:
    from accel.media import viewable

    if kind == "image":
        return Tile(name, caption, output)
    frames, numbers = shown_frames(viewable(output, kind))
    return Tile(name, caption, frames, numbers)


def _caption(row: VariantResult, is_baseline: bool) -> str:
    if is_baseline:
        return "baseline"
    speed = f"{row.speedup:.2f}×" if row.speedup is not None else "no baseline"
    if row.psnr_db is None:
        return speed
    quality = "identical" if math.isinf(row.psnr_db) else f"{row.psnr_db:.1f} dB"
    return f"{speed} · {quality}"


def _summary(row: VariantResult) -> str:
    median = row.median_s or 0.0
    speed = f", {row.speedup:.2f}× baseline" if row.speedup is not None else ""
    return f"median {median:.3f} s over {len(row.times_s)} runs{speed}"


class _Pipelines:
    """The loaded pipeline and what `remove()` cannot undo (its dtype, its quantization, its TP
    split, text encoders dropped by "rank0" placement or split by "sharded"): a variant that needs another state
    gets a fresh load."""

    def __init__(self, name: str, device: Any, pipeline: str = "", lora: tuple[str, ...] | None = None) -> None:
        self.name = name
        self.pipeline = pipeline
        self.lora = lora
        self.device = device
        self.pipe: Any = None
        self.model_dtype = ""
        self.quant: tuple[Any, ...] | None = None
        self.split = 1  # the TP degree the transformer is split over
        self.dropped = False  # the text encoders were dropped on the ranks that do not encode
        self.sharded = 1  # the ranks the text encoders are split over ("sharded")

    @property
    def dtype(self) -> Any:
        return self.pipe.transformer.dtype

    def get(self, recipe: Recipe, say: Callable[[str], None] | None = None) -> Any:
        quant = recipe.quant
        wanted = (quant.type, quant.scope, quant.exclude) if quant.type != "none" else None
        split = recipe.parallel.tp if recipe.parallel.world_size > 1 else 1
        from accel.parallel.encoders import ONE_RANK_PLACEMENTS, SHARDED

        dropped = recipe.memory.text_encoder in ONE_RANK_PLACEMENTS and recipe.parallel.world_size > 1
        sharded = recipe.parallel.world_size if recipe.memory.text_encoder == SHARDED else 1
        stale = (
            (self.quant is not None and self.quant != wanted)
            or (self.split > 1 and self.split != split)
            or (self.dropped and not dropped)
        )
        stale = stale or (self.sharded > 1 and self.sharded != sharded)
        if self.pipe is None or recipe.model.dtype != self.model_dtype or stale:
            tell = say or (lambda _line: None)
            first = self.pipe is None
            tell(
                f"loading {self.name}…"
                if first
                else "  reloading the pipeline (quantization, the tensor-parallel split, dropped or split text "
                "encoders and dtype cannot be undone in place)"
            )
            start = time.perf_counter()
            self._load(recipe.model.dtype)
            tell(f"{'loaded' if first else '  reloaded'} {self.name} in {time.perf_counter() - start:.1f} s")
        self.quant, self.split, self.dropped, self.sharded = wanted, split, dropped, sharded
        return self.pipe

    def _load(self, dtype: str) -> None:
        import torch

        from accel.models.loading import load_pipeline

        self.pipe = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.pipe = load_pipeline(self.name, dtype, self.device, self.pipeline or None, self.lora)
        self.pipe.set_progress_bar_config(disable=True)
        self.model_dtype = dtype
