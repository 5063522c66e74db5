"""What a client may ask `accel serve` for, checked on the front before any rank sees it.

The image endpoint takes OpenAI's `images.generate` schema (`model`, `prompt`, `n`, `size`,
`response_format`) plus accel's `seed`, `steps`, `guidance_scale`, `negative_prompt`; the video
endpoint the same with `frames` and without `n`. Anything else, a wrong type, or a setting the
pipeline would refuse or silently change is a `BadRequest` naming the field.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from accel.serve.loras import chosen_loras
from accel.serve.limits import Limits, TokenCounter, position_problem, prompt_problem, token_problem, work_problem

# Most images one request may ask for: a request holds its replica for all of them.
MAX_IMAGES = 4
SEED_LIMIT = 2**31 - 1
# Largest guidance scale taken: far past any useful one, and finite in every dtype's arithmetic.
MAX_GUIDANCE = 1000.0
# Longest clip a request may ask for by seconds (its work is limited by --max-work besides).
MAX_SECONDS = 600
# Digits of a size's side: a 5000-digit one is past what int() parses.
SIDE_DIGITS = 6


class BadRequest(Exception):
    """A request the server refuses: HTTP 400 with `message`, naming `param`."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)

    prompt: str = Field(min_length=1, description="What to generate.")
    model: str | None = Field(None, description="The served model's name; another is refused.")
    size: str | None = Field(None, description='"WIDTHxHEIGHT" in pixels, e.g. "1024x1024".')
    response_format: str = Field("b64_json", description='"b64_json": the file, base64-encoded, in the JSON.')
    seed: int | None = Field(None, ge=0, le=SEED_LIMIT, description="Seed (accel): equal seeds give equal outputs.")
    steps: int | None = Field(None, ge=1, le=1000, description="Denoising steps (accel).")
    guidance_scale: float | None = Field(
        None, ge=0, le=MAX_GUIDANCE, allow_inf_nan=False, description="Guidance scale (accel)."
    )
    negative_prompt: str | None = Field(None, description="Negative prompt (accel), for pipelines that take one.")
    lora: dict[str, float] | None = Field(
        None, description='LoRAs the server registered, by name, with their scales (accel): {"pixel": 0.8}.'
    )
    pipeline: str | None = Field(
        None,
        description="The diffusers pipeline class to run (accel), among those on the served weights "
        "(GET /v1/models lists them); unset: the one the request's pictures ask for.",
    )


class ImageRequest(_Common):
    n: int = Field(1, ge=1, le=MAX_IMAGES, description=f"Images, 1 to {MAX_IMAGES}, seeds seed, seed + 1, ….")


class VideoRequest(_Common):
    frames: int | None = Field(None, ge=1, description="Frames of the video (accel); or give seconds.")
    seconds: str | None = Field(
        None, max_length=12, description='Length of the clip in seconds, as OpenAI sends it ("4"); or give frames.'
    )


@dataclass(frozen=True)
class Job:
    """One request as every rank of a replica runs it: [generate] keys over the server's recipe,
    `count` outputs at seeds seed, seed + 1, …; picklable, it is broadcast."""

    id: int
    kind: Literal["image", "video"]
    generate: dict[str, Any]
    count: int = 1
    stop: bool = False
    loras: tuple[tuple[str, float], ...] = ()  # (name, scale) of the registered LoRAs it runs with
    pipeline: str | None = None  # a sibling pipeline class on the served weights to run (None: the served one)


@dataclass
class Served:
    """What the front knows of the served pipeline to check requests before any rank runs them."""

    name: str
    family: Any
    output: str  # "image" or "video"
    defaults: dict[str, Any] = field(default_factory=dict)  # the pipeline call's width, height, frames, steps
    limits: Limits = field(default_factory=Limits)
    positions: dict[str, int] = field(default_factory=dict)  # the largest width, height, frames the transformer takes
    tokenizers: tuple[
        TokenCounter, ...
    ] = ()  # the pipeline's fast tokenizers (limits.token_counters); none: no token limit
    variant: Any = None  # the served pipeline's Variant (accel/models/base.py), for the pictures it takes
    needs_picture: bool = False  # it starts from a picture and the server's recipe gives none
    needs_mask: bool = False  # it repaints where a mask says and the server's recipe gives none
    loras: dict[str, str] = field(default_factory=dict)  # the LoRAs requests may name, by name (their files)
    max_batch: int = 1  # outputs one pipeline call may make for several requests
    batch_refusal: str | None = None  # why it runs every request alone whatever --max-batch says
    # The pipelines a request may run, by class: the served one first, then those on its weights
    # (accel/serve/tasks.py). Only the served one where the recipe gives input files.
    pipelines: dict[str, Any] = field(default_factory=dict)


