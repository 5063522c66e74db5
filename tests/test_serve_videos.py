"""OpenAI's video jobs on `accel serve`: the official openai client creates, polls, lists, downloads
and deletes them; a job runs whatever its client does, reports the steps done as its progress, and
is kept on disk, where a restarted server finds it. The front runs in process over a replica that
records its jobs; the last test runs the real server on tiny-wan."""

from __future__ import annotations

import io
import json
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import uvicorn

from accel.launch.environment import free_port
from accel.models.registry import FAMILIES
from accel.serve.cancel import LocalBoard, StepGate
from accel.serve.dispatch import Dispatcher
from accel.serve.front import Metrics, build_app
from accel.serve.replica import Outcome
from accel.serve.requests import Job, Served
from accel.serve.video_jobs import VideoJobs

# The openai client marks its video calls deprecated with OpenAI's own service; the API stays the one clients speak.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

WAN_DEFAULTS = {"width": 64, "height": 64, "frames": 9, "steps": 4}  # tiny-wan's own call


@dataclass
class Replica:
    """Answers each job with the bytes `video <seed>`, after noting 2 of its steps done; while
    `hold` is clear it waits there (a job in progress)."""

    board: LocalBoard
    jobs: list[Job] = field(default_factory=list)
    hold: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.hold.set()

    def __call__(self, job: Job) -> Outcome:
        if job.stop:
            return Outcome(True)
        self.jobs.append(job)
        self.board.progress(job.id, 2, 4)
        self.hold.wait(30)
        if job.generate.get("prompt") == "fail":
            return Outcome(False, error="RuntimeError: internal detail")
        return Outcome(True, [f"video {job.generate['seed']}".encode()], [int(job.generate["seed"])], steps=4)


@dataclass
class Front:
    url: str
    replica: Replica
    jobs: VideoJobs
    client: openai.OpenAI


@contextmanager
def serve_front(folder: Path, max_queue: int = 4, served: Served | None = None) -> Iterator[Front]:
    """The real app and queue on uvicorn in a thread, over the recording replica."""
    board = LocalBoard()
    replica = Replica(board)
    dispatcher = Dispatcher([replica], max_queue, board=board)
    metrics = Metrics(dispatcher)
    dispatcher.on_outcome = metrics.record
    served = served or Served("tiny-wan", FAMILIES["wan"], "video", dict(WAN_DEFAULTS))
    jobs = VideoJobs.open(folder, keep_s=3600)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(served, dispatcher, metrics, 1, None, jobs), port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    dispatcher.start()
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    try:
        yield Front(url, replica, jobs, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0))
    finally:
        replica.hold.set()
        server.should_exit = True
        thread.join(10)
        dispatcher.stop(5)


@pytest.fixture
def front(tmp_path: Path) -> Iterator[Front]:
    with serve_front(tmp_path / "videos") as serving:
        yield serving


