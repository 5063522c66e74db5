"""`accel tune`: the fastest cache setting that meets a quality target, or MagCache's calibration."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from accel.cache.config import CACHE_METHODS
from accel.cli.app import console, fail
from accel.cli.jobs import fit_to_job, relaunch
from accel.cli.options import FLAG, Opt, Oversubscribe
from accel.errors import UserError


def tune(
    ctx: typer.Context,
    recipe: Annotated[Path, typer.Argument(help="TOML recipe of the pipeline to tune (e.g. recipes/tiny-flux.toml).")],
    target: Annotated[
        str | None,
        Opt(
            "--target",
            metavar="METRIC=VALUE",
            help="Find the fastest cache setting whose worst-prompt quality meets this: psnr=32 (dB) or ssim=0.95, "
            "against the uncached output.",
            show_default="none",
        ),
    ] = None,
    calibrate: Annotated[
        bool,
        Opt("--calibrate", help="Measure MagCache's per-step magnitude ratios and write a MagCache recipe.", **FLAG),
    ] = False,
    prompts: Annotated[
        Path | None,
        Opt(
            "--prompts",
            metavar="FILE",
            help="--target: the prompts to measure quality on, one a line.",
            show_default="2 built-in prompts of the family",
        ),
    ] = None,
    out: Annotated[
        Path | None,
        Opt(
            "--out",
            "-o",
            help="The recipe to write; never overwritten.",
            show_default="<recipe>-tuned.toml (-magcache.toml with --calibrate) beside it",
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        Opt(
            "--plot",
            help="--target: the speedup / PSNR plot to write; never overwritten.",
            show_default="the written recipe's name, .png",
        ),
    ] = None,
    methods: Annotated[
        str | None,
        Opt(
            "--methods",
            metavar="METHOD,...",
            help=f"--target: search only these cache methods ({', '.join(CACHE_METHODS)}), comma-separated; "
            "fbcache and dbcache include their lines with the TaylorSeer calibrator.",
            show_default="all",
        ),
    ] = None,
    gpus: Annotated[
        int | None,
        Opt(
            "--gpus",
            help="--target: processes the whole search runs on (relaunches under torchrun).",
            show_default="recipe, else ulysses × ring × cfg × tp",
        ),
    ] = None,
    repeats: Annotated[
        int, Opt("--repeats", help="--target: timed generations per setting and prompt; their median counts.")
    ] = 1,
    warmup: Annotated[
        int | None,
        Opt(
            "--warmup",
            help="--target: untimed generations before each timed one.",
            show_default="1 with [compile] on, else 0",
        ),
    ] = None,
    oversubscribe: Oversubscribe = False,
) -> None:
    """Tune the cache: the fastest setting that meets a quality target (--target), or MagCache's curve (--calibrate)."""
    from accel.launch.environment import rank
    from accel.parallel.mesh import under_distributed_launcher

    lead = rank() == 0
    try:
        if (target is None) == (not calibrate):
            raise UserError(
                "accel tune: pass --target psnr=32 (or ssim=0.95) to search for the fastest cache setting that "
                "meets it, or --calibrate to measure MagCache's curve" + ("; not both" if calibrate else "")
            )
        if calibrate and methods is not None:
            raise UserError(
                "--methods is for --target (the cache methods it searches); --calibrate measures MagCache's curve only"
            )
        from accel.recipe import load_recipe
        from accel.tune import fresh_recipe_path

        settings = load_recipe(recipe)
        if calibrate:
            from accel.tune import calibrate as run_calibration

            path = out if out is not None else fresh_recipe_path(recipe, "magcache")
            calibrated = run_calibration(settings, path)
            ratios = calibrated.cache.mag_ratios
            console.print(
                f'wrote {path}: [cache] method = "magcache", threshold = {calibrated.cache.threshold}, '
                f"{len(ratios[0])} ratios (one a step) for {len(ratios)} CFG branch{'es' if len(ratios) > 1 else ''}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            return
        assert target is not None
        from accel import preflight
        from accel.tune.search import parse_methods
        from accel.tune.target import parse_target

        goal = parse_target(target)
        chosen = parse_methods(methods) if methods is not None else None
        texts = _read_prompts(prompts) if prompts is not None else None
        if gpus is not None:
            if gpus < 1:
                raise UserError(f"--gpus must be >= 1, got {gpus}")
            settings = settings.with_overrides({"parallel": {"gpus": gpus}}, source="command line")
        if repeats < 1:
            raise UserError(f"--repeats must be >= 1, got {repeats}")
        if warmup is not None and warmup < 0:
            raise UserError(f"--warmup must be >= 0, got {warmup}")
        recipe_out = out if out is not None else fresh_recipe_path(recipe, "tuned")
        plot_out = plot if plot is not None else recipe_out.with_suffix(".png")
        for path, flag in ((recipe_out, "--out"), (plot_out, "--plot")):
            if lead and path.exists():
                raise UserError(f"{flag} {path} exists: accel tune never overwrites; pass another {flag}")
            if not path.parent.is_dir():
                raise UserError(f"{flag} {path}: no folder {path.parent}; create it or pass another {flag}")
        if settings.world_size > 1 and not under_distributed_launcher():
            from accel.launch.environment import LaunchSpec

            spec = LaunchSpec.for_world(settings.world_size, timeout_s=settings.parallel.timeout)
            preflight.check_process_count(spec.nproc, settings.model.device, oversubscribe)
            pinned = (
                *(("--out", str(recipe_out)) if out is None else ()),
                *(("--plot", str(plot_out)) if plot is None else ()),
            )
            raise typer.Exit(relaunch(ctx, settings, spec, pinned))
        settings = fit_to_job(settings)
        from accel.tune.job import tune_to_target, write_outputs

        announce = (lambda line: console.print(line, markup=False, highlight=False)) if lead else (lambda _line: None)
        result = tune_to_target(settings, goal, texts, repeats, warmup, announce, chosen)
        if result is None:
            return
        from accel.tune.report import summary, tune_table

        console.print(tune_table(result))
        console.print(summary(result), markup=False, highlight=False, soft_wrap=True)
        if result.best is None:
            raise UserError(_unreachable(result))
        write_outputs(result, recipe_out, plot_out)
    except UserError as error:
        fail(str(error))
        return
    from accel.tune.search import describe

    best = result.best
    console.print(
        f"chosen: {describe(best.cache)}: {best.final_speedup:.2f}× with worst-prompt PSNR "
        f"{best.psnr_db:.1f} dB, SSIM {best.ssim:.4f}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    if best.final_speedup < 1:
        console.print(
            f"note: even this setting is slower than the uncached run here ({best.final_speedup:.2f}×): on this "
            "machine the "
            "cache costs more than the blocks it skips",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    console.print(f"wrote {recipe_out} and {plot_out}", markup=False, highlight=False, soft_wrap=True)


def _read_prompts(path: Path) -> tuple[str, ...]:
    """One prompt a line; blank lines and lines starting with # are skipped."""
    from accel.recipe.limits import PROMPT_CHARS_ENV, prompt_chars, read_capped

    try:
        lines = read_capped(path, f"--prompts {path}", "write one prompt a line").decode("utf-8").splitlines()
    except OSError as error:
        raise UserError(f"--prompts {path}: cannot read it ({error.strerror})") from None
    except UnicodeDecodeError:
        raise UserError(f"--prompts {path}: not UTF-8 text; write one prompt a line") from None
    found = tuple(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not found:
        raise UserError(f"--prompts {path}: no prompt in it; write one prompt a line")
    limit = prompt_chars()
    for number, text in enumerate(found, 1):
        if len(text) > limit:
            raise UserError(
                f"--prompts {path}: prompt {number} has {len(text):,} characters, more than {limit:,}; "
                f"shorten it ({PROMPT_CHARS_ENV} raises the limit)"
            )
    return found


def _unreachable(result: Any) -> str:
    """Why no setting was chosen, with the best quality any caching setting reached."""
    goal = result.target
    cached = [t for t in result.trials if t.hit_rate > 0]
    if not cached:
        return (
            "accel tune: no setting tried cached any call on this pipeline, so none can be faster than the uncached run"
        )
    closest = max(cached, key=lambda t: goal.of(t.psnr_db, t.ssim))
    from accel.tune.search import describe

    reached = f"{closest.psnr_db:.1f} dB" if goal.metric == "psnr" else f"SSIM {closest.ssim:.4f}"
    return (
        f"accel tune: no cache setting reaches {goal.describe()} on every prompt; the closest, "
        f"{describe(closest.cache)}, reached {reached}; lower the target"
    )
