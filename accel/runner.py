"""load → warm up → timed generation → write; what `accel run` does, returning Metrics."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from accel.errors import NotAvailableError, UserError
from accel.files.claims import claim
from accel.media import viewable
from accel.measure import compare_order, device_of, measure_compared, measure_recipe, peak_memory_kind
from accel.metrics import Metrics
from accel.models.call import effective_recipe, generation_kwargs, planned_class
from accel.models.loading import load_pipeline, resolve_device, resolve_dtype, resolve_model
from accel.models.registry import family_of
from accel.models.variants import made_by, variant_of, variant_of_class
from accel.optimize.quantize import check_hardware
from accel.outputs import check_out, saves_latents, size_notes, write_output, written_size
from accel.parallel.encoders import SHARDED, loads_text_encoders, refusal_before_start
from accel.parallel.mesh import init_distributed, tp_slice
from accel.progress import step_progress
from accel.prompts import truncation_notes
from accel.quality import psnr, ssim
from accel.recipe import Recipe
from accel.threads import cpu_threads
from accel.vae.placement import loads_vae_on_gpu


def run(
    recipe: Recipe,
    *,
    out: Path | None = None,
    overwrite: bool = False,
    compare: bool = False,
    warmup: int = 1,
    repeats: int = 1,
    progress: Callable[[str], Any] | None = None,
    announce: Callable[[str], None] | None = None,
    planned_peak: int | None = None,
) -> Metrics:
    """Run the recipe's model once as `accel run` does. `progress(label)` returns a context manager
    that shows denoising progress (the CLI passes a rich bar; the API passes nothing); `announce(line)`
    says when the load (often the longest wait) starts and how long it took. On a CPU the run
    computes with accel.threads' count (restored after)."""
    with cpu_threads(resolve_device(recipe.model.device)) as threads:
        metrics = _run(
            recipe,
            out=out,
            overwrite=overwrite,
            compare=compare,
            warmup=warmup,
            repeats=repeats,
            progress=progress,
            announce=announce,
        )
    metrics.threads = threads.as_dict()
    metrics.planned_peak_bytes = planned_peak
    return metrics