def wait_for(front: Front, video_id: str, status: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        job = httpx.get(f"{front.url}/v1/videos/{video_id}").json()
        if job["status"] == status:
            return job
        time.sleep(0.02)
    raise AssertionError(f"{video_id} never became {status}: {job}")


def test_the_openai_client_creates_polls_lists_downloads_and_deletes_a_job(front: Front) -> None:
    created = front.client.videos.create(prompt="a red fox", seconds="1", size="64x64", extra_body={"seed": 7})
    assert created.object == "video" and created.status in ("queued", "in_progress") and created.id.startswith("video_")
    assert (created.model, created.size, created.seconds, created.prompt) == ("tiny-wan", "64x64", "1", "a red fox")
    done = front.client.videos.poll(created.id, poll_interval_ms=20)
    assert done.status == "completed" and done.progress == 100 and done.error is None
    assert done.completed_at is not None and done.expires_at == done.completed_at + 3600
    # One second at Wan's 16 frames a second, as Wan makes them (4k + 1 frames): 17.
    (job,) = front.replica.jobs
    assert job.generate["frames"] == 17 and job.generate["seed"] == 7
    assert front.client.videos.download_content(created.id).read() == b"video 7"
    other = front.client.videos.create_and_poll(prompt="a white owl", poll_interval_ms=20, extra_body={"seed": 8})
    assert other.status == "completed" and other.seconds == f"{9 / 16:.2f}" and other.size == "64x64"
    listed = [video.id for video in front.client.videos.list(limit=1)]  # one a page: the client follows last_id
    assert listed == [other.id, created.id]
    assert [video.id for video in front.client.videos.list(order="asc")] == [created.id, other.id]
    deleted = front.client.videos.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "video.deleted", True)
    with pytest.raises(openai.NotFoundError) as gone:
        front.client.videos.retrieve(created.id)
    assert gone.value.body == {
        "message": f"no video job {created.id!r} on this server (it may have expired)",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    assert sorted(path.name for path in front.jobs.folder.iterdir()) == [f"{other.id}.json", f"{other.id}.mp4"]


def test_a_running_job_reports_its_steps_as_progress_and_has_no_content_until_done(front: Front) -> None:
    front.replica.hold.clear()
    created = httpx.post(f"{front.url}/v1/videos", json={"prompt": "a red fox"}).json()
    running = wait_for(front, created["id"], "in_progress")
    assert running["progress"] == 50  # 2 of 4 steps
    early = httpx.get(f"{front.url}/v1/videos/{created['id']}/content")
    assert early.status_code == 409 and early.json()["error"]["message"] == (
        f"video job {created['id']} is in_progress; its content is there once its status is completed"
    )
    front.replica.hold.set()
    assert wait_for(front, created["id"], "completed")["progress"] == 100


def test_deleting_a_queued_job_drops_it_and_a_failed_job_names_a_request_id(front: Front, caplog: Any) -> None:
    front.replica.hold.clear()
    first = httpx.post(f"{front.url}/v1/videos", json={"prompt": "a red fox"}).json()
    wait_for(front, first["id"], "in_progress")
    queued = httpx.post(f"{front.url}/v1/videos", json={"prompt": "a white owl"}).json()
    assert queued["status"] == "queued"
    assert httpx.delete(f"{front.url}/v1/videos/{queued['id']}").json()["deleted"] is True
    failing = httpx.post(f"{front.url}/v1/videos", json={"prompt": "fail"}).json()
    front.replica.hold.set()
    failed = wait_for(front, failing["id"], "failed")
    assert failed["error"]["code"] == "generation_failed"
    assert "internal detail" not in failed["error"]["message"] and "request id req_" in failed["error"]["message"]
    assert [job.generate["prompt"] for job in front.replica.jobs] == ["a red fox", "fail"]  # the deleted one never ran


def test_a_restarted_server_serves_the_finished_jobs_and_fails_the_unfinished_ones(tmp_path: Path) -> None:
    folder = tmp_path / "videos"
    with serve_front(folder) as front:
        done = front.client.videos.create_and_poll(prompt="a red fox", poll_interval_ms=20, extra_body={"seed": 3})
        # A job's record as a server killed while the job waited leaves it: queued, never to run.
        cut = front.jobs.create("tiny-wan", "a white owl", "64x64", "1", 17, 0)
    with serve_front(folder) as front:  # the same folder, as `accel serve --video-dir` gives it
        again = front.client.videos.retrieve(done.id)
        assert again.status == "completed" and again.completed_at == done.completed_at
        assert front.client.videos.download_content(done.id).read() == b"video 3"
        stopped = front.client.videos.retrieve(cut.id)
        assert stopped.status == "failed" and stopped.error is not None
        assert (stopped.error.code, stopped.error.message) == (
            "server_stopped",
            "the server stopped before this job ran",
        )


def test_finished_jobs_expire_with_their_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = VideoJobs.open(tmp_path, keep_s=60)
    job = jobs.create("tiny-wan", "a red fox", "64x64", "1", 17, 0)
    jobs.completed(job.id, b"video")
    assert jobs.get(job.id) is not None and jobs.content_of(job.id).read_bytes() == b"video"
    later = time.time() + 61
    monkeypatch.setattr(time, "time", lambda: later)
    assert jobs.get(job.id) is None and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "body, status, param, message",
    [
        ({"seconds": "1", "frames": 9}, 400, "seconds", "seconds: give seconds or frames, not both"),
        ({"seconds": "soon"}, 400, "seconds", "seconds: a number of seconds > 0 and <= 600, not 'soon'"),
        ({"seconds": "0"}, 400, "seconds", "seconds: a number of seconds > 0 and <= 600, not '0'"),
        ({"frames": 10}, 400, "frames", "frames: Wan 2.1 / 2.2 makes 4k+1 frames (1, 5, 9, …); use 9 or 13"),
        ({"size": "64"}, 400, "size", 'size: write "WIDTHxHEIGHT" in pixels, e.g. "1024x1024", not \'64\''),
        ({"n": 2}, 400, "n", "n: not a field of this endpoint"),
        ({"prompt": ""}, 400, "prompt", "prompt: String should have at least 1 character"),
    ],
)
def test_a_bad_request_is_400_and_makes_no_job(front: Front, body: dict, status: int, param: str, message: str) -> None:
    response = httpx.post(f"{front.url}/v1/videos", json={"prompt": "a red fox", **body})
    assert response.status_code == status
    assert response.json()["error"] == {
        "message": message,
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }
    assert list(front.jobs.folder.iterdir()) == [] and front.replica.jobs == []


