"""The HTTP front on global rank 0: OpenAI-style endpoints over the dispatcher, FastAPI on uvicorn.

Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a request the
pipeline would refuse or one past the operator's limits (checked here, before any rank sees it),
401 / 413 / 421 from the door (accel/serve/security.py), 429 with Retry-After when the queue is
full, 500 when the replica failed on it (the replica goes on serving) or the front did: a request
id, the reason in the server's log only, 503 while the server shuts down (and from /health when a
replica is gone or all of them run past the time limit), 504 when a request ran past the time
limit and was stopped at a step. A request whose client goes away is cancelled: dropped from the
queue, or stopped at its next step (counted as status 499, nobody is left to read it).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import math
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import ValidationError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from accel.serve.dispatch import Dispatcher, QueueFull, ShuttingDown
from accel.serve.limits import Limits
from accel.serve.playground import REQUEST_ID_CHARS, add_playground
from accel.serve.replica import Outcome
from accel.serve.requests import (
    BadRequest,
    ImageRequest,
    Job,
    Served,
    VideoRequest,
    chosen_pipeline,
    to_job,
    validation_message,
    variant_of_job,
)
from accel.serve.security import Door, Guard
from accel.serve.uploads import check_pictures, pipelines_that_do, request_fields, save_picture
from accel.serve.video_jobs import VideoJobs
from accel.serve.video_routes import add_video_routes

log = logging.getLogger("accel.serve")


class Metrics:
    """What /metrics exposes, in a registry of this app's own."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "accel_requests",
            "Requests answered, by endpoint and HTTP status.",
            ("endpoint", "status"),
            registry=self.registry,
        )
        self.latency = Histogram(
            "accel_request_seconds",
            "Seconds from a generation request to its answer.",
            ("endpoint",),
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=self.registry,
        )
        queue_depth = Gauge("accel_queue_depth", "Requests waiting for a free replica.", registry=self.registry)
        queue_depth.set_function(lambda: dispatcher.waiting)
        busy = Gauge("accel_replicas_busy", "Replicas generating now.", registry=self.registry)
        busy.set_function(lambda: dispatcher.busy)
        self.hit_rate = Gauge(
            "accel_cache_hit_rate",
            "Share of transformer calls the cache skipped, last request.",
            registry=self.registry,
        )
        self.steps_per_s = Gauge(
            "accel_steps_per_second", "Denoising steps per second, last request.", registry=self.registry
        )
        self.cancelled = Counter(
            "accel_cancelled",
            "Requests stopped before their end, by reason (client_gone, time_limit, shutdown, deleted).",
            ("reason",),
            registry=self.registry,
        )
        self.batch = Histogram(
            "accel_batch_requests",
            "Requests answered by the pipeline call that answered each request (accel serve --max-batch).",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=self.registry,
        )
        self.last_seconds = 0.0  # the last generation's, for Retry-After

    def record(self, outcome: Outcome) -> None:
        if outcome.cancelled is not None:
            self.cancelled.labels(outcome.cancelled).inc()
        if outcome.ok:
            self.last_seconds = outcome.seconds
            self.batch.observe(outcome.batch)
        if outcome.ok and outcome.hit_rate is not None:
            self.hit_rate.set(outcome.hit_rate)
        if outcome.ok and outcome.steps and outcome.seconds > 0:
            self.steps_per_s.set(outcome.steps * max(1, len(outcome.files)) / outcome.seconds)


def _error(
    status: int, message: str, kind: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status, headers=headers
    )


def _failed(reason: str) -> JSONResponse:
    """A 500 naming a request id; the reason goes to the log under that id, never to the client."""
    request_id = f"req_{uuid.uuid4().hex[:16]}"
    log.error("%s: %s", request_id, reason)
    return _error(
        500, f"the server failed on this request (request id {request_id}); its log has the reason", "server_error"
    )


def retry_after(dispatcher: Dispatcher, last_seconds: float) -> int:
    """Seconds until a place in the queue is likely free: the queue ahead over the replicas, at the
    last generation's pace (at least 1)."""
    ahead = dispatcher.waiting + dispatcher.busy
    return max(1, math.ceil(last_seconds * ahead / max(1, len(dispatcher.replicas))))