def to_job(
    request: ImageRequest | VideoRequest, served: Served, job_id: int, given: frozenset[str] = frozenset()
) -> Job:
    """The job for `request`, which uploads pictures under the names `given` (image, mask)."""
    kind: Literal["image", "video"] = "video" if isinstance(request, VideoRequest) else "image"
    if kind != served.output:
        other = "/v1/videos" if served.output == "video" else "/v1/images/generations"
        raise BadRequest(None, f"{served.name} makes {served.output}s, not {kind}s: POST {other}")
    pipeline = chosen_pipeline(served, request, given)
    if request.response_format != "b64_json":
        raise BadRequest(
            "response_format",
            f'response_format: only "b64_json" is served, not {request.response_format!r} '
            "(a url would need file hosting)",
        )
    for key in ("prompt", "negative_prompt"):  # characters before anything reaches a tokenizer, then tokens
        text = getattr(request, key)
        if problem := prompt_problem(key, text, served.limits) or token_problem(
            key, text, served.tokenizers, served.limits
        ):
            raise BadRequest(key, problem)
    generate: dict[str, Any] = {"prompt": request.prompt}
    if request.size is not None:
        width, height = _size(request.size)
        for key, value in (("width", width), ("height", height)):
            if (problem := served.family.size_problem(key, value)) is not None:
                raise BadRequest(
                    "size", "size: " + problem.removeprefix(f"[generate] {key} {value}: ") + f" ({key} {value})"
                )
            if (problem := position_problem(key, value, served.positions, served.name)) is not None:
                raise BadRequest("size", f"size: {key} {value} is {problem}")
        generate.update(width=width, height=height)
    frames = getattr(request, "frames", None)
    if (seconds := getattr(request, "seconds", None)) is not None:
        if frames is not None:
            raise BadRequest("seconds", "seconds: give seconds or frames, not both")
        frames = frames_for_seconds(served.family, seconds)
    if frames is not None:
        if (problem := served.family.size_problem("frames", frames)) is not None:
            raise BadRequest("frames", "frames: " + problem.removeprefix(f"[generate] frames {frames}: "))
        if (problem := position_problem("frames", frames, served.positions, served.name)) is not None:
            raise BadRequest("frames", f"frames: {frames} is {problem}")
        generate["frames"] = frames
    for key in ("steps", "guidance_scale", "negative_prompt"):
        if (value := getattr(request, key)) is not None:
            generate[key] = value
    if "steps" not in generate and served.defaults.get("steps"):
        generate["steps"] = served.defaults["steps"]  # the job's outcome counts its steps (accel_steps_per_second)
    count = getattr(request, "n", 1)
    if (problem := work_problem(generate, count, served.defaults, served.limits)) is not None:
        raise BadRequest(None, problem)
    try:
        loras = chosen_loras(request.lora, served.loras)
    except ValueError as unknown:
        raise BadRequest("lora", str(unknown)) from None
    generate["seed"] = request.seed if request.seed is not None else random.randint(0, SEED_LIMIT - MAX_IMAGES)
    return Job(job_id, kind, generate, count, loras=loras, pipeline=pipeline)


def chosen_pipeline(served: Served, request: ImageRequest | VideoRequest, given: frozenset[str]) -> str | None:
    """The sibling pipeline class a request runs on (None: the served one): its `pipeline` field, or
    a pipeline class as its `model`, else the one its pictures ask for (accel/serve/tasks.py)."""
    from accel.serve.tasks import pipeline_for

    asked = request.pipeline
    if request.model is not None and request.model != served.name:
        if request.model not in served.pipelines:
            raise BadRequest("model", f"model: this server serves {served.name!r}, not {request.model!r}")
        if asked is not None and asked != request.model:
            raise BadRequest("pipeline", f"pipeline: {asked!r} differs from model {request.model!r}; give one")
        asked = request.model
    if served.variant is None:
        return None
    try:
        return pipeline_for(served.family, served.variant, served.pipelines, served.output, given, asked)
    except ValueError as unknown:
        raise BadRequest("pipeline", str(unknown)) from None


def variant_of_job(served: Served, pipeline: str | None) -> Any:
    """The Variant a job runs: the served one, or the sibling it names."""
    return served.variant if pipeline is None else served.pipelines[pipeline]


def frames_for_seconds(family: Any, text: str) -> int:
    """The frame count nearest `text` seconds at the family's frame rate that the family makes
    (k * frame_step + 1 frames where it has a step), at least one step's worth."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_SECONDS:
        raise BadRequest("seconds", f"seconds: a number of seconds > 0 and <= {MAX_SECONDS}, not {text!r}")
    step = family.frame_step or 1
    return max(1, round(seconds * family.fps / step)) * step + (1 if family.frame_step else 0)


def _size(text: str) -> tuple[int, int]:
    width, sep, height = text.lower().partition("x")
    if len(width.strip()) > SIDE_DIGITS or len(height.strip()) > SIDE_DIGITS:
        raise BadRequest(
            "size", f"size: at most {SIDE_DIGITS} digits a side, not {text[:40]!r}" + ("…" if len(text) > 40 else "")
        )
    if not sep or not width.strip().isdigit() or not height.strip().isdigit() or int(width) < 1 or int(height) < 1:
        raise BadRequest("size", f'size: write "WIDTHxHEIGHT" in pixels, e.g. "1024x1024", not {text!r}')
    return int(width), int(height)


def validation_message(errors: list[dict[str, Any]]) -> BadRequest:
    """pydantic's first complaint as one line naming the field."""
    error = errors[0]
    location = [str(part) for part in error.get("loc", ()) if part != "body"]
    name = ".".join(location) or None
    if error.get("type") == "extra_forbidden":
        return BadRequest(name, f"{name}: not a field of this endpoint")
    if error.get("type") == "missing":
        return BadRequest(name, f"{name}: required")
    if error.get("type") in ("json_invalid", "model_attributes_type", "dict_type"):
        return BadRequest(None, "the body must be a JSON object")
    return BadRequest(
        name, f"{name}: {error.get('msg', 'invalid')}" if name else str(error.get("msg", "invalid request"))
    )
