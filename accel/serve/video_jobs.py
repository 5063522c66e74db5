"""OpenAI's video jobs, kept on disk: a job is created at once, runs when a replica is free, and its
MP4 waits in the folder for `keep_s` after it finishes, whoever asked for it and whether they are
still connected; a restarted server lists and serves the finished ones.

Each job is two files in the folder: `<id>.json`, its record (replaced whole on every change), and
`<id>.mp4` once it completes (an uploaded `input_reference` is kept as `<id>.input<suffix>` until
the job ends). A job that was queued or running when its server stopped is failed when the next
server starts: the queue lived in the old server's memory.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from accel.cache_dir import cache_root
from accel.files.publish import write_file

Status = Literal["queued", "in_progress", "completed", "failed"]
FINISHED = ("completed", "failed")
ID_PREFIX = "video_"
_ID_LENGTH = len(ID_PREFIX) + 32


@dataclass(frozen=True)
class VideoJob:
    """One job's record as the API returns it (accel's `seed` and `frames` besides OpenAI's fields)."""

    id: str
    created_at: int
    model: str
    prompt: str
    size: str
    seconds: str
    frames: int
    seed: int
    status: Status = "queued"
    progress: int = 0
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict[str, str] | None = None
    object: str = "video"
    remixed_from_video_id: None = None
    sequence: int = 0  # creation order, finer than created_at's seconds; not the API's

    def as_api(self) -> dict[str, Any]:
        view = asdict(self)
        del view["sequence"]
        return view


@dataclass
class VideoJobs:
    """The jobs of one folder; thread-safe (the HTTP loop and the replicas' threads both write)."""

    folder: Path
    keep_s: float
    _jobs: dict[str, VideoJob] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls, folder: Path, keep_s: float) -> VideoJobs:
        """The folder's jobs (created if missing); those an earlier server left unfinished are failed."""
        folder.mkdir(parents=True, exist_ok=True)
        jobs = cls(folder, keep_s)
        for path in sorted(folder.glob(f"{ID_PREFIX}*.json")):
            job = _read(path)
            if job is None:
                continue
            if job.status not in FINISHED:
                job = jobs._finished(job, "failed", error=("server_stopped", "the server stopped before this job ran"))
                jobs._write(job)
            jobs._jobs[job.id] = job
        jobs.expire()
        return jobs

    def create(self, model: str, prompt: str, size: str, seconds: str, frames: int, seed: int) -> VideoJob:
        now = time.time_ns()
        job = VideoJob(new_id(), now // 10**9, model, prompt, size, seconds, frames, seed, sequence=now)
        with self._lock:
            self._jobs[job.id] = job
            self._write(job)
        return job

    def get(self, job_id: str) -> VideoJob | None:
        self.expire()
        with self._lock:
            return self._jobs.get(job_id)

    def listed(self, after: str | None, limit: int, order: str) -> tuple[list[VideoJob], bool]:
        """A page of jobs by creation time (`order` "asc" or "desc"), after the job `after`; whether more follow."""
        self.expire()
        with self._lock:
            jobs = sorted(self._jobs.values(), key=lambda job: (job.sequence, job.id), reverse=order == "desc")
        if after is not None:
            index = next((i for i, job in enumerate(jobs) if job.id == after), None)
            jobs = jobs[index + 1 :] if index is not None else []
        return jobs[:limit], len(jobs) > limit

    def completed(self, job_id: str, video: bytes) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:  # deleted while it ran
                return
            write_file(self.content_of(job_id), lambda temp: temp.write_bytes(video), replace=True)
        self._update(job_id, lambda job: self._finished(job, "completed"))

    def failed(self, job_id: str, code: str, message: str) -> None:
        self._update(job_id, lambda job: self._finished(job, "failed", error=(code, message)))

    def delete(self, job_id: str) -> VideoJob | None:
        with self._lock:
            job = self._jobs.pop(job_id, None)
            if job is not None:
                for path in (self._record_of(job_id), self.content_of(job_id), self._input_of(job_id)):
                    path.unlink(missing_ok=True)
        return job

    def expire(self) -> None:
        """Delete the finished jobs whose time is up, files and all."""
        now = time.time()
        with self._lock:
            gone = [job.id for job in self._jobs.values() if job.expires_at is not None and job.expires_at <= now]
        for job_id in gone:
            self.delete(job_id)

    def content_of(self, job_id: str) -> Path:
        return self.folder / f"{job_id}.mp4"

    def input_path(self, job_id: str, suffix: str) -> Path:
        """Where the job's uploaded picture is kept until the job ends (`suffix` its file type's)."""
        return self.folder / f"{job_id}.input{suffix}"

    def _input_of(self, job_id: str) -> Path:
        found = list(self.folder.glob(f"{job_id}.input.*"))
        return found[0] if found else self.folder / f"{job_id}.input"

    def _record_of(self, job_id: str) -> Path:
        return self.folder / f"{job_id}.json"

    def _finished(self, job: VideoJob, status: Status, error: tuple[str, str] | None = None) -> VideoJob:
        now = int(time.time())
        self._input_of(job.id).unlink(missing_ok=True)
        return replace(
            job,
            status=status,
            progress=100 if status == "completed" else job.progress,
            completed_at=now,
            expires_at=now + max(1, round(self.keep_s)),
            error={"code": error[0], "message": error[1]} if error else None,
        )

    def _update(self, job_id: str, change: Any) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return
            changed = change(job)
            if changed != job:
                self._jobs[job_id] = changed
                self._write(changed)

    def _write(self, job: VideoJob) -> None:
        text = json.dumps(asdict(job), indent=1)
        write_file(self._record_of(job.id), lambda temp: temp.write_text(text), replace=True)


def new_id() -> str:
    return ID_PREFIX + secrets.token_hex(16)


def is_id(text: str) -> bool:
    """Whether `text` has the shape of a job id (anything else never reaches the folder)."""
    tail = text[len(ID_PREFIX) :]
    return len(text) == _ID_LENGTH and text.startswith(ID_PREFIX) and all(c in "0123456789abcdef" for c in tail)


def _read(path: Path) -> VideoJob | None:
    """A record on disk, or None for one that is not a job's (a stray file is left alone)."""
    if not is_id(path.stem):
        return None
    try:
        data = json.loads(path.read_text())
        return VideoJob(**data)
    except (OSError, ValueError, TypeError):
        return None


def default_folder(model: str) -> Path:
    """$ACCEL_CACHE_DIR/videos/<model>, else accel/videos/<model> under the user's cache folder."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model).strip(".") or "model"
    return cache_root() / "videos" / safe