def test_unknown_ids_limits_variants_and_a_picture_for_a_text_pipeline_are_refused(front: Front) -> None:
    for path in ("video_" + "0" * 32, "video_../../etc", "x"):
        for method in ("GET", "DELETE"):
            response = httpx.request(method, f"{front.url}/v1/videos/{path}")
            assert response.status_code == 404 and response.json()["error"]["message"].startswith("no video job")
    assert httpx.get(f"{front.url}/v1/videos", params={"limit": 0}).json()["error"]["message"] == (
        "limit: between 1 and 100, not 0"
    )
    assert httpx.get(f"{front.url}/v1/videos", params={"order": "up"}).json()["error"]["param"] == "order"
    done = front.client.videos.create_and_poll(prompt="a red fox", poll_interval_ms=20)
    thumbnail = httpx.get(f"{front.url}/v1/videos/{done.id}/content", params={"variant": "thumbnail"})
    assert thumbnail.status_code == 400 and thumbnail.json()["error"]["param"] == "variant"
    with pytest.raises(openai.BadRequestError) as refused:
        front.client.videos.create(prompt="a red fox", input_reference=("fox.png", b"not read", "image/png"))
    assert refused.value.body["message"] == (
        "input_reference: tiny-wan's pipeline takes no picture; serve one that does (WanImageToVideoPipeline, "
        "WanVACEPipeline, WanAnimatePipeline)"
    )


def test_a_full_queue_is_429_and_leaves_no_record(tmp_path: Path) -> None:
    """With no queue (max_queue 0) the idle replica takes a job; the next, while it runs, is 429 and
    leaves no record beside the first's."""
    with serve_front(tmp_path / "videos", max_queue=0) as front:
        front.replica.hold.clear()
        taken = httpx.post(f"{front.url}/v1/videos", json={"prompt": "a red fox"})
        assert taken.status_code == 200, taken.text
        wait_for(front, taken.json()["id"], "in_progress")
        records = sorted(front.jobs.folder.iterdir())
        response = httpx.post(f"{front.url}/v1/videos", json={"prompt": "a red fox"})
        assert response.status_code == 429 and response.json()["error"]["type"] == "rate_limit_error"
        assert sorted(front.jobs.folder.iterdir()) == records and records


def test_the_leader_notes_each_step_done_on_the_board(tiny_wan: Any) -> None:
    board = LocalBoard()
    gate = StepGate(tiny_wan, board, None, None)
    seen: list[tuple[int, int] | None] = []
    hook = tiny_wan.transformer.register_forward_pre_hook(lambda *_: seen.append(board.progress_of(5)))
    try:
        gate.watch((5,))
        tiny_wan(prompt="a red fox", height=64, width=64, num_frames=5, num_inference_steps=3, guidance_scale=1.0)
    finally:
        hook.remove()
        gate.close()
    assert seen == [None, (1, 3), (2, 3)] and board.progress_of(5) == (3, 3)


