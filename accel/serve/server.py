"""`accel serve`: load and accelerate the pipeline once on every rank, warm it up, then answer HTTP
requests on global rank 0 until SIGINT / SIGTERM.

The job's ranks are `replicas` independent groups of the recipe's layout (a `replica` dimension
outside cfg × ring × ulysses): rank 0 leads replica 0 and runs the HTTP front, the first rank of
each other replica leads it and talks to rank 0 over a pair group of their own. On SIGINT /
SIGTERM the front takes no new requests (503), lets the accepted ones run for at most `drain_s`,
then cancels what is left (queued ones are answered 503 at once, running ones stop at their next
step and are answered 503), stops HTTP, sends every replica a stop job, and every rank returns 0.
A second signal cancels at once.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accel.errors import UserError, os_reason
from accel.recipe import Recipe
from accel.serve.cancel import Board, LocalBoard, shared_board
from accel.serve.drain import Signals, drain
from accel.serve.limits import Limits
from accel.serve.loras import Adapters
from accel.serve.replica import IDLE, Outcome, Replica
from accel.serve.requests import Job, Served


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    replicas: int = 1
    max_queue: int = 4
    drain_s: float = 60.0
    planned_peak: int | None = (
        None  # accel plan's estimate of the peak per GPU (accel/memory/fit.py), where one applied
    )
    limits: Limits = Limits()
    api_keys: tuple[str, ...] = ()  # none: no key asked
    trusted_hosts: tuple[str, ...] = ()  # Host names answered beyond the bound address and localhost
    video_dir: Path | None = None  # where video jobs are kept (None: video_jobs.default_folder)
    keep_videos_s: float = 24 * 3600.0  # how long a finished video job is kept
    playground: bool = True  # the page at /
    loras: dict[str, str] = field(default_factory=dict)  # LoRAs requests may choose, by name (accel/serve/loras.py)
    max_loras: int = 4  # adapters kept loaded at once
    max_batch: int = 1  # outputs one pipeline call may make for several requests (accel/serve/batching.py)


def serve(recipe: Recipe, options: ServeOptions, announce: Callable[[str], None] = lambda _line: None) -> None:
    run_replicas(
        recipe,
        options.replicas,
        options.limits,
        lambda started: _front(started, options, announce),
        announce,
        "accel serve",
        planned_peak=options.planned_peak,
        loras=options.loras,
        max_loras=options.max_loras,
        max_batch=options.max_batch,
    )


@dataclass
class Started:
    """Rank 0's view of the running replicas: its own, the pair groups to the other leaders, and
    what requests are checked against."""

    replica: Replica
    pairs: dict[int, Any]
    served: Served
    world: int
    board: Board
    warm_up: bool

    def ready(self) -> list[Outcome]:
        """Every replica's first outcome: its warm-up generation (or a plain ready without one)."""
        import torch.distributed as dist

        from accel import watchdog

        outcomes = [_warm_up(self.replica) if self.warm_up else Outcome(True)]
        for first, pair in self.pairs.items():  # the other replicas warm up at the same time
            box: list[Any] = [None]
            with watchdog.idle():
                dist.recv_object_list(box, src=first, group=pair)
            outcomes.append(box[0])
        return outcomes

    def runners(self) -> list[Callable[[Job], Outcome]]:
        """One callable a replica for the dispatcher: rank 0's own generates, the others' go to their leaders."""
        return [self.replica.lead, *(_remote(first, pair) for first, pair in self.pairs.items())]


