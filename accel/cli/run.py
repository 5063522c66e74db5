"""`accel run`: one generation with the accelerators the flags and recipe ask for, timed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from accel.cli.app import console, fail
from accel.cli.jobs import fit_to_job, progress, relaunch, say
from accel.cli.options import (
    FLAG,
    MasterAddr,
    MasterPort,
    NodeRank,
    Nodes,
    Opt,
    Oversubscribe,
    Overrides,
    RecipeOptions,
    build_recipe,
    with_recipe_options,
)
from accel.errors import UserError

# What to make and how to load it, then how to cache: shown before the output options.
GENERATE = (
    "generate.prompt",
    "generate.negative_prompt",
    "generate.steps",
    "generate.height",
    "generate.width",
    "generate.frames",
    "generate.seed",
    "generate.guidance_scale",
    "generate.true_cfg_scale",
    "generate.image",
    "generate.mask",
    "generate.video",
    "generate.conditions",
    "generate.references",
    "generate.inputs",
    "generate.arguments",
    "model.lora",
    "model.pipeline",
    "model.components",
    "model.dtype",
    "model.device",
    "cache.threshold",
    "cache.method",
    "cache.first_blocks",
    "cache.last_blocks",
    "cache.calibrator",
    "cache.taylor_order",
    "cache.max_cached_steps",
    "cache.interval",
)
LAYOUT = (
    "parallel.ulysses",
    "parallel.ring",
    "parallel.tp",
    "parallel.plan",
    "memory.text_encoder",
    "memory.vae",
)
PLACEMENT = (
    "memory.offload",
    "parallel.cfg",
    "vae.parallel",
    "vae.tiling",
    "quant.type",
    "compile.enabled",
)


@with_recipe_options(
    RecipeOptions(GENERATE, before="out"),
    RecipeOptions(LAYOUT, before="gpu_memory"),
    RecipeOptions(PLACEMENT, before="nnodes"),
)
def run(
    ctx: typer.Context,
    overrides: Overrides,
    model: Annotated[
        str | None,
        typer.Argument(
            help="Registry alias (flux, tiny-flux, …; accel models lists them), hub repo id or local folder.",
            show_default="the recipe's [model] name",
        ),
    ] = None,
    recipe: Annotated[
        Path | None,
        Opt(
            "--recipe",
            "-r",
            help="TOML recipe, or the JSON an accel run --json wrote (reruns it); flags override its values.",
            show_default="none",
        ),
    ] = None,
    out: Annotated[
        Path | None,
        Opt(
            "--out",
            "-o",
            help="Output .png / .mp4, or for linear HDR video .npy frames / .mp4 SDR preview, or .pt: the latents a "
            "multi-pass pipeline hands on.",
            show_default="a fresh name under outputs/",
        ),
    ] = None,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace --out / --json if they exist.", **FLAG)] = False,
    json_path: Annotated[
        Path | None, Opt("--json", help="Write every measured number to this JSON file.", show_default="none")
    ] = None,
    compare: Annotated[
        bool, Opt("--compare", help="Also run the unaccelerated baseline: speedup and PSNR.", **FLAG)
    ] = False,
    warmup: Annotated[int, Opt("--warmup", help="Untimed warm-up generations before the timed one.")] = 1,
    repeats: Annotated[
        int,
        Opt(
            "--repeats",
            help="Timed generations; the table shows their median and min–max (--compare alternates baseline and "
            "accelerated runs).",
        ),
    ] = 1,
    gpus: Annotated[
        int | None,
        Opt(
            "--gpus",
            help="Processes (GPUs; gloo ranks on a CPU-only machine); relaunches under torchrun.",
            show_default="recipe, else ulysses × ring × cfg × tp",
        ),
    ] = None,
    gpu_memory: Annotated[
        float | None,
        Opt(
            "--gpu-memory",
            help="GiB per GPU: a flagship checkpoint's layout is planned (with --gpus alone) or checked against it "
            "before loading.",
            show_default="the visible GPU's",
        ),
    ] = None,
    nnodes: Nodes = 1,
    node_rank: NodeRank = 0,
    master_addr: MasterAddr = None,
    master_port: MasterPort = None,
    oversubscribe: Oversubscribe = False,
    verbose: Annotated[
        bool, Opt("--verbose", "-v", help="Also show each cache decision and the bytes each rank sent.", **FLAG)
    ] = False,
) -> None:
    """Generate once with the accelerators the flags / recipe ask for, and print the timing table."""
    from accel import preflight
    from accel.launch.environment import rank
    from accel.models.refs import resolve_model
    from accel.parallel.mesh import under_distributed_launcher

    lead = rank() == 0
    try:
        # Checks before torch loads (seconds) and before any rank starts: an alias names its family,
        # whose pipeline says which --out suffixes it is written as; any model is refused the others.
        settings = build_recipe(recipe, overrides, {"model": {"name": model}, "parallel": {"gpus": gpus}})
        resolve_model(settings.model.name)  # an unknown model: one line, before torch loads
        _check_out_for_alias(out, settings.model)
        preflight.check_out(out, overwrite or not lead)  # a rank > 0 leaves existing files to rank 0
        preflight.check_json(json_path, overwrite or not lead)
        if gpus is not None and gpus < 1:
            raise UserError(f"--gpus must be >= 1, got {gpus}")
        from accel.memory.fit import planned_here
        from accel.recipe.refusals import memory_refusal

        if (refusal := memory_refusal(settings)) is not None:
            raise UserError(refusal)
        if settings.world_size > 1 and not under_distributed_launcher():
            from accel.launch.environment import LaunchSpec

            spec = LaunchSpec.for_world(
                settings.world_size, nnodes, node_rank, master_addr, master_port, settings.parallel.timeout
            )
            asked = f"--gpus {settings.world_size}" if gpus is not None else "the [parallel] layout"
            preflight.check_process_count(spec.nproc, settings.model.device, oversubscribe, spec.nnodes, asked)
            preflight.check_master_port(master_addr, master_port, node_rank)
            planned = planned_here(settings, gpu_memory)  # a flagship's plan: seconds, so after the checks
            raise typer.Exit(relaunch(ctx, planned.recipe, spec, planned.flags))
        planned = planned_here(settings, gpu_memory)
        settings = fit_to_job(planned.recipe)
        from accel.files.claims import claim
        from accel.runner import run as run_recipe  # torch and diffusers load only for a valid recipe

        # The JSON is this run's before the long work starts: a concurrent run is refused now, not after.
        json_claim = claim(json_path) if json_path is not None and lead else None
        try:
            metrics = run_recipe(
                settings,
                out=out,
                overwrite=overwrite,
                compare=compare,
                warmup=warmup,
                repeats=repeats,
                progress=progress(lead),
                announce=say if lead else None,
                planned_peak=planned.peak,
            )
            if lead:
                _report_run(metrics, verbose, json_path, overwrite, (ctx.obj or {}).get("argv") or sys.argv[1:])
        finally:
            if json_claim is not None:
                json_claim.release()
    except UserError as error:
        fail(str(error))
        return


def _check_out_for_alias(out: Path | None, model: Any) -> None:
    """--out's suffix against what the asked pipeline makes, where the model (`[model]`) is an alias
    (no torch: a folder's or repo's family is known later, and runner.run checks it then). A .pt
    name (a pass's latents, runner.LATENT_SUFFIX) is the runner's to check: it knows which variants hand latents on."""
    if out is None or out.suffix.lower() == ".pt":
        return
    from accel.models.registry import lookup
    from accel.models.variants import check_out_suffix, planned_output

    found = lookup(model.name)
    if found is not None:
        check_out_suffix(out, *planned_output(found[0], model.pipeline or None))


def _report_run(metrics: Any, verbose: bool, json_path: Path | None, overwrite: bool, argv: list[str]) -> None:
    from accel import report

    console.print(report.run_table(metrics))
    for note in metrics.notes:
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    if verbose and metrics.cache is not None:
        console.print(report.cache_calls_table(metrics))
    if verbose and metrics.parallel is not None:
        console.print(report.traffic_table(metrics))
    if json_path is not None:
        report.write_json(report.run_document(metrics, argv), json_path, replace=overwrite)
        console.print(f"wrote {json_path}")