def test_the_real_server_makes_what_accel_run_makes_from_an_upload_and_keeps_it_on_disk(
    tmp_path: Path,
) -> None:
    """tiny-wan's image-to-video pipeline (its recipe's picture serves the warm-up): a job from an
    uploaded picture is the MP4 `accel run --image` writes, kept in --video-dir."""
    from cli_runs import accel_run
    from test_serve import start

    fox = tmp_path / "fox.png"
    fox.write_bytes(picture((64, 64), noise=True))
    (tmp_path / "gray.png").write_bytes(picture((64, 64)))
    recipe = tmp_path / "i2v.toml"
    recipe.write_text(
        '[model]\nname = "tiny-wan"\npipeline = "WanImageToVideoPipeline"\n\n'
        f'[generate]\nsteps = 2\nimage = "{tmp_path / "gray.png"}"\n'
    )
    folder = tmp_path / "videos"
    server = start("--recipe", str(recipe), "--video-dir", str(folder))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        with fox.open("rb") as upload:
            done = client.videos.create_and_poll(
                prompt="a red fox", input_reference=upload, poll_interval_ms=100, extra_body={"seed": 3, "frames": 5}
            )
        assert done.status == "completed", done
        video = client.videos.download_content(done.id).read()
    finally:
        code, _out, err = server.stop(signal.SIGTERM)
    assert code == 0, err
    run = accel_run(
        *["--recipe", str(recipe), "--image", str(fox), "--seed", "3"],
        *["--frames", "5", "--prompt", "a red fox", "--out", str(tmp_path / "run.mp4")],
        threads=1,  # as the server's process (OMP_NUM_THREADS=1): the bytes are compared
    )
    assert run.exit_code == 0, run.output
    assert video == (tmp_path / "run.mp4").read_bytes()
    # What a restarted server reads (in process above: test_a_restarted_server_serves_the_finished_jobs…).
    record = json.loads((folder / f"{done.id}.json").read_text())
    assert record["status"] == "completed" and (folder / f"{done.id}.mp4").read_bytes() == video
    assert VideoJobs.open(folder, keep_s=3600).get(done.id) is not None


