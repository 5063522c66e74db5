"""`accel batch`: every request of a JSONL file through the accelerated pipeline into a folder, on
N processes and R replicas; rerunning the same command resumes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from accel.cli.app import console, fail
from accel.cli.jobs import check_replicas, fit_replicas_to_job, relaunch
from accel.cli.options import (
    FLAG,
    LoraDir,
    LoraNames,
    MaxBatch,
    MaxLoras,
    ModelArgument,
    Opt,
    Oversubscribe,
    Overrides,
    RecipeOptions,
    build_recipe,
    with_recipe_options,
)
from accel.cli.serve import LAYOUT, PER_REPLICA, PLACEMENT
from accel.errors import UserError, os_reason
from accel.serve.batching import max_batch_for
from accel.serve.loras import loras_for


@with_recipe_options(
    RecipeOptions(
        ("generate.steps", "model.dtype", "model.device", "cache.threshold", "cache.method", *LAYOUT, *PLACEMENT),
        before="oversubscribe",
        help=PER_REPLICA,
    ),
)
def batch(
    ctx: typer.Context,
    overrides: Overrides,
    requests: Annotated[
        Path,
        typer.Argument(
            help="JSONL file, one request a line: the fields of POST /v1/images/generations (or /v1/videos), "
            "or OpenAI batch lines ({custom_id, method, url, body}).",
            show_default=False,
        ),
    ],
    model: ModelArgument = None,
    out: Annotated[
        Path | None,
        Opt(
            "--out",
            "-o",
            help="Folder of the outputs (custom_id or line number .png / .mp4) and manifest.jsonl; rerunning into "
            "it resumes.",
            show_default="required",
        ),
    ] = None,
    recipe: Annotated[
        Path | None,
        Opt("--recipe", "-r", help=escape("TOML recipe; flags override its values."), show_default="none"),
    ] = None,
    gpus: Annotated[
        int | None,
        Opt(
            "--gpus",
            help="Processes of the whole batch (GPUs; gloo ranks on a CPU-only machine), split evenly over the "
            "replicas.",
            show_default="recipe, else ulysses × ring × cfg × tp, per replica",
        ),
    ] = None,
    replicas: Annotated[
        int,
        Opt("--replicas", help="Independent copies of the pipeline drawing the requests from one queue."),
    ] = 1,
    shard: Annotated[
        str,
        Opt(
            "--shard",
            metavar="I/N",
            help="Take items I, I + N, I + 2N, … of the file (0 <= I < N): run N of these (a Slurm array, a "
            "Kubernetes indexed Job) over one --out.",
        ),
    ] = "0/1",
    retries: Annotated[
        int,
        Opt("--retries", help="Times a failed request is tried again, in this run and the reruns together."),
    ] = 2,
    strict: Annotated[
        bool,
        Opt(
            "--strict",
            help="Refuse the file for one bad line, before any generation (without: report it, skip it).",
            **FLAG,
        ),
    ] = False,
    lora: LoraNames = None,
    lora_dir: LoraDir = None,
    max_loras: MaxLoras = 4,
    max_batch: MaxBatch = 1,
    oversubscribe: Oversubscribe = False,
) -> None:
    """Generate every request of a JSONL file into a folder with a manifest; a rerun resumes where it stopped."""
    from accel.batch.manifest import Shard
    from accel.launch.environment import rank
    from accel.parallel.mesh import under_distributed_launcher

    lead = rank() == 0
    try:
        if out is None:
            raise UserError("--out is required: the folder the outputs and the manifest go to")
        check_replicas(replicas, gpus)
        if retries < 0:
            raise UserError(f"--retries must be >= 0, got {retries}")
        try:
            sharding = Shard.parse(shard)
        except ValueError as problem:
            raise UserError(str(problem)) from None
        settings = build_recipe(
            recipe, overrides, {"model": {"name": model}, "parallel": {"gpus": gpus // replicas if gpus else None}}
        )
        loras = loras_for(settings, lora, lora_dir, max_loras)
        max_batch = max_batch_for(settings, max_batch)
        kind = _output_kind(settings)
        if lead:
            _check_file(requests.expanduser(), kind, strict)
            from accel.files.folders import make_folder

            make_folder(out.expanduser())
        world = settings.world_size * replicas
        if world > 1 and not under_distributed_launcher():
            import dataclasses

            from accel import preflight
            from accel.launch.environment import LaunchSpec

            # Only rank 0 is signalled; it stops the running items at their next step and ends the ranks.
            spec = dataclasses.replace(LaunchSpec.for_world(world, timeout_s=settings.parallel.timeout), drain_s=0)
            preflight.check_process_count(world, settings.model.device, oversubscribe)
            raise typer.Exit(relaunch(ctx, settings, spec))
        settings = fit_replicas_to_job(settings, replicas)
        from accel.batch.run import BatchOptions, run_batch

        options = BatchOptions(
            requests.expanduser(), out.expanduser(), replicas, sharding, retries, strict, loras, max_loras, max_batch
        )
        code = run_batch(settings, options, _say if lead else (lambda _line: None), _progress if lead else _silent)
    except UserError as error:
        fail(str(error))
        return
    if code:  # failed items or Ctrl-C: the batch's answer, which a launcher passes on as such
        from accel.rank_exit import Verdict

        raise Verdict(code)


def _output_kind(settings: Any) -> str | None:
    """What the model makes, where its registry entry says without loading it (None: learnt once loaded)."""
    from accel.models.refs import resolve_model
    from accel.models.variants import planned_output

    ref = resolve_model(settings.model.name)
    if ref.family is None:
        return None
    kind = planned_output(ref.family, settings.model.pipeline or ref.pipeline)[1]
    return kind if kind in ("image", "video") else None


def _check_file(path: Path, kind: str | None, strict: bool) -> None:
    """An unreadable file, one without a request, or (with --strict) one bad line: one line, before any rank starts."""
    from accel.batch.items import read_items, strict_refusal

    try:
        items, bad = read_items(path, kind)
    except OSError as error:
        raise UserError(f"REQUESTS {path}: cannot read it ({os_reason(error)})") from None
    if strict and bad:
        raise UserError(strict_refusal(path, bad))
    if not items:
        raise UserError(f"REQUESTS {path}: no request in it" + (f" ({bad[0]})" if bad else ""))


@contextmanager
def _progress(total: int) -> Iterator[Any]:
    """A bar with the time left where someone watches; a line every twentieth of the items elsewhere."""
    if console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        columns = (TextColumn("[bold]batch[/]"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            yield _Bar(bar, bar.add_task("items", total=total))
    else:
        yield _Lines(total)


class _Bar:
    def __init__(self, progress: Any, task: Any) -> None:
        self.progress = progress
        self.task = task

    def advance(self, key: str, error: str | None) -> None:
        if error is not None:
            self.progress.console.print(f"{key} failed: {error}", markup=False, highlight=False)
        self.progress.advance(self.task)


class _Lines:
    """'batch: 7/20 items, 12.0 s, about 22 s left' a twentieth of the items, and each failure."""

    def __init__(self, total: int) -> None:
        import time

        self.total = total
        self.done = 0
        self.start = time.monotonic()

    def advance(self, key: str, error: str | None) -> None:
        import time

        self.done += 1
        if error is not None:
            _say(f"{key} failed: {error}")
        if self.done % max(1, self.total // 20) and self.done != self.total:
            return
        elapsed = time.monotonic() - self.start
        left = elapsed / self.done * (self.total - self.done)
        _say(f"batch: {self.done}/{self.total} items, {elapsed:.1f} s" + (f", about {left:.0f} s left" if left else ""))


def _say(line: str) -> None:
    """A whole line however narrow the terminal: file names and messages are not cut."""
    console.print(line, markup=False, highlight=False, soft_wrap=True)


@contextmanager
def _silent(_total: int) -> Iterator[Any]:
    yield None
