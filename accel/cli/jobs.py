"""What the commands that generate share: rerunning this command line on every rank of a job
(after the checks that need no rank), fitting a recipe to a torchrun job, and rank 0's progress."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from accel.cli.app import console
from accel.errors import NotAvailableError, UserError


def relaunch(ctx: typer.Context | None, settings: Any, spec: Any, extra: tuple[str, ...] = ()) -> int:
    """Check the layout with what is known before start-up, then rerun this command on every rank."""
    from accel.models.loading import resolve_device, resolve_dtype
    from accel.models.refs import heads_before_start, resolve_model
    from accel.models.lora import parse_loras
    from accel.optimize.quantize import check_hardware
    from accel.parallel.mesh import resolve_degrees
    from accel.parallel.plan import plan_of, refuse_untaught_before_start

    ref = resolve_model(settings.model.name)
    refuse_untaught_before_start(ref, "--gpus / [parallel]", settings.parallel)
    parse_loras(settings.model.lora)  # a missing LoRA file: one line before any rank starts
    check_hardware(settings.quant.type, resolve_device(settings.model.device), resolve_dtype(settings.model.dtype, ref))
    if ref.family is not None:
        from accel.models.call import generation_kwargs

        plan_of(ref.family, "--gpus / [parallel]")
        generation_kwargs(ref.family, ref.tiny, settings, loads_as=ref.pipeline)  # CFG on where cfg = 2
    degrees = resolve_degrees(settings.parallel, heads_before_start(ref), settings.model.name)
    if (
        ref.family is None and degrees.sequence > 1
    ):  # a refusal kept from an earlier verification: before any rank starts
        from accel.parallel.verify_ahead import refuse_kept_verdict

        refuse_kept_verdict(ref.name, degrees.ulysses, degrees.ring, "--gpus / [parallel]")
    if settings.memory.text_encoder == "sharded":
        from accel.parallel.encoders import refusal_before_start

        if (refusal := refusal_before_start(ref)) is not None:  # encoders without a TP plan: before any rank starts
            raise NotAvailableError(refusal)
    return rerun_on_ranks(ctx, spec, settings, extra)


def rerun_on_ranks(ctx: typer.Context | None, spec: Any, settings: Any, extra: tuple[str, ...] = ()) -> int:
    """This very command line (plus `extra`) on every rank of `spec`, under torchrun; a CPU job's
    ranks are forks of this process, which imports what they need first (`accel.launch.forked`)."""
    from accel.launch.forked import forks_ranks
    from accel.launch.supervisor import launch
    from accel.models.loading import import_ahead, resolve_device
    from accel.models.refs import resolve_model

    argv = (ctx.obj or {}).get("argv") if ctx is not None else None
    if argv is None:
        raise UserError("--gpus: relaunching needs the accel command line; run accel from a shell")
    fork = forks_ranks(resolve_device(settings.model.device).type)
    if fork:
        import_ahead(resolve_model(settings.model.name), settings.model.pipeline)
    return launch(spec, "accel.cli", [*argv, *extra], fork=fork)


def fit_to_job(settings: Any) -> Any:
    """Under torchrun: no layout given means one over all the job's ranks; a layout must fit the job."""
    from accel.launch.environment import world_size

    world = world_size()
    if world > 1 and settings.world_size == 1:
        return settings.with_overrides({"parallel": {"gpus": world}}, source="torchrun")
    if settings.world_size != world:
        raise UserError(
            f"[parallel] asks for {settings.world_size} processes, but this torchrun job has {world}; "
            f"make them match (--gpus {world}) or run without torchrun"
        )
    return settings


def check_replicas(replicas: int, gpus: int | None) -> None:
    """`accel serve` / `accel batch`: R replicas share --gpus evenly."""
    if replicas < 1:
        raise UserError(f"--replicas must be >= 1, got {replicas}")
    if gpus is not None and (gpus < 1 or gpus % replicas):
        raise UserError(
            f"--gpus {gpus}: it must be a multiple of --replicas ({replicas}), each replica gets --gpus / --replicas"
        )


def fit_replicas_to_job(settings: Any, replicas: int) -> Any:
    """Under torchrun: one replica of one process takes the job's ranks as `fit_to_job` does; more must fill it."""
    from accel.launch.environment import world_size
    from accel.parallel.mesh import under_distributed_launcher

    world = settings.world_size * replicas
    if not under_distributed_launcher() or world_size() == world:
        return settings
    if world == 1:
        return fit_to_job(settings)
    raise UserError(
        f"{replicas} replica(s) of {settings.world_size} process(es) need {world}, but this torchrun job has "
        f"{world_size()}; make them match"
    )


def say(line: str) -> None:
    console.print(line, markup=False, highlight=False)


def progress(lead: bool) -> Any:
    """Rank 0's step progress: a live bar where someone watches, plain lines where output is piped
    or logged (a bar's redraws would arrive there as a heap of blank lines)."""
    if not lead:
        return None
    return _step_bar if console.is_terminal else _step_lines


@contextmanager
def _step_lines(label: str) -> Iterator[Any]:
    yield _Lines(label)


class _Lines:
    """A line a block of steps, about a quarter of the generation each: 'label: step 6/12, 1.2 s'."""

    BLOCKS = 4

    def __init__(self, label: str) -> None:
        self.label = label
        self.total = 0
        self.done = 0
        self.start_s = 0.0

    def start(self, total: int) -> None:
        import time

        self.total, self.done, self.start_s = total, 0, time.perf_counter()

    def advance(self) -> None:
        import time

        self.done += 1
        block = max(1, -(-self.total // self.BLOCKS))
        if self.done % block == 0 or self.done == self.total:
            say(f"{self.label}: step {self.done}/{self.total}, {time.perf_counter() - self.start_s:.1f} s")


@contextmanager
def _step_bar(label: str) -> Iterator[Any]:
    """A rich bar over denoising steps; the runner starts and advances it from scheduler events."""
    with Progress(
        TextColumn(f"[bold]{label}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
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