def _run(
    recipe: Recipe,
    *,
    out: Path | None,
    overwrite: bool,
    compare: bool,
    warmup: int,
    repeats: int,
    progress: Callable[[str], Any] | None,
    announce: Callable[[str], None] | None,
) -> Metrics:
    if warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {warmup}")
    if repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {repeats}")
    ref = resolve_model(recipe.model.name)
    planned = (
        made_by(ref.family, recipe.model.pipeline or ref.pipeline or ref.family.pipeline_class) if ref.family else None
    )
    planned_variant = variant_of(ref.family, planned_class(ref, recipe)) if ref.family else None
    check_out(out, overwrite, planned, planned_variant)
    if compare and recipe.memory.offload != "none":
        raise UserError(
            f'--compare with [memory] offload = "{recipe.memory.offload}": the baseline would run from host memory on '
            f"the CPU, which says nothing of the speedup; drop one of them"
        )
    if compare and saves_latents(out):
        raise UserError(
            f"--compare measures the picture against the baseline's; --out {out} saves latents, so drop --compare"
        )
    if ref.family is not None:
        generation_kwargs(ref.family, ref.tiny, recipe, loads_as=ref.pipeline)  # refuse bad settings before a long load
    if recipe.memory.text_encoder == SHARDED and (refusal := refusal_before_start(ref)) is not None:
        raise NotAvailableError(refusal)

    device = resolve_device(recipe.model.device)
    dtype = resolve_dtype(recipe.model.dtype, ref)
    check_hardware(recipe.quant.type, device, dtype)
    lead = True
    if recipe.parallel.world_size > 1:  # before loading: on CUDA it picks this rank's GPU
        lead = init_distributed(device.type, recipe.parallel.timeout)[0] == 0
    # The writing rank claims --out now, so a second run aiming at it is refused before its load.
    with claim(out) if lead and out is not None else nullcontext():
        if lead:
            check_out(
                out, overwrite, planned, planned_variant
            )  # again, now that it is ours: it may have appeared meanwhile
        say = announce or (lambda _line: None)
        say(f"loading {recipe.model.name}…")
        start = time.perf_counter()
        # Each rank reads only its TP slice, the text encoders only where it encodes ("rank0", "cpu") and
        # only its slice of them ("sharded": transformers splits them as it loads, over the whole job), unless
        # --compare needs the whole pipeline on every rank for its baseline.
        # Offloaded, the pipeline loads into host memory and accel.apply streams it to the device.
        pipe = load_pipeline(
            recipe.model.name,
            recipe.model.dtype,
            "cpu" if recipe.memory.offload != "none" else device,
            recipe.model.pipeline or None,
            recipe.model.lora,
            recipe.model.components,
            tp_slice=None if compare else tp_slice(recipe.parallel),
            text_encoders=compare or loads_text_encoders(recipe.memory.text_encoder, recipe.world_size),
            text_encoders_on_cpu=recipe.memory.text_encoder == "cpu" and not compare,
            text_encoders_tp=recipe.world_size if recipe.memory.text_encoder == SHARDED and not compare else 1,
            vae_on_cpu=not compare and not loads_vae_on_gpu(recipe.memory.vae, recipe.world_size),
        )
        load_s = time.perf_counter() - start
        say(f"loaded {recipe.model.name} in {load_s:.1f} s")
        family = family_of(pipe)
        variant = variant_of_class(family, type(pipe))
        made = made_by(family, variant.pipeline_class)
        latents = variant.latent_output if saves_latents(out) else ()
        pipe.set_progress_bar_config(disable=True)
        kwargs = generation_kwargs(family, ref.tiny, recipe, pipe)
        notes = truncation_notes(pipe, kwargs, family.prompt_tokenizers)

        bar = step_progress(pipe, progress)

        baseline, order = None, None
        if compare:  # the same measuring code as each bench variant, with every accelerator off
            order = compare_order(recipe)
            baseline, accelerated = measure_compared(pipe, recipe, kwargs, warmup, repeats, bar, order)
        else:
            accelerated = measure_recipe(pipe, recipe, kwargs, warmup, repeats, bar, "generating", latents)
        result, degrees = accelerated.measurement, accelerated.degrees

        out_path = None
        if lead:  # every rank holds the output; one writes it
            check_out(out, True, made, variant)  # a hub id or folder reveals its family (image or video) only now
            fps = variant.fps(kwargs) if variant.fps is not None else family.fps
            out_path = write_output(ref.name, fps, made[1], out, overwrite, result.output, result.audio)
    parallel = None
    if degrees is not None:
        parallel = {
            "world_size": degrees.world_size,
            "ulysses": degrees.ulysses,
            "ring": degrees.ring,
            "cfg": degrees.cfg,
            "tp": degrees.tp,
            "chosen": recipe.parallel.chooses_degrees,
            "vae_split": accelerated.vae_split,
            "plan": accelerated.plan,
            "bytes_sent_per_rank": accelerated.bytes_sent_per_rank,
        }
    device = device_of(pipe)
    compared = (
        baseline is not None and result.output is not None
    )  # a rank that did not decode ([memory] vae = "rank0") has none
    written = written_size(result.output)
    notes += accelerated.notes + size_notes(kwargs, written, family.frames_arg, variant.fps is None)
    return Metrics(
        model=recipe.model.name,
        family=family.name,
        output_kind=made[1],
        device=str(device),
        dtype=str(pipe.transformer.dtype).removeprefix("torch."),
        recipe=effective_recipe(
            recipe, kwargs, family.frames_arg, device.type, str(dtype).removeprefix("torch.")
        ).to_dict(),
        load_s=load_s,
        warmup_s=result.warmup_seconds,
        generate_s=result.seconds,
        times_s=result.times,
        steps=result.steps,
        peak_memory_bytes=result.peak_memory_bytes,
        peak_memory_kind=peak_memory_kind(device),
        output_path=str(out_path) if out_path is not None else None,
        cache=accelerated.cache,
        parallel=parallel,
        quant=accelerated.quant,
        compile=accelerated.compile,
        baseline_s=baseline.seconds if baseline else None,
        baseline_times_s=baseline.times if baseline else [],
        compare_order=order,
        psnr_db=psnr(viewable(result.output, made[1]), viewable(baseline.output, made[1])) if compared else None,
        ssim=ssim(viewable(result.output, made[1]), viewable(baseline.output, made[1])) if compared else None,
        output_frames=written[2] if written is not None and made[1] != "image" else None,
        output_width=written[0] if written is not None else None,
        output_height=written[1] if written is not None else None,
        notes=notes,
    )
