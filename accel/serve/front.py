"""The HTTP front on global rank 0: OpenAI-style endpoints over the dispatcher, FastAPI on uvicorn.

Errors use OpenAI's shape, `{"error": {"message", "type", "param"}}`: 400 for a request the
pipeline would refuse (checked here, before any rank sees it), 429 when the queue is full, 500
when the replica failed on it (the replica goes on serving), 503 from /health when a replica is gone.
"""

from __future__ import annotations

import base64
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from accel.serve.dispatch import Dispatcher, QueueFull
from accel.serve.replica import Outcome
from accel.serve.requests import BadRequest, ImageRequest, Served, VideoRequest, to_job, validation_message


class Metrics:
    """What /metrics exposes, in a registry of this app's own."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("accel_requests", "Requests answered, by endpoint and HTTP status.", ("endpoint", "status"),
                                registry=self.registry)
        self.latency = Histogram("accel_request_seconds", "Seconds from a generation request to its answer.", ("endpoint",),
                                 buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600), registry=self.registry)
        queue_depth = Gauge("accel_queue_depth", "Requests waiting for a free replica.", registry=self.registry)
        queue_depth.set_function(lambda: dispatcher.waiting)
        busy = Gauge("accel_replicas_busy", "Replicas generating now.", registry=self.registry)
        busy.set_function(lambda: dispatcher.busy)
        self.hit_rate = Gauge("accel_cache_hit_rate", "Share of transformer calls the cache skipped, last request.", registry=self.registry)
        self.steps_per_s = Gauge("accel_steps_per_second", "Denoising steps per second, last request.", registry=self.registry)

    def record(self, outcome: Outcome) -> None:
        if outcome.ok and outcome.hit_rate is not None:
            self.hit_rate.set(outcome.hit_rate)
        if outcome.ok and outcome.steps and outcome.seconds > 0:
            self.steps_per_s.set(outcome.steps * max(1, len(outcome.files)) / outcome.seconds)


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def build_app(served: Served, dispatcher: Dispatcher, metrics: Metrics, processes: int) -> FastAPI:
    app = FastAPI(title=f"accel serve {served.name}", docs_url=None, redoc_url=None)
    started = int(time.time())
    counter = iter(range(1, 2**62))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        bad = validation_message(list(error.errors()))
        metrics.requests.labels(request.url.path, "400").inc()
        return _error(400, bad.message, "invalid_request_error", bad.param)

    async def answer(endpoint: str, body: ImageRequest | VideoRequest) -> JSONResponse:
        start = time.perf_counter()
        try:
            job = to_job(body, served, next(counter))
            outcome = await dispatcher.submit(job)
        except BadRequest as bad:
            response = _error(400, bad.message, "invalid_request_error", bad.param)
        except QueueFull as full:
            response = _error(429, str(full), "rate_limit_error")
        else:
            if outcome.ok:
                data: list[dict[str, Any]] = [{"b64_json": base64.b64encode(file).decode("ascii"), "seed": seed}
                                              for file, seed in zip(outcome.files, outcome.seeds)]
                response = JSONResponse({"created": int(time.time()), "data": data})
                metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
            else:
                response = _error(500, outcome.error or "the generation failed", "server_error")
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @app.post("/v1/images/generations")
    async def images(body: ImageRequest) -> JSONResponse:
        return await answer("/v1/images/generations", body)

    @app.post("/v1/videos")
    async def videos(body: VideoRequest) -> JSONResponse:
        return await answer("/v1/videos", body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": started, "owned_by": "accel"}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        if dispatcher.broken is not None:
            return JSONResponse({"status": "failed", "error": dispatcher.broken}, status_code=503)
        return JSONResponse({"status": "ok", "model": served.name, "replicas": len(dispatcher.replicas), "processes": processes})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    return app
