"""Running a bench on every rank of the job: each variant loaded as it needs, measured, compared with the
baseline and written; rank 0 gathers the result."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from accel.bench.pipelines import Pipelines
from accel.bench.plan import BenchPlan, PlannedVariant
from accel.bench.results import BENCH_HINT, BenchResult, VariantResult
from accel.errors import UserError
from accel.figures import Tile, shown_frames
from accel.recipe import Recipe

Progress = Callable[[str], AbstractContextManager[Any]]


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
    """Claim the bench folder (accel.files.claims.claim) and create it; refuse one that is no longer empty.
    A folder that cannot be made (ENOSPC, EACCES) is one line, and the claim's lock goes with it."""
    from accel.files.claims import claim
    from accel.files.folders import make_folder

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
    from accel.measure import measure_recipe, peak_memory_kind
    from accel.models.call import generation_kwargs
    from accel.progress import step_progress

    recipe = plan.recipe
    lead = rank == 0
    pipelines = Pipelines(recipe.model.name, device, recipe.model.pipeline, recipe.model.lora)
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
    from accel.metrics import speedup_range

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
    from accel.files.publish import write_file
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