def run_replicas(
    recipe: Recipe,
    replicas: int,
    limits: Limits,
    lead: Callable[[Started], None],
    announce: Callable[[str], None],
    command: str,
    warm_up: bool = True,
    planned_peak: int | None = None,
    loras: Mapping[str, str] | None = None,
    max_loras: int = 4,
    max_batch: int = 1,
) -> None:
    """Load and accelerate the pipeline on every rank of `replicas` replicas of the recipe's layout;
    rank 0 then runs `lead` (the HTTP front, a batch), every other rank runs its replica's jobs
    until rank 0 sends a stop."""
    import accel
    from accel.models.loading import load_pipeline, resolve_device, resolve_model
    from accel.models.registry import family_of
    from accel.models.variants import variant_of_class
    from accel.parallel.encoders import loads_into_host_memory, loads_text_encoders
    from accel.parallel.mesh import tp_slice
    from accel.vae.placement import loads_vae_on_gpu
    from accel.threads import cpu_threads

    device = resolve_device(recipe.model.device)
    with cpu_threads(device):  # accel run's thread count on a CPU
        per_replica = recipe.world_size
        world = per_replica * replicas
        rank = _join(device.type, recipe, world, command)
        ref = resolve_model(recipe.model.name)
        announce(f"loading {recipe.model.name}")
        # Offloading starts from host memory (a model that needs it does not fit the GPU whole, even briefly).
        loads_to = "cpu" if recipe.memory.offload != "none" else device
        pipe = load_pipeline(
            recipe.model.name,
            recipe.model.dtype,
            loads_to,
            recipe.model.pipeline or None,
            recipe.model.lora,
            tp_slice=tp_slice(recipe.parallel),
            text_encoders=loads_text_encoders(recipe.memory.text_encoder, per_replica),
            text_encoders_on_cpu=loads_into_host_memory(recipe.memory.text_encoder, per_replica),
            vae_on_cpu=not loads_vae_on_gpu(recipe.memory.vae, per_replica),
        )
        pipe.set_progress_bar_config(disable=True)
        family = family_of(pipe)
        variant = variant_of_class(family, type(pipe))
        kind = family.output_of(variant.pipeline_class)
        if kind not in ("image", "video"):
            verb = "serve" if command == "accel serve" else "use"
            raise UserError(
                f"{command}: {family.title}'s {kind} output is not served yet; {verb} its image or video pipelines"
            )
        if per_replica == 1 and recipe.vae.parallel:
            recipe = recipe.with_overrides({"vae": {"parallel": False}})  # one process per replica: nothing to split
        leader = rank // per_replica * per_replica
        job_group, pairs = _groups(world, per_replica, replicas, rank, recipe, pipe, device.type)
        board: Board = shared_board(rank, os.environ.get("MASTER_ADDR", "127.0.0.1")) if world > 1 else LocalBoard()
        handle = accel.apply(pipe, recipe)
        adapters = Adapters(pipe, loras, max_loras, compiled=recipe.compile.enabled) if loras else None
        replica = Replica(
            pipe, handle, recipe, ref.tiny, kind, job_group, leader, board, limits.request_timeout_s, adapters
        )
        try:
            if rank != leader:
                replica.follow()  # the warm-up is its first job
            elif rank != 0:
                _lead_for_front(replica, pairs[rank], warm_up)
            else:
                plan = (
                    f" (accel plan's estimate of the peak: {planned_peak / 2**30:.1f} GiB per GPU)"
                    if planned_peak
                    else ""
                )
                announce(
                    f"{'warming up' if warm_up else 'starting'} {replicas} replica{'s' if replicas > 1 else ''} of "
                    f"{recipe.world_size} process{'es' if recipe.world_size > 1 else ''}{plan}"
                )
                served = _served(recipe, pipe, family, variant, kind, ref.tiny, limits, loras or {}, max_batch)
                if served.max_batch < max_batch:
                    announce(f"--max-batch {max_batch}: every request runs alone, as {served.batch_refusal}")
                lead(Started(replica, pairs, served, world, board, warm_up))
        finally:
            replica.close()
            handle.remove()


def _served(
    recipe: Recipe,
    pipe: Any,
    family: Any,
    variant: Any,
    kind: str,
    tiny: bool,
    limits: Limits,
    loras: Mapping[str, str],
    max_batch: int = 1,
) -> Served:
    """What the front checks requests against: the pipeline call's own defaults (a request's unset
    sizes and steps count at these in its work), the limits, the transformer's positional range."""
    from accel.models.call import generation_kwargs
    from accel.models.input_files import takes_files
    from accel.serve.batching import batch_refusal
    from accel.serve.tasks import siblings_of
    from accel.serve.limits import positional_limits, token_counters

    call = generation_kwargs(family, tiny, recipe, pipe)
    refusal = batch_refusal(pipe, call) if max_batch > 1 else None
    defaults = {
        "width": call.get("width"),
        "height": call.get("height"),
        "steps": call.get("num_inference_steps"),
        "frames": call.get(family.frames_arg) if family.frames_arg else None,
    }
    # Siblings run the request's pictures, never the recipe's files; model offload chains one pipeline's modules.
    alone = takes_files(call) or recipe.memory.offload == "model"
    pipelines = {variant.pipeline_class: variant} if alone else siblings_of(family, variant)
    return Served(
        recipe.model.name,
        family,
        kind,
        {key: value for key, value in defaults.items() if value is not None},
        limits,
        positional_limits(pipe),
        token_counters(pipe),
        variant,
        variant.image is not None and "image" not in variant.optional and not recipe.generate.image,
        variant.mask is not None and "mask" not in variant.optional and not recipe.generate.mask,
        dict(loras),
        max_batch if refusal is None else 1,
        refusal,
        pipelines,
    )


def _join(device_type: str, recipe: Recipe, world: int, command: str) -> int:
    if world == 1:
        return 0
    from accel.parallel.mesh import init_distributed

    rank, size = init_distributed(device_type, recipe.parallel.timeout)
    if size != world:
        raise UserError(
            f"{command}: this job has {size} processes, but {world // recipe.world_size} replicas of "
            f"{recipe.world_size} need {world}; pass --gpus {world}"
        )
    return rank


