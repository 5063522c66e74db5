"""OpenAI's asynchronous video API over the dispatcher: `POST /v1/videos` answers with a job at once
(JSON, or multipart as the openai client sends it, with `input_reference` for image-to-video
pipelines); `GET /v1/videos/{id}` reports its status and progress (the denoising steps done, from
the replica's leader), `GET /v1/videos` lists the jobs, `GET /v1/videos/{id}/content` downloads
the MP4 and `DELETE /v1/videos/{id}` removes a job, stopping it at its next step if it runs.

A job runs whether or not its client stays; the checks of a request come before it is created, so
a bad one is a 400 and never a failed job.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from pydantic import ValidationError

from accel.serve.dispatch import Dispatcher, QueueFull, ShuttingDown
from accel.serve.replica import Outcome
from accel.serve.requests import BadRequest, Job, Served, VideoRequest, to_job, validation_message, variant_of_job
from accel.serve.uploads import check_pictures, pipelines_that_do, request_fields, save_picture
from accel.serve.video_jobs import VideoJob, VideoJobs, is_id

log = logging.getLogger("accel.serve")

# What a stopped job's record says, by the reason it stopped.
STOPPED = {
    "time_limit": ("time_limit", "the job ran past this server's time limit (accel serve --request-timeout)"),
    "shutdown": ("server_stopped", "the server shut down before this job finished"),
}
MAX_LIST = 100


def add_video_routes(
    app: FastAPI,
    served: Served,
    dispatcher: Dispatcher,
    jobs: VideoJobs | None,
    counter: Iterator[int],
    error: Callable[..., JSONResponse],
    refuse_busy: Callable[[Exception], JSONResponse],
    count: Callable[[str, int], None],
) -> None:
    """The job endpoints on `app`; `jobs` None (an image server): creating one is refused as a video
    request to an image server is, and no job is ever found."""
    running: dict[str, int] = {}  # job id -> the dispatcher's id, while it is queued or runs

    def unknown(video_id: str) -> JSONResponse:
        return error(404, f"no video job {video_id!r} on this server (it may have expired)", "invalid_request_error")

    def live(job: VideoJob) -> dict[str, Any]:
        """The record, with a running job's status and progress as they are now."""
        view = job.as_api()
        queued = running.get(job.id)
        done = dispatcher.progress(queued) if job.status == "queued" and queued is not None else None
        if done is not None:
            view["status"], view["progress"] = "in_progress", done
        return view

    async def finish(job: VideoJob, queued: int, outcome_of: asyncio.Future[Outcome]) -> None:
        try:
            outcome = await outcome_of
        finally:
            running.pop(job.id, None)
        assert jobs is not None
        jobs.expire()  # each job's end sweeps the folder of the jobs whose time is up
        if outcome.ok:
            await asyncio.to_thread(jobs.completed, job.id, outcome.files[0])
        elif outcome.cancelled == "deleted":
            pass  # its record is gone already
        elif outcome.cancelled in STOPPED:
            jobs.failed(job.id, *STOPPED[outcome.cancelled])
        else:
            request_id = f"req_{uuid.uuid4().hex[:16]}"
            log.error("%s (%s): %s", request_id, job.id, outcome.error)
            jobs.failed(
                job.id, "generation_failed", f"the server failed on this job (request id {request_id}); its log has why"
            )

    @app.post("/v1/videos")
    async def create(request: Request) -> JSONResponse:
        try:
            fields, uploads = await request_fields(request, ("input_reference",))
            if len(uploads.get("input_reference", ())) > 1:
                raise BadRequest("input_reference", "input_reference: one picture a job")
            upload = uploads["input_reference"][0] if uploads else None
            try:
                body = VideoRequest.model_validate(fields)
            except ValidationError as invalid:
                raise validation_message(list(invalid.errors())) from None
            job = to_job(body, served, next(counter), frozenset({"image"}) if upload is not None else frozenset())
            assert jobs is not None  # to_job refused a video request to an image server
            if upload is None and job.pipeline is None and served.needs_picture:
                raise BadRequest(
                    "input_reference", f"input_reference: {served.name}'s pipeline starts from a picture; upload one"
                )
            frames = int(job.generate.get("frames") or served.defaults.get("frames") or 1)
            seconds = body.seconds or f"{frames / served.family.fps:.2f}"
            record = jobs.create(
                served.name, body.prompt, _size(job, served), seconds, frames, int(job.generate["seed"])
            )
            if upload is not None:
                job = _with_picture(job, record, upload, jobs, served)
            try:
                outcome_of = dispatcher.enqueue(job)
            except (QueueFull, ShuttingDown):
                jobs.delete(record.id)
                raise
        except BadRequest as bad:
            count("/v1/videos", 400)
            return error(400, bad.message, "invalid_request_error", bad.param)
        except (QueueFull, ShuttingDown) as busy:
            response = refuse_busy(busy)
            count("/v1/videos", response.status_code)
            return response
        running[record.id] = job.id
        asyncio.ensure_future(finish(record, job.id, outcome_of))
        count("/v1/videos", 200)
        return JSONResponse(live(record))

    @app.get("/v1/videos")
    async def listed(after: str | None = None, limit: int = 20, order: str = "desc") -> JSONResponse:
        if not 1 <= limit <= MAX_LIST:
            return error(400, f"limit: between 1 and {MAX_LIST}, not {limit}", "invalid_request_error", "limit")
        if order not in ("asc", "desc"):
            return error(400, f'order: "asc" or "desc", not {order!r}', "invalid_request_error", "order")
        page, more = jobs.listed(after, limit, order) if jobs is not None else ([], False)
        data = [live(job) for job in page]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": more,
            }
        )

    @app.get("/v1/videos/{video_id}")
    async def retrieve(video_id: str) -> JSONResponse:
        job = jobs.get(video_id) if jobs is not None and is_id(video_id) else None
        return JSONResponse(live(job)) if job is not None else unknown(video_id)

    @app.get("/v1/videos/{video_id}/content", response_model=None)
    async def content(video_id: str, variant: str = "video") -> JSONResponse | FileResponse:
        job = jobs.get(video_id) if jobs is not None and is_id(video_id) else None
        if job is None or jobs is None:
            return unknown(video_id)
        if variant != "video":
            return error(400, f'variant: only "video" is served, not {variant!r}', "invalid_request_error", "variant")
        if job.status != "completed":
            status = live(job)["status"]
            return error(
                409,
                f"video job {video_id} is {status}; its content is there once its status is completed",
                "invalid_request_error",
            )
        return FileResponse(jobs.content_of(video_id), media_type="video/mp4", filename=f"{video_id}.mp4")

    @app.delete("/v1/videos/{video_id}")
    async def delete(video_id: str) -> JSONResponse:
        job = jobs.delete(video_id) if jobs is not None and is_id(video_id) else None
        if job is None:
            return unknown(video_id)
        if (queued := running.get(video_id)) is not None:
            dispatcher.cancel(queued, "deleted")  # dropped from the queue, or stopped at its next step
        return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})


def _size(job: Job, served: Served) -> str:
    width = job.generate.get("width") or served.defaults.get("width")
    height = job.generate.get("height") or served.defaults.get("height")
    return f"{width}x{height}"


def _with_picture(job: Job, record: VideoJob, upload: Any, jobs: VideoJobs, served: Served) -> Job:
    """The job with its uploaded picture, kept next to its record until the job ends, for a
    pipeline that takes one."""
    from dataclasses import replace

    variant = variant_of_job(served, job.pipeline)
    if variant is None or variant.image is None:
        jobs.delete(record.id)
        raise BadRequest(
            "input_reference",
            f"input_reference: {served.name}'s pipeline takes no picture; {pipelines_that_do(served, 'video')}",
        )
    path = save_picture(upload, jobs.input_path(record.id, ""))
    try:
        check_pictures(served, {"image": path}, variant)
    except BadRequest as bad:
        jobs.delete(record.id)
        raise BadRequest("input_reference", bad.message.replace("image", "input_reference", 1)) from None
    return replace(job, generate={**job.generate, "image": str(path)})
