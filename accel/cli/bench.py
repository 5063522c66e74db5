"""`accel bench`: a recipe's [bench] variants side by side, on one job's ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from accel.cli.app import console, fail
from accel.cli.jobs import progress, rerun_on_ranks, say
from accel.cli.options import Opt, Overrides, Oversubscribe, RecipeOptions, with_recipe_options
from accel.errors import UserError


@with_recipe_options(RecipeOptions(("bench.repeats", "bench.warmup"), before="gpu_memory"))
def bench(
    ctx: typer.Context,
    overrides: Overrides,
    recipe: Annotated[
        Path, typer.Argument(help=escape("TOML recipe with [bench] variants (e.g. recipes/tiny-flux.toml)."))
    ],
    gpus: Annotated[
        int | None,
        Opt(
            "--gpus",
            help="Processes for the whole bench.",
            show_default="what the largest variant needs, at most the GPUs here, or CPU cores without one",
        ),
    ] = None,
    out: Annotated[
        Path | None,
        Opt("--out", "-o", help="Fresh folder for the outputs and reports.", show_default="a new one under outputs/"),
    ] = None,
    json_path: Annotated[
        Path | None, Opt("--json", help="Also write the JSON report here.", show_default="none")
    ] = None,
    markdown_path: Annotated[
        Path | None, Opt("--markdown", help="Also write the Markdown report here.", show_default="none")
    ] = None,
    only: Annotated[
        list[str] | None,
        Opt(
            "--only",
            metavar="NAME",
            help="Run only this variant (repeatable); the baseline always runs.",
            show_default="every variant",
        ),
    ] = None,
    gpu_memory: Annotated[
        float | None,
        Opt(
            "--gpu-memory",
            help="GiB per GPU: a flagship checkpoint's variants left to accel take the plan's layout, the others are "
            "checked against it before loading.",
            show_default="the visible GPU's",
        ),
    ] = None,
    oversubscribe: Oversubscribe = False,
) -> None:
    r"""Run a recipe's \[bench] variants side by side and compare them with the first (the baseline)."""
    from accel import preflight
    from accel.launch.environment import rank
    from accel.parallel.mesh import under_distributed_launcher

    lead = rank() == 0
    try:
        # Model-free checks first: before torch loads (plan_bench loads it) and before any rank starts.
        preflight.check_report(json_path, "--json", check_exists=lead)  # rank 0 may have written them already
        preflight.check_report(markdown_path, "--markdown", check_exists=lead)
        preflight.check_bench_folder(out, check_exists=lead)
        if gpus is not None and gpus < 1:
            raise UserError(f"--gpus must be >= 1, got {gpus}")
        from accel.models.refs import resolve_model
        from accel.recipe import load_recipe

        settings = load_recipe(recipe)
        resolve_model(settings.model.name)  # an unknown model: one line, before plan_bench loads torch
        if overrides:
            settings = settings.with_overrides(overrides, source="command line")
        if (
            gpus is not None and gpus > 1 and not under_distributed_launcher()
        ):  # without --gpus the plan fits the machine
            preflight.check_process_count(gpus, settings.model.device, oversubscribe)
        from accel.bench.plan import fit_bench, plan_bench

        plan = fit_bench(
            plan_bench(settings, gpus, only), gpu_memory
        )  # a flagship's plan: seconds, so after the checks
        if plan.world_size > 1 and not under_distributed_launcher():
            from accel.launch.environment import LaunchSpec

            pinned = () if gpus is not None else ("--gpus", str(plan.world_size))  # ranks plan the same job
            spec = LaunchSpec.for_world(plan.world_size, timeout_s=plan.recipe.parallel.timeout)
            raise typer.Exit(rerun_on_ranks(ctx, spec, plan.recipe, pinned))
        from accel.files.claims import claim

        # The report copies are this bench's before it measures: a concurrent one is refused now.
        claims = []
        try:
            claims += [claim(path) for path in (json_path, markdown_path) if path is not None and lead]
            folder = _fresh_folder(out, recipe) if lead else None
            result = _run_bench(plan, folder, lead)
            if result is None or folder is None:
                return
            from accel.bench import report

            report.write_bench(result, folder, json_path, markdown_path)
        finally:
            for held in claims:
                held.release()
    except UserError as error:
        fail(str(error))
        return
    # A log or pipe has no width to fit: give the table room rather than folding every number.
    (console if console.is_terminal else Console(width=max(console.width, 140))).print(report.bench_table(result))
    for note in report.bench_notes(result):
        console.print(note, markup=False, highlight=False)
    for name, path in result.files.items():
        console.print(f"wrote {name}: {path}")


def _run_bench(plan: Any, folder: Path | None, lead: bool) -> Any:
    from accel.bench.run import run_bench

    return run_bench(plan, folder, progress(lead), say if lead else None)


def _fresh_folder(out: Path | None, recipe: Path) -> Path:
    """--out as given (checked to be new or empty), else the first free outputs/bench-<recipe>[-N],
    created here: two benches started at once never share a folder."""
    from accel.files.folders import fresh_folder

    return out if out is not None else fresh_folder(Path("outputs"), f"bench-{recipe.stem}")