async def _unless_gone(request: Request, work: Awaitable[Outcome], on_gone: Callable[[], None]) -> Outcome:
    """`work`'s outcome; should the client disconnect first, `on_gone` cancels it and its outcome
    (the cancellation) comes back all the same."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            on_gone()
        return await task
    finally:
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read by now: what comes next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _stopped(outcome: Outcome, limits: Limits) -> JSONResponse:
    """The answer to a request cancelled before its end."""
    if outcome.cancelled == "time_limit":
        return _error(
            504,
            f"the request ran past this server's limit of {limits.request_timeout_s:g} s "
            f"(accel serve --request-timeout) and was {outcome.error}; ask for less work",
            "server_error",
        )
    if outcome.cancelled == "shutdown":
        return _error(503, str(ShuttingDown()), "server_error")
    return _error(499, "the client closed the request", "invalid_request_error")  # nobody reads it


def check_edit(served: Served, uploads: dict[str, list[Any]], variant: Any) -> None:
    """An edit the pipeline chosen for it (`variant`: the served one or a sibling) can make: it makes
    pictures from one, and gets what it needs."""
    if served.output != "image" or variant is None or variant.image is None:
        raise BadRequest(None, f"{served.name}'s pipeline edits no pictures; {pipelines_that_do(served, 'image')}")
    images = uploads.get("image", [])
    if not images:
        raise BadRequest("image", "image: required, the picture to edit")
    if len(images) > variant.pictures:
        most = "one picture" if variant.pictures == 1 else f"at most {variant.pictures} pictures"
        raise BadRequest("image", f"image: {variant.pipeline_class} takes {most}, not {len(images)}")
    if len(uploads.get("mask", [])) > 1:
        raise BadRequest("mask", "mask: one mask")
    needs_mask = served.needs_mask or variant is not served.variant  # a sibling never has the recipe's mask
    if variant.mask is not None and "mask" not in variant.optional and not uploads.get("mask") and needs_mask:
        raise BadRequest("mask", f"mask: {variant.pipeline_class} repaints where a mask says; upload one")


def build_app(
    served: Served,
    dispatcher: Dispatcher,
    metrics: Metrics,
    processes: int,
    door: Door | None = None,
    jobs: VideoJobs | None = None,
    playground: bool = True,
) -> FastAPI:
    app = FastAPI(title=f"accel serve {served.name}", docs_url=None, redoc_url=None)
    app.add_middleware(Guard, door=door or Door(max_body=served.limits.max_body))
    started = int(time.time())
    counter = iter(range(1, 2**62))
    in_flight: dict[str, int] = {}  # a client's X-Request-Id -> its job, while it waits or runs

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        bad = validation_message(list(error.errors()))
        metrics.requests.labels(request.url.path, "400").inc()
        return _error(400, bad.message, "invalid_request_error", bad.param)

    @app.exception_handler(HTTPException)
    async def refused(request: Request, error: HTTPException) -> JSONResponse:
        """Starlette's own refusals (an unknown path, a wrong method, a body it cannot decode) in OpenAI's shape."""
        message = (
            "the body must be a JSON object in UTF-8 (numbers of at most 4300 digits)"
            if error.status_code == 400
            else str(error.detail)
        )
        return _error(error.status_code, message, "invalid_request_error", headers=error.headers)

    @app.exception_handler(Exception)
    async def crashed(request: Request, error: Exception) -> JSONResponse:
        metrics.requests.labels(request.url.path, "500").inc()
        return _failed(f"{request.method} {request.url.path}: {type(error).__name__}: {error}")

    def refuse_busy(busy: Exception) -> JSONResponse:
        """429 with Retry-After for a full queue, 503 while shutting down."""
        if isinstance(busy, QueueFull):
            return _error(
                429,
                str(busy),
                "rate_limit_error",
                headers={"Retry-After": str(retry_after(dispatcher, metrics.last_seconds))},
            )
        return _error(503, str(busy), "server_error")

    async def answer(
        endpoint: str,
        request: Request,
        body: ImageRequest | VideoRequest,
        inputs: Callable[[Job], Job] = lambda j: j,
        given: frozenset[str] = frozenset(),
    ) -> JSONResponse:
        start = time.perf_counter()
        named = request.headers.get("x-request-id", "")[:REQUEST_ID_CHARS] or None
        try:
            job = inputs(to_job(body, served, next(counter), given))
            if named is not None:
                in_flight[named] = job.id
            outcome = await _unless_gone(
                request, dispatcher.submit(job), lambda: dispatcher.cancel(job.id, "client_gone")
            )
        except BadRequest as bad:
            response = _error(400, bad.message, "invalid_request_error", bad.param)
        except (QueueFull, ShuttingDown) as busy:
            response = refuse_busy(busy)
        else:
            if outcome.ok:
                data: list[dict[str, Any]] = [
                    {"b64_json": base64.b64encode(file).decode("ascii"), "seed": seed}
                    for file, seed in zip(outcome.files, outcome.seeds)
                ]
                response = JSONResponse({"created": int(time.time()), "data": data})
                metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
            elif outcome.cancelled is not None:
                response = _stopped(outcome, served.limits)
            else:
                response = _failed(outcome.error or "the generation failed")
        finally:
            if named is not None:
                in_flight.pop(named, None)
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @app.post("/v1/images/generations")
    async def images(request: Request, body: ImageRequest) -> JSONResponse:
        return await answer("/v1/images/generations", request, body)

    @app.post("/v1/images/edits")
    async def edits(request: Request) -> JSONResponse:
        """OpenAI's image edits (multipart): `image` (and `mask`) for the served pipeline, if it takes them."""
        with tempfile.TemporaryDirectory(prefix="accel-edit-") as folder:
            try:
                fields, uploads = await request_fields(request, ("image", "mask"))
                try:
                    body = ImageRequest.model_validate(fields)
                except ValidationError as invalid:
                    raise validation_message(list(invalid.errors())) from None
                given = frozenset(name for name, found in uploads.items() if found)
                variant = variant_of_job(served, chosen_pipeline(served, body, given))
                check_edit(served, uploads, variant)
                saved = {
                    name: [save_picture(upload, Path(folder) / f"{name}-{index}") for index, upload in enumerate(found)]
                    for name, found in uploads.items()
                }
                for name, paths in saved.items():
                    for path in paths:
                        check_pictures(served, {name: path}, variant)
            except BadRequest as bad:
                metrics.requests.labels("/v1/images/edits", "400").inc()
                return _error(400, bad.message, "invalid_request_error", bad.param)
            # The first picture is the one to edit; the others follow it in the call's list ([generate] references).
            pictures: dict[str, Any] = {name: str(paths[0]) for name, paths in saved.items()}
            if len(saved["image"]) > 1:
                pictures["references"] = tuple(str(path) for path in saved["image"][1:])
            return await answer(
                "/v1/images/edits",
                request,
                body,
                lambda job: dataclasses.replace(job, generate={**job.generate, **pictures}),
                given,
            )

    @app.post("/v1/videos/generations")
    async def videos(request: Request, body: VideoRequest) -> JSONResponse:
        """accel's synchronous form: the MP4 in the answer, as images come (short clips, benchmarks)."""
        return await answer("/v1/videos/generations", request, body)

    add_video_routes(
        app,
        served,
        dispatcher,
        jobs,
        counter,
        _error,
        refuse_busy,
        lambda endpoint, status: metrics.requests.labels(endpoint, str(status)).inc(),
    )

    add_playground(app, served, dispatcher, in_flight, playground, _error)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": served.name,
                    "object": "model",
                    "created": started,
                    "owned_by": "accel",
                    # accel: the pipeline classes a request's `pipeline` may name (the served one first)
                    "pipelines": list(served.pipelines)
                    or [v.pipeline_class for v in (served.variant,) if v is not None],
                }
            ],
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        if dispatcher.broken is not None:
            return JSONResponse({"status": "failed", "error": dispatcher.broken}, status_code=503)
        if dispatcher.closed:
            return JSONResponse({"status": "draining", "model": served.name}, status_code=503)
        report: dict[str, Any] = {
            "status": "ok",
            "model": served.name,
            "replicas": len(dispatcher.replicas),
            "processes": processes,
        }
        limit = served.limits.request_timeout_s
        late = dispatcher.running_past(limit) if limit is not None else []
        if not late:
            return JSONResponse(report)
        report["late"] = [
            {"replica": replica, "request": job_id, "seconds": round(seconds, 1), "limit": limit}
            for replica, job_id, seconds in sorted(late)
        ]
        every = len({replica for replica, _job, _s in late}) == len(dispatcher.replicas)
        report["status"] = "busy" if every else "degraded"  # a replica still on a request past the time limit
        return JSONResponse(report, status_code=503 if every else 200)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    return app