def picture(size: tuple[int, int], mode: str = "RGB", noise: bool = False) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 256, (*size[::-1], 3), dtype=np.uint8) if noise else None
    (Image.fromarray(pixels) if noise else Image.new(mode, size)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_an_image_to_video_pipeline_takes_the_uploaded_picture_checked_as_accel_run_checks_one(tmp_path: Path) -> None:
    from accel.models.variants import variant_of

    variant = variant_of(FAMILIES["wan"], "WanImageToVideoPipeline")
    served = Served("tiny-wan-i2v", FAMILIES["wan"], "video", dict(WAN_DEFAULTS), variant=variant, needs_picture=True)
    with serve_front(tmp_path / "videos", served=served) as front:
        with pytest.raises(openai.BadRequestError) as missing:
            front.client.videos.create(prompt="a red fox")
        assert missing.value.body["message"] == (
            "input_reference: tiny-wan-i2v's pipeline starts from a picture; upload one"
        )
        with pytest.raises(openai.BadRequestError) as garbage:
            front.client.videos.create(prompt="a red fox", input_reference=("fox.png", b"not a picture", "image/png"))
        assert garbage.value.body["message"].startswith("input_reference: the upload is not an image Pillow can read")
        with pytest.raises(openai.BadRequestError) as bomb:
            front.client.videos.create(prompt="a red fox", input_reference=("bomb.png", picture((10_000, 9_000), "1")))
        assert bomb.value.body["message"] == (
            "input_reference: the upload has more than 89,478,485 pixels (Pillow's decompression-bomb limit); "
            "pass a smaller image"
        )
        assert list(front.jobs.folder.iterdir()) == [] and front.replica.jobs == []
        front.replica.hold.clear()
        created = front.client.videos.create(prompt="a red fox", input_reference=("fox.png", picture((64, 64))))
        wait_for(front, created.id, "in_progress")
        (job,) = front.replica.jobs
        kept = Path(job.generate["image"])
        assert kept == front.jobs.folder / f"{created.id}.input.png" and kept.read_bytes() == picture((64, 64))
        front.replica.hold.set()
        wait_for(front, created.id, "completed")
        assert not kept.exists()  # the upload goes with the job's end


def test_a_picture_on_a_text_to_video_server_runs_its_image_to_video_sibling(tmp_path: Path) -> None:
    """LTX-2's checkpoint makes videos from a prompt or from a picture: a text-to-video server gives a
    job with an input_reference to LTX2ImageToVideoPipeline (tests/test_siblings.py runs siblings)."""
    from accel.models.variants import variant_of
    from accel.serve.tasks import siblings_of

    family = FAMILIES["ltx2"]
    variant = variant_of(family, "LTX2Pipeline")
    served = Served("tiny-ltx2", family, "video", dict(WAN_DEFAULTS), variant=variant)
    served.pipelines = siblings_of(family, variant)
    with serve_front(tmp_path / "videos", served=served) as front:
        for upload in (None, ("fox.png", picture((64, 64)))):
            created = front.client.videos.create(prompt="a red fox", **({"input_reference": upload} if upload else {}))
            wait_for(front, created.id, "completed")
        alone, from_picture = front.replica.jobs
        assert alone.pipeline is None and "image" not in alone.generate
        assert from_picture.pipeline == "LTX2ImageToVideoPipeline" and "image" in from_picture.generate


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--keep-videos", "0"], "--keep-videos must be a number of hours > 0, got 0"),
        (["--keep-videos", "inf"], "--keep-videos must be a number of hours > 0, got inf"),
        (
            ["--video-dir", "/proc/accel-videos"],
            "--video-dir /proc/accel-videos: cannot create it (no such file or directory); pass a folder you may write",
        ),
    ],
)
def test_video_job_options_are_checked_before_loading(args: list[str], message: str) -> None:
    from typer.testing import CliRunner

    from accel.cli import app

    result = CliRunner().invoke(app, ["serve", "tiny-wan", *args], catch_exceptions=False)
    assert result.exit_code == 2 and result.stderr.strip() == f"error: {message}"


def test_a_several_process_board_carries_progress_through_rank_0s_store() -> None:
    """Another replica's leader notes its steps in rank 0's TCPStore, where the front reads them."""
    from datetime import timedelta

    import torch.distributed as dist

    from accel.serve.cancel import StoreBoard

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    leader = StoreBoard(dist.TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=30)))
    front = StoreBoard(host)
    assert front.progress_of(9) is None
    leader.progress(9, 3, 8)
    assert front.progress_of(9) == (3, 8)
    front.forget(9)
    assert front.progress_of(9) is None


class _UnrepliedSets:
    """A client of a shared store whose `set` is sent without a reply, as a TCPStore's is: the server applies
    it before this client's next request, and another client may read before that."""

    def __init__(self, shared: dict[str, bytes]) -> None:
        self.shared = shared
        self.in_flight: list[tuple[str, str]] = []

    def set(self, key: str, value: str) -> None:
        self.in_flight.append((key, value))

    def _arrive(self) -> None:
        self.shared.update((key, value.encode()) for key, value in self.in_flight)
        self.in_flight.clear()

    def check(self, keys: list[str]) -> bool:
        self._arrive()
        return all(key in self.shared for key in keys)

    def get(self, key: str) -> bytes:
        self._arrive()
        return self.shared[key]

    def delete_key(self, key: str) -> bool:
        self._arrive()
        return self.shared.pop(key, None) is not None


def test_a_boards_writes_are_readable_by_every_client_once_they_return() -> None:
    """A leader's progress and a cancel reach the store before the call returns; the CI run that read
    `None` right after a leader's write was this race on a real TCPStore."""
    from accel.serve.cancel import StoreBoard

    shared: dict[str, bytes] = {}
    leader, front = StoreBoard(_UnrepliedSets(shared)), StoreBoard(_UnrepliedSets(shared))
    leader.progress(9, 3, 8)
    assert front.progress_of(9) == (3, 8)
    front.cancel(9, "deadline")
    assert leader.reason(9) == "deadline"
    front.forget(9)
    assert front.progress_of(9) is None and leader.reason(9) is None
