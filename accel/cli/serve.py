"""`accel serve`: the accelerated pipeline kept warm behind an OpenAI-style HTTP API."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

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
from accel.errors import UserError, os_reason
from accel.serve.limits import Limits
from accel.serve.batching import max_batch_for
from accel.serve.loras import loras_for

# The layout flags of `accel run`, less the plan and the offload: a server's are its replicas'.
LAYOUT = ("parallel.ulysses", "parallel.ring", "parallel.tp", "memory.text_encoder", "memory.vae")
PLACEMENT = ("parallel.cfg", "vae.parallel", "vae.tiling", "quant.type", "compile.enabled")
# A server's requests and replicas: the lines `accel run`'s flags read differently here.
PER_REPLICA = {
    "generate.steps": "Default denoising steps of a request.",
    "parallel.ulysses": "Ulysses degree of each replica.",
    "parallel.ring": "Ring degree of each replica.",
    "parallel.tp": "Tensor-parallel degree of each replica.",
    "parallel.cfg": "Run CFG halves on separate ranks of each replica.",
    "memory.text_encoder": "replicated; rank0: only each replica's first rank holds the text encoders; cpu: as rank0, "
    "in host memory; sharded: split over each replica's ranks by transformers' TP plan.",
    "memory.vae": "replicated; rank0: only each replica's first rank decodes; the others keep the VAE in host memory.",
    "vae.parallel": "Split the VAE decode over each replica's ranks.",
    "compile.enabled": "torch.compile the transformer blocks (compiled during the warm-up).",
}


@with_recipe_options(
    RecipeOptions(
        ("generate.steps", "model.dtype", "model.device", "cache.threshold", "cache.method", *LAYOUT),
        before="gpu_memory",
        help=PER_REPLICA,
    ),
    RecipeOptions(PLACEMENT, before="oversubscribe", help=PER_REPLICA),
)
def serve(
    ctx: typer.Context,
    overrides: Overrides,
    model: ModelArgument = None,
    recipe: Annotated[
        Path | None,
        Opt(
            "--recipe",
            "-r",
            help=escape("TOML recipe; flags override its values. Its [generate] values are the requests' defaults."),
            show_default="none",
        ),
    ] = None,
    gpus: Annotated[
        int | None,
        Opt(
            "--gpus",
            help="Processes of the whole server (GPUs; gloo ranks on a CPU-only machine), split evenly over the "
            "replicas.",
            show_default="recipe, else ulysses × ring × cfg × tp, per replica",
        ),
    ] = None,
    replicas: Annotated[
        int,
        Opt(
            "--replicas",
            help="Independent copies of the pipeline, each on --gpus / --replicas processes; "
            "requests go to a free one.",
        ),
    ] = 1,
    host: Annotated[str, Opt("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, Opt("--port", help="Port to listen on.")] = 8000,
    max_queue: Annotated[
        int, Opt("--max-queue", help="Requests that may wait for a free replica; more get HTTP 429.")
    ] = 4,
    drain: Annotated[
        float,
        Opt(
            "--drain",
            help="Seconds the accepted requests may take to finish after SIGINT / SIGTERM; then those still queued "
            "get HTTP 503 and those running stop at their next step.",
        ),
    ] = 60.0,
    request_timeout: Annotated[
        float | None,
        Opt(
            "--request-timeout",
            metavar="SECONDS",
            help="Seconds one request may run; past them it stops at its next step and gets HTTP 504, and /health "
            "reports a replica still on it.",
            show_default="no limit",
        ),
    ] = None,
    max_prompt: Annotated[
        int,
        Opt(
            "--max-prompt",
            metavar="CHARS",
            help="Longest prompt (and negative_prompt) a request may send, in characters; longer ones get HTTP 400.",
        ),
    ] = Limits.max_prompt,
    max_prompt_tokens: Annotated[
        int,
        Opt(
            "--max-prompt-tokens",
            metavar="TOKENS",
            help="Most tokens a prompt (and negative_prompt) may make in any of the pipeline's fast tokenizers, after "
            "the --max-prompt check; more get HTTP 400.",
        ),
    ] = Limits.max_prompt_tokens,
    max_body: Annotated[
        int,
        Opt("--max-body", metavar="BYTES", help="Largest request body; larger ones get HTTP 413 before they are read."),
    ] = Limits.max_body,
    max_work: Annotated[
        int,
        Opt(
            "--max-work",
            metavar="MPX_STEPS",
            help="Most work one request may ask for: width × height × frames × steps × n, in megapixel-steps; more "
            "gets HTTP 400.",
        ),
    ] = Limits.max_work,
    api_keys: Annotated[
        list[str] | None,
        Opt(
            "--api-key",
            metavar="KEY",
            help="A key clients must send as 'Authorization: Bearer KEY' (every endpoint but /health); repeatable.",
            show_default="$ACCEL_API_KEY (comma-separated), else none",
        ),
    ] = None,
    trusted_hosts: Annotated[
        list[str] | None,
        Opt(
            "--trusted-host",
            metavar="NAME",
            help="Another Host header name to answer (others get HTTP 421; * answers any); repeatable.",
            show_default="--host, localhost, 127.0.0.1, ::1",
        ),
    ] = None,
    video_dir: Annotated[
        Path | None,
        Opt(
            "--video-dir",
            metavar="DIR",
            help="Where video jobs (POST /v1/videos) and their MP4s are kept; a restarted server serves the "
            "finished ones.",
            show_default="$ACCEL_CACHE_DIR/videos/MODEL, else ~/.cache/accel/videos/MODEL",
        ),
    ] = None,
    keep_videos: Annotated[
        float,
        Opt("--keep-videos", metavar="HOURS", help="Hours a finished video job and its MP4 are kept."),
    ] = 24.0,
    lora: LoraNames = None,
    lora_dir: LoraDir = None,
    max_loras: MaxLoras = 4,
    max_batch: MaxBatch = 1,
    no_playground: Annotated[
        bool,
        Opt(
            "--no-playground",
            help="Leave out the playground page at / (prompt, size, steps, seed, input picture; progress; the result).",
            **FLAG,
        ),
    ] = False,
    gpu_memory: Annotated[
        float | None,
        Opt(
            "--gpu-memory",
            help="GiB per GPU: a flagship checkpoint's layout of each replica is planned (with --gpus alone) or "
            "checked against it before loading.",
            show_default="the visible GPU's",
        ),
    ] = None,
    oversubscribe: Oversubscribe = False,
) -> None:
    """Keep the accelerated pipeline warm on N processes behind an OpenAI-style HTTP API (images, videos, metrics)."""
    from accel import preflight
    from accel.launch.environment import rank
    from accel.parallel.mesh import under_distributed_launcher

    lead = rank() == 0
    try:
        check_replicas(replicas, gpus)
        if max_queue < 0:
            raise UserError(f"--max-queue must be >= 0, got {max_queue}")
        if drain < 0:
            raise UserError(f"--drain must be >= 0 seconds, got {drain:g}")
        if request_timeout is not None and not 0 < request_timeout < float("inf"):
            raise UserError(f"--request-timeout must be a number of seconds > 0, got {request_timeout:g}")
        if not 0 < keep_videos < float("inf"):
            raise UserError(f"--keep-videos must be a number of hours > 0, got {keep_videos:g}")
        if not 0 < port < 65536:
            raise UserError(f"--port must be between 1 and 65535, got {port}")
        for option, value in (
            ("--max-prompt", max_prompt),
            ("--max-prompt-tokens", max_prompt_tokens),
            ("--max-body", max_body),
            ("--max-work", max_work),
        ):
            if value < 1:
                raise UserError(f"{option} must be >= 1, got {value}")
        from accel.recipe.limits import PROMPT_CHARS_ENV, prompt_chars

        if max_prompt > (every_run := prompt_chars()):  # each request becomes a recipe, which holds to that limit
            raise UserError(
                f"--max-prompt {max_prompt} is above the {every_run:,} characters every accel run takes; "
                f"set {PROMPT_CHARS_ENV} to raise both"
            )
        keys = _api_keys(api_keys)
        if video_dir is not None:  # an unusable one is refused before any rank starts
            try:
                video_dir.expanduser().mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise UserError(
                    f"--video-dir {video_dir}: cannot create it ({os_reason(error)}); pass a folder you may write"
                ) from None
        per_replica = {"model": {"name": model}, "parallel": {"gpus": gpus // replicas if gpus is not None else None}}
        settings = build_recipe(recipe, overrides, per_replica)
        from accel.memory.fit import planned_here
        from accel.recipe.refusals import memory_refusal

        if (refusal := memory_refusal(settings, replicas)) is not None:
            raise UserError(refusal)
        loras = loras_for(settings, lora, lora_dir, max_loras)
        max_batch = max_batch_for(settings, max_batch)
        world = settings.world_size * replicas
        if world > 1 and not under_distributed_launcher():
            import dataclasses

            from accel.launch.environment import LaunchSpec

            spec = dataclasses.replace(LaunchSpec.for_world(world, timeout_s=settings.parallel.timeout), drain_s=drain)
            preflight.check_process_count(world, settings.model.device, oversubscribe)
            planned = planned_here(settings, gpu_memory)  # each replica's layout; seconds, so after the checks
            raise typer.Exit(relaunch(ctx, planned.recipe, spec, planned.flags))
        planned = planned_here(settings, gpu_memory)
        settings = planned.recipe
        settings = fit_replicas_to_job(settings, replicas)
        from accel.serve.server import ServeOptions
        from accel.serve.server import serve as run_server

        announce = (
            (lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True))
            if lead
            else (lambda _line: None)
        )
        limits = Limits(max_prompt, max_body, max_work, max_prompt_tokens, request_timeout)
        run_server(
            settings,
            ServeOptions(
                host,
                port,
                replicas,
                max_queue,
                drain,
                planned.peak,
                limits,
                keys,
                tuple(trusted_hosts or ()),
                video_dir.expanduser() if video_dir is not None else None,
                keep_videos * 3600,
                not no_playground,
                loras,
                max_loras,
                max_batch,
            ),
            announce,
        )
    except UserError as error:
        fail(str(error))
        return


def _api_keys(given: list[str] | None) -> tuple[str, ...]:
    """--api-key's keys, else ACCEL_API_KEY's comma-separated ones (a key on the command line is
    visible to every user of the machine in `ps`; the variable is not)."""
    keys = list(given) if given else os.environ.get("ACCEL_API_KEY", "").split(",")
    keys = [key.strip() for key in keys if key.strip()]
    if any(not key.isprintable() or " " in key for key in keys):
        raise UserError("--api-key / ACCEL_API_KEY: a key is printable characters without spaces")
    return tuple(keys)
