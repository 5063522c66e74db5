"""One replica of the served pipeline: the ranks that run each request together.

Its leader (the replica's first rank) receives a job, broadcasts it to the replica's ranks, every
rank generates, and the ranks agree on the outcome (all of them, collectively): a failure on any
rank, say out of memory, is one outcome with that rank's message, and the replica goes on to the
next job. The job channel is a gloo group with a timeout of a year: waiting for the next request
is not a stall.

A job is stopped at a step boundary when the front cancels it or it runs past the time limit
(accel/serve/cancel.py); its outcome says why, and the replica goes on with the next job.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from accel.recipe import Recipe
from accel.serve.batching import Batch
from accel.serve.loras import Adapters
from accel.serve.cancel import DONE, FAILED, Board, Cancelled, PeerFailed, StepGate
from accel.serve.requests import Job

IDLE = timedelta(days=365)


@dataclass
class Outcome:
    """A job's result on the leader: the files (PNG or MP4 bytes) and their seeds, or the error."""

    ok: bool
    files: list[bytes] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    steps: int = 0
    hit_rate: float | None = None
    cancelled: str | None = None  # why it stopped before its end: client_gone, time_limit or shutdown
    batch: int = 1  # the requests its pipeline call answered (accel serve --max-batch)


class Replica:
    """This rank's part in its replica. `group` None: a replica of one process."""

    def __init__(
        self,
        pipe: Any,
        handle: Any,
        recipe: Recipe,
        tiny: bool,
        kind: str,
        group: Any,
        leader: int,
        board: Board | None = None,
        time_limit_s: float | None = None,
        adapters: Adapters | None = None,
    ) -> None:
        self.pipe = pipe
        self.adapters = adapters  # the LoRAs requests may choose (None: the server registered none)
        self.handle = handle
        self.recipe = recipe
        self.tiny = tiny
        self.kind = kind
        self.group = group
        self.leader = leader
        # Only the leader reads the board; every rank takes part in the verdict at each step.
        self.gate = StepGate(pipe, board if self._rank() == leader else None, group, time_limit_s)
        # Pipelines on the served one's modules that requests have asked for, by class (accel/serve/tasks.py).
        self.siblings: dict[str, Any] = {}

    def close(self) -> None:
        self.gate.close()

    def lead(self, job: Job | Batch) -> Any:
        """On the leader: run `job` on every rank of the replica (a stop job ends their loops); its
        Outcome, or a batch's outcomes, one per job."""
        self._broadcast(job)
        return self._run(job)

    def follow(self) -> None:
        """On the other ranks: run the leader's jobs until it sends a stop."""
        from accel import watchdog

        while True:
            with watchdog.idle():  # waiting for a request is the plan
                job = self._broadcast(None)
            if job.stop:
                return
            self._run(job)

    def _broadcast(self, job: Job | Batch | None) -> Any:
        if self.group is None:
            assert job is not None
            return job
        from accel.parallel.agree import rank0_object

        return rank0_object(job, self.group)  # the leader is the group's first rank

    def _run(self, job: Job | Batch) -> Any:
        if isinstance(job, Batch):
            return self._run_batch(job)
        if job.stop:
            return Outcome(True)
        start = time.perf_counter()
        outputs: list[tuple[Any, Any]] = []
        error: str | None = None
        self.gate.watch((job.id,), limited=job.id != 0)  # the warm-up (job 0) compiles: no time limit
        try:
            outputs = self._generate(job)
            failed = self.gate.round(DONE) == FAILED  # another rank may have failed after its last step
        except Cancelled as stopped:  # every rank of the replica, at the same step
            return self._stopped(job, stopped, time.perf_counter() - start)
        except PeerFailed:  # this rank is fine; the gather below names the one that failed
            failed = True
        except Exception as failure:  # any rank's failure is the replica's, agreed on below
            error = f"{type(failure).__name__}: {failure}".strip()
            failed = self.gate.round(FAILED) == FAILED
        finally:
            self.gate.watch(())
        if not failed:
            return self._finished(job, outputs, time.perf_counter() - start)
        errors = self._gather(error)
        if any(errors):
            rank, message = next((rank, message) for rank, message in enumerate(errors) if message)
            where = f"rank {self.leader + rank}: " if len(errors) > 1 else ""
            return Outcome(False, error=f"{where}{message}".splitlines()[0][:500])
        return Outcome(False, error="a rank of this replica failed")  # not reached: a round said FAILED

    def _run_batch(self, batch: Batch) -> list[Outcome]:
        """A batch as one call; when it fails on any rank, each of its jobs again alone, so a failure
        fails only the jobs that fail by themselves. A job marked to stop while its batch-mates run
        on ends cancelled, its outputs dropped."""
        start = time.perf_counter()
        outputs: list[tuple[Any, Any]] = []
        self.gate.watch(tuple(job.id for job in batch.jobs))
        try:
            outputs = self._generate_batch(batch)
            failed = self.gate.round(DONE) == FAILED
        except Cancelled as stopped:  # every job of the batch was marked, or the call ran past the time limit
            seconds = time.perf_counter() - start
            return [self._stopped(job, stopped, seconds) for job in batch.jobs]
        except PeerFailed:
            failed = True
        except Exception:  # the jobs run alone below say which of them fail and why
            failed = self.gate.round(FAILED) == FAILED
        finally:
            self.gate.watch(())
        if failed:
            return [self._run(job) for job in batch.jobs]
        seconds = time.perf_counter() - start
        outcomes: list[Outcome] = []
        for job in batch.jobs:
            mine, outputs = outputs[: job.count], outputs[job.count :]
            reason = self.gate.board.reason(job.id) if self.gate.board is not None else None
            if reason:
                outcomes.append(self._stopped(job, Cancelled(reason, int(job.generate.get("steps") or 0)), seconds))
            else:
                outcomes.append(replace(self._finished(job, mine, seconds), batch=len(batch.jobs)))
        return outcomes

    def _generate_batch(self, batch: Batch) -> list[tuple[Any, Any]]:
        from accel.generate import generate_batch

        _settings, pipe, kwargs = self._call(batch.jobs[0])  # what the batch shares is the first job's
        prompts, seeds = zip(*batch.samples)
        return generate_batch(pipe, kwargs, list(prompts), list(seeds))

    def _finished(self, job: Job, outputs: list[tuple[Any, Any]], seconds: float) -> Outcome:
        if self._rank() != self.leader:
            return Outcome(True)
        stats = self.handle.cache_stats
        seed = int(job.generate["seed"])
        return Outcome(
            True,
            [self._encode(output, audio) for output, audio in outputs],
            [seed + i for i in range(job.count)],
            seconds=seconds,
            steps=int(job.generate.get("steps") or 0),
            hit_rate=stats.hit_rate if stats is not None else None,
        )

    def _stopped(self, job: Job, stopped: Cancelled, seconds: float) -> Outcome:
        return Outcome(
            False,
            error=f"stopped at step {stopped.step} after {seconds:.1f} s",
            seconds=seconds,
            cancelled=stopped.reason,
        )

    def _generate(self, job: Job) -> list[tuple[Any, Any]]:
        from accel.generate import generate_with_audio

        settings, pipe, kwargs = self._call(job)
        return [generate_with_audio(pipe, kwargs, settings.generate.seed + index) for index in range(job.count)]

    def _call(self, job: Job) -> tuple[Recipe, Any, dict[str, Any]]:
        """The job's LoRAs switched on, its settings over the server's recipe, the pipeline it runs on
        and the call's keyword arguments."""
        from accel.models.call import generation_kwargs
        from accel.models.registry import family_of

        if self.adapters is not None:  # every rank switches alike: the job is the same on all of them
            self.adapters.use(job.loras)
        overrides: dict[str, Any] = {"generate": job.generate}
        if job.pipeline is not None:
            overrides["model"] = {"pipeline": job.pipeline}
        settings = self.recipe.with_overrides(overrides, source="request")
        pipe = self._pipe_for(job)
        return settings, pipe, generation_kwargs(family_of(pipe), self.tiny, settings, pipe)

    def _pipe_for(self, job: Job) -> Any:
        """The served pipeline, or the sibling the job names, built on its modules at first use."""
        if job.pipeline is None:
            return self.pipe
        if job.pipeline not in self.siblings:
            from accel.serve.tasks import build_sibling

            self.siblings[job.pipeline] = build_sibling(self.pipe, self.handle, job.pipeline)
        return self.siblings[job.pipeline]

    def _gather(self, error: str | None) -> list[str | None]:
        if self.group is None:
            return [error]
        import torch.distributed as dist

        gathered: list[str | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, error, group=self.group)
        return gathered

    def _rank(self) -> int:
        if self.group is None:
            return self.leader
        import torch.distributed as dist

        return dist.get_rank()

    def _encode(self, output: Any, audio: Any) -> bytes:
        """The file `accel run --out` writes for this output, as bytes."""
        from accel.media import output_writer
        from accel.models.registry import family_of

        suffix = ".png" if self.kind == "image" else ".mp4"
        with tempfile.TemporaryDirectory(prefix="accel-serve-") as folder:
            path = Path(folder) / f"out{suffix}"
            output_writer(output, self.kind, suffix, family_of(self.pipe).fps, audio)(path)
            return path.read_bytes()
