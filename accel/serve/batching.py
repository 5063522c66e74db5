"""Requests that ask for the same generation but for prompt and seed run as one batched pipeline
call (`--max-batch`): the transformer's work for B samples in one call costs less than B calls
where one sample leaves the device idle, and every sample keeps its own seed's noise.

Only what the batch shares may differ by nothing: size, frames, steps, guidance, negative prompt
and LoRAs; a request with an input picture or video, and any field outside that set, runs alone.
The step cache decides per call, so a batch would share one skip decision among its samples and
a batched output would no longer equal its own run: batching is refused with the cache on.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from accel.errors import UserError
from accel.serve.requests import Job

# The [generate] keys a batch may hold: per sample (prompt, seed) or shared by all of its samples.
PER_SAMPLE = ("prompt", "seed")
SHARED = ("width", "height", "frames", "steps", "guidance_scale", "negative_prompt")


@dataclass(frozen=True)
class Batch:
    """Jobs a replica runs as one pipeline call, in the order they arrived; picklable, it is broadcast."""

    jobs: tuple[Job, ...]
    stop: bool = False

    @property
    def samples(self) -> list[tuple[str, int]]:
        """(prompt, seed) of each output, job by job: a job of `count` outputs is that many samples."""
        return [
            (str(job.generate["prompt"]), int(job.generate["seed"]) + index)
            for job in self.jobs
            for index in range(job.count)
        ]


def batch_key(job: Job) -> Hashable | None:
    """What a job's batch-mates must share with it; None for a job that runs alone."""
    if job.stop or job.id == 0 or set(job.generate) - {*PER_SAMPLE, *SHARED} or "prompt" not in job.generate:
        return None
    return job.kind, job.pipeline, job.loras, tuple((key, job.generate.get(key)) for key in SHARED)


def max_batch_for(settings: Any, most: int) -> int:
    """`--max-batch` checked before any rank starts."""
    if most < 1:
        raise UserError(f"--max-batch must be >= 1, got {most}")
    if most > 1 and settings.cache.enabled:
        raise UserError(
            f"--max-batch {most}: the step cache ([cache] method {settings.cache.method}) decides per call, so the "
            "requests of a batch would share its skips and differ from their own runs; use --max-batch 1 or turn "
            "the cache off (--cache 0)"
        )
    return most


def batch_refusal(pipe: Any, kwargs: dict[str, Any]) -> str | None:
    """Why the served pipeline runs every request alone whatever --max-batch says, or None: its
    call from the server's recipe takes input files (one for the whole batch is not what each
    request asked), its family does not batch prompts faithfully (`Family.batches`), or its result
    holds one sample's output or sound."""
    from accel.models.input_files import takes_files
    from accel.models.registry import family_of

    family = family_of(pipe)
    if not family.batches:
        return f"{family.title}'s pipeline does not give a batched prompt its own output"
    if takes_files(kwargs):
        return "its call takes the recipe's input files"
    if (family.result is not None and not family.result.batched) or (
        family.audio is not None and not family.audio.batched
    ):
        return f"{family.title}'s result holds one sample"
    return None