def _groups(
    world: int, per_replica: int, replicas: int, rank: int, recipe: Recipe, pipe: Any, device_type: str
) -> tuple[Any, dict[int, Any]]:
    """Every rank creates every group in one order (creation is collective): its replica's job
    group, the pair groups of rank 0 with each other leader, and with several replicas of a
    parallel layout, each replica's own mesh (which `accel.apply` then finds)."""
    if world == 1:
        return None, {}
    import torch.distributed as dist

    replica_ranks = [list(range(first, first + per_replica)) for first in range(0, world, per_replica)]
    job_group, _ = dist.new_subgroups_by_enumeration(replica_ranks, timeout=IDLE, backend="gloo")
    pairs = {
        first: dist.new_group([0, first], timeout=IDLE, backend="gloo")
        for first in range(per_replica, world, per_replica)
    }
    if replicas > 1 and per_replica > 1:
        from accel.parallel.mesh import build_replica_meshes, parallel_degrees

        build_replica_meshes(parallel_degrees(pipe, recipe.parallel), device_type, replicas)
    return job_group, pairs


def _warm_up(replica: Replica) -> Outcome:
    """One generation at the recipe's own settings: compiles, allocates, fills caches."""
    return replica.lead(Job(0, replica.kind, {"seed": replica.recipe.generate.seed}))  # type: ignore[arg-type]


def _lead_for_front(replica: Replica, pair: Any, warm_up: bool) -> None:
    """Another replica's leader: warm up (where asked), say so to rank 0, then run its jobs until a stop."""
    import torch.distributed as dist

    from accel import watchdog

    box: list[Any] = [_warm_up(replica) if warm_up else Outcome(True)]
    dist.send_object_list(box, dst=0, group=pair)
    while True:
        with watchdog.idle():
            dist.recv_object_list(box, src=0, group=pair)
        job: Job = box[0]
        outcome = replica.lead(job)
        if job.stop:
            return
        box = [outcome]
        dist.send_object_list(box, dst=0, group=pair)


def _remote(first: int, pair: Any) -> Callable[[Job], Outcome]:
    """Rank 0's handle on another replica: send the job to its leader, wait for the outcome."""
    import torch.distributed as dist

    def run(job: Job) -> Outcome:
        box: list[Any] = [job]
        dist.send_object_list(box, dst=first, group=pair)
        if job.stop:
            return Outcome(True)
        dist.recv_object_list(box, src=first, group=pair)
        return box[0]

    return run


def _front(started: Started, options: ServeOptions, announce: Callable[[str], None]) -> None:
    import uvicorn

    from accel import watchdog
    from accel.serve.dispatch import Dispatcher
    from accel.serve.front import Metrics, build_app
    from accel.serve.security import Door, exposure_warning

    served = started.served
    warm = started.ready()
    failed = [outcome.error for outcome in warm if not outcome.ok]
    if failed:
        raise UserError(f"accel serve: the warm-up generation failed: {failed[0]}")
    dispatcher = Dispatcher(
        started.runners(), options.max_queue, board=started.board, max_batch=started.served.max_batch
    )
    metrics = Metrics(dispatcher)
    dispatcher.on_outcome = metrics.record
    door = Door(options.host, options.api_keys, options.trusted_hosts, options.limits.max_body)
    jobs = None
    if served.output == "video":
        from accel.serve.video_jobs import VideoJobs, default_folder

        folder = options.video_dir or default_folder(served.name)
        try:
            jobs = VideoJobs.open(folder, options.keep_videos_s)
        except OSError as error:
            raise UserError(
                f"accel serve: cannot keep video jobs in {folder} ({os_reason(error)}); pass --video-dir"
            ) from None
    app = build_app(served, dispatcher, metrics, started.world, door, jobs, options.playground)
    if (warning := exposure_warning(options.host, options.port, options.api_keys)) is not None:
        announce(warning)
    dispatcher.start()
    # Its responses are all sent by the time it is told to stop: a few seconds close the connections.
    config = uvicorn.Config(
        app, host=options.host, port=options.port, log_level="warning", lifespan="off", timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    announce(
        f"serving {served.name} on http://{options.host}:{options.port} ("
        + (
            "POST /v1/images/generations" + (" or /v1/images/edits" if served.variant.image else "")
            if jobs is None
            else f"video jobs at /v1/videos, kept in {jobs.folder}; POST /v1/videos/generations"
        )
        + "; GET /v1/models, /health, /metrics"
        + ("; the playground at /" if options.playground else "")
        + "); Ctrl-C stops"
    )
    # HTTP runs on a thread of its own (uvicorn then leaves the signals alone); this thread waits for
    # a signal and runs the shutdown while the HTTP loop still answers.
    signals = Signals()
    previous = {sig: signal.signal(sig, signals.note) for sig in (signal.SIGINT, signal.SIGTERM)}
    http = threading.Thread(target=server.run, name="accel-http", daemon=True)
    try:
        with watchdog.idle():  # rank 0 waits for clients, not for a stuck collective
            http.start()
            while http.is_alive() and not signals.first.wait(0.25):
                pass
            if signals.first.is_set():
                drain(dispatcher, options.drain_s, signals, announce)
            server.should_exit = True
            http.join()
    finally:
        dispatcher.stop(options.drain_s)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise UserError(
            f"accel serve: could not listen on {options.host}:{options.port} (is the port taken?); pass another --port"
        )
    announce("stopped")
