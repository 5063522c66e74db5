"""The playground at `/` (`accel serve --no-playground` leaves it out): a page of static files, no
build step, that uses the server's own API as any client does, with the key a user types in.

Two accel endpoints serve it, and any other client too: `GET /v1/playground` says what the served
pipeline takes (its output, whether it starts from a picture or a mask, its default size and
steps, the LoRAs it may choose), and `GET /v1/requests/{id}` the progress of a synchronous request
sent with an `X-Request-Id` header (OpenAI's image API answers only at the end; a video job has its own status).
"""

from __future__ import annotations

from importlib import resources
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response

from accel.serve.dispatch import Dispatcher
from accel.serve.requests import MAX_IMAGES, Served

ASSETS = {"playground.js": "text/javascript", "playground.css": "text/css"}
# Answered without a key (static files holding no data; the page asks for the key to call the API).
PAGES = ("/", *(f"/playground/{name}" for name in ASSETS))
REQUEST_ID_CHARS = 100


def _asset(name: str) -> str:
    return resources.files("accel.serve").joinpath("playground", name).read_text(encoding="utf-8")


def add_playground(
    app: FastAPI,
    served: Served,
    dispatcher: Dispatcher,
    in_flight: dict[str, int],
    page: bool,
    error: Callable[..., JSONResponse],
) -> None:
    """The two endpoints; with `page`, the page and its files too. `error`: the front's OpenAI-shaped refusal."""

    from accel.serve.tasks import needs

    family = served.family

    @app.get("/v1/playground")
    async def playground() -> dict[str, Any]:
        # The served pipeline and its siblings on the same weights (accel/serve/tasks.py): a field shows
        # where any of them takes it, and is required where each of them does.
        others = [
            v
            for name, v in served.pipelines.items()
            if v is not served.variant and family.output_of(name) == served.output
        ]
        variants = [v for v in (served.variant, *others) if v is not None]
        return {
            "model": served.name,
            "output": served.output,
            "picture": served.needs_picture or any(v.image is not None for v in variants),
            "needs_picture": served.needs_picture and all("image" in needs(v, set()) for v in others),
            "mask": any(v.mask is not None for v in variants),
            "needs_mask": served.needs_mask and all("mask" in needs(v, {"image"}) for v in others),
            "defaults": served.defaults,
            "max_images": MAX_IMAGES,
            "loras": sorted(served.loras),
        }

    @app.get("/v1/requests/{request_id}")
    async def progress(request_id: str) -> JSONResponse:
        job_id = in_flight.get(request_id[:REQUEST_ID_CHARS])
        if job_id is None:
            message = f"no request {request_id[:40]!r} waiting or running (it is answered, or never came)"
            return error(404, message, "invalid_request_error")
        done = dispatcher.progress(job_id)
        status = "queued" if done is None else "in_progress"
        return JSONResponse({"id": request_id, "status": status, "progress": done or 0})

    if not page:
        return

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(_asset("index.html"))

    @app.get("/playground/{name}")
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            return error(404, "not found", "invalid_request_error")
        return Response(_asset(name), media_type=ASSETS[name])
