"""The `accel` command: parses flags into a Recipe and hands it to the runner. Nothing else."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from accel.errors import NotAvailableError, UserError

app = typer.Typer(
    name="accel",
    help="Fast diffusion-transformer inference: First Block Cache, context parallelism, "
    "parallel VAE, quantization and compile on diffusers pipelines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
errors = Console(stderr=True)


def _fail(message: str) -> None:
    errors.print("[bold red]error:[/]", end=" ")
    errors.print(message, markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


Opt = typer.Option


@app.command()
def run(
    model: Annotated[str | None, typer.Argument(help="Registry alias (flux, tiny-flux, …), hub repo id or local folder.")] = None,
    recipe: Annotated[Path | None, Opt("--recipe", "-r", help="TOML recipe; flags override its values.")] = None,
    prompt: Annotated[str | None, Opt("--prompt", "-p")] = None,
    negative_prompt: Annotated[str | None, Opt("--negative-prompt")] = None,
    steps: Annotated[int | None, Opt("--steps", help="Denoising steps.")] = None,
    height: Annotated[int | None, Opt("--height")] = None,
    width: Annotated[int | None, Opt("--width")] = None,
    frames: Annotated[int | None, Opt("--frames", help="Frames (video families).")] = None,
    seed: Annotated[int | None, Opt("--seed")] = None,
    guidance: Annotated[float | None, Opt("--guidance", help="Guidance scale.")] = None,
    dtype: Annotated[str | None, Opt("--dtype", help="auto, float32, float16 or bfloat16.")] = None,
    device: Annotated[str | None, Opt("--device", help="auto, cpu or cuda.")] = None,
    cache: Annotated[float | None, Opt("--cache", metavar="THRESHOLD", help="First Block Cache threshold (0 = off).")] = None,
    out: Annotated[Path | None, Opt("--out", "-o", help="Output .png / .mp4 (default: a fresh name under outputs/).")] = None,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace --out / --json if they exist.")] = False,
    json_path: Annotated[Path | None, Opt("--json", help="Write every measured number to this JSON file.")] = None,
    compare: Annotated[bool, Opt("--compare", help="Also run the unaccelerated baseline: speedup and PSNR.")] = False,
    warmup: Annotated[int, Opt("--warmup", help="Untimed warm-up generations before the timed one.")] = 1,
    gpus: Annotated[int | None, Opt("--gpus", help="Processes / GPUs (context parallelism).")] = None,
    ulysses: Annotated[int | None, Opt("--ulysses", help="Ulysses degree.")] = None,
    ring: Annotated[int | None, Opt("--ring", help="Ring degree.")] = None,
    cfg_parallel: Annotated[bool, Opt("--cfg-parallel", help="Run CFG halves on separate ranks.")] = False,
    parallel_vae: Annotated[bool, Opt("--parallel-vae", help="Split the VAE decode over the ranks.")] = False,
    quant: Annotated[str | None, Opt("--quant", help="none, int8wo, int8dq, fp8dq, fp8wo or int4wo.")] = None,
    compile_: Annotated[bool, Opt("--compile", help="torch.compile the transformer blocks.")] = False,
    verbose: Annotated[bool, Opt("--verbose", "-v", help="Also show each cache decision.")] = False,
) -> None:
    """Generate once with the accelerators the flags / recipe ask for, and print the timing table."""
    overrides: dict[str, dict[str, Any]] = {
        "model": {"name": model, "dtype": dtype, "device": device},
        "generate": {
            "prompt": prompt, "negative_prompt": negative_prompt, "steps": steps, "height": height,
            "width": width, "frames": frames, "seed": seed, "guidance_scale": guidance,
        },
        "cache": {"threshold": cache},
        "parallel": {"ulysses": ulysses, "ring": ring, "cfg": 2 if cfg_parallel else None},
        "vae": {"parallel": True if parallel_vae else None},
        "quant": {"type": quant},
        "compile": {"enabled": True if compile_ else None},
    }
    try:
        if gpus is not None and gpus > 1:
            raise NotAvailableError(f"--gpus {gpus}: multi-process runs (context parallelism) are not available yet")
        if gpus is not None and gpus < 1:
            raise UserError(f"--gpus must be >= 1, got {gpus}")
        if json_path is not None and json_path.exists() and not overwrite:
            raise UserError(f"{json_path} already exists; pass --overwrite to replace it or choose another --json")
        metrics = _run(recipe, overrides, out=out, overwrite=overwrite, compare=compare, warmup=warmup)
    except UserError as error:
        _fail(str(error))
        return
    from accel import report

    console.print(report.run_table(metrics))
    if verbose and metrics.cache is not None:
        console.print(report.cache_calls_table(metrics))
    if json_path is not None:
        report.write_json(metrics.as_dict(), json_path)
        console.print(f"wrote {json_path}")


def _run(recipe_path: Path | None, overrides: dict[str, dict[str, Any]], **options: Any) -> Any:
    from accel.features import ensure_available
    from accel.recipe import Recipe, load_recipe

    base = load_recipe(recipe_path) if recipe_path is not None else Recipe.from_dict({})
    given = {section: {k: v for k, v in keys.items() if v is not None} for section, keys in overrides.items()}
    merged = base.with_overrides({section: keys for section, keys in given.items() if keys}, source="command line")
    ensure_available(merged)
    from accel.runner import run as run_recipe  # torch and diffusers load only for a valid recipe

    # A bar only where someone watches: piped output would collect its redraws as blank lines.
    return run_recipe(merged, progress=_step_bar if console.is_terminal else None, **options)


@contextmanager
def _step_bar(label: str) -> Iterator[Any]:
    """A rich bar over denoising steps; the runner starts and advances it from scheduler events."""
    with Progress(
        TextColumn(f"[bold]{label}[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    ) as progress:
        yield _Bar(progress)


class _Bar:
    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task: Any = None

    def start(self, total: int) -> None:
        if self.task is None:
            self.task = self.progress.add_task("steps", total=total)
        else:
            self.progress.reset(self.task, total=total)

    def advance(self) -> None:
        if self.task is not None:
            self.progress.advance(self.task)


@app.command()
def models() -> None:
    """List the model families accel knows and what it can do for each."""
    from accel import report
    from accel.models.registry import FAMILIES

    console.print(report.models_table(list(FAMILIES.values())))


@app.command()
def env(json_out: Annotated[bool, Opt("--json", help="Print JSON instead of a table.")] = False) -> None:
    """Versions, devices and attention kernels available here."""
    from accel import report

    info = report.environment()
    if json_out:
        import json

        print(json.dumps(info, indent=2))
    else:
        console.print(report.environment_table(info))


def _quiet_library_noise() -> None:
    """Import-time notices of the stack (torchao/torch version skew, optional torchvision) are not
    the user's business in a CLI run; library users keep their own logging untouched."""
    import logging
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


def main() -> None:
    _quiet_library_noise()
    try:
        app()
    except KeyboardInterrupt:
        errors.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
