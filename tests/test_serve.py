"""`accel serve` with real clients (the official openai client and httpx) against real servers on
gloo ranks: outputs equal `accel run` at the same seed, bad requests are 400 naming the field,
the queue's bound is 429, replicas share the load, a killed rank ends the server, SIGTERM drains."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import numpy as np
import pytest
import commands
from PIL import Image
from typer.testing import CliRunner

from accel.cli import app
from accel.launch.environment import free_port
from accel.media import read_video
from accel.models.registry import FAMILIES
from accel.serve.dispatch import Dispatcher, QueueFull
from accel.serve.replica import Outcome
from accel.serve.requests import BadRequest, ImageRequest, Job, Served, VideoRequest, to_job

ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
START_S = 240  # load, apply and warm up on a shared 2-core machine
PROMPT = "a red fox in the snow"


@dataclass
class Server:
    process: subprocess.Popen[str]
    url: str
    port: int
    tree: list[int]  # the launcher's pid and its descendants' (the ranks) once it served

    def left_behind(self) -> list[int]:
        """The processes of the server that still run (the launcher and ranks whose exit was awaited:
        a zombie has left)."""
        alive = []
        for pid in self.tree:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> tuple[int, str, str]:
        self.process.send_signal(sig)
        out, err = self.process.communicate(timeout=timeout)
        return self.process.returncode, out, err


def start(*args: str) -> Server:
    port = free_port()
    process = commands.popen(
        [sys.executable, "-m", "accel.cli", "serve", *args, "--port", str(port)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"accel serve exited {process.returncode}: {process.communicate()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                tree = [process.pid, *(child.pid for child in psutil.Process(process.pid).children(recursive=True))]
                return Server(process, url, port, tree)
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise AssertionError(f"accel serve did not become healthy in {START_S} s: {process.communicate()}")


def metric(server: Server, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def wait_for(condition: object, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.05)


def _pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def _image(server: Server, **body: object) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/images/generations", json={"prompt": PROMPT, **body}, timeout=300)


@pytest.fixture(scope="module")
def flux_server() -> Iterator[Server]:
    """tiny-flux on 2 gloo ranks (Ulysses 2), a queue of 2."""
    server = start("tiny-flux", "--gpus", "2", "--max-queue", "2")
    yield server
    if server.process.poll() is None:
        server.process.kill()
        server.process.communicate()


def test_openai_client_gets_the_pixels_accel_run_writes(flux_server: Server, tmp_path: Path) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{flux_server.url}/v1", api_key="unused")
    result = client.images.generate(
        model="tiny-flux",
        prompt=PROMPT,
        size="64x48",
        n=2,
        response_format="b64_json",
        extra_body={"seed": 5, "steps": 4},
    )
    assert [item.model_extra["seed"] for item in result.data] == [5, 6]
    served = [_pixels(base64.b64decode(item.b64_json)) for item in result.data]
    out = tmp_path / "run.png"
    done = commands.run(
        [
            sys.executable,
            "-m",
            "accel.cli",
            "run",
            "tiny-flux",
            "--gpus",
            "2",
            "--prompt",
            PROMPT,
            "--seed",
            "5",
            "--steps",
            "4",
            "--width",
            "64",
            "--height",
            "48",
            "--warmup",
            "0",
            "--out",
            str(out),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert served[0].shape == (48, 64, 3) and np.array_equal(served[0], _pixels(out.read_bytes()))
    alone = _image(flux_server, size="64x48", seed=6, steps=4)
    assert alone.status_code == 200 and np.array_equal(
        served[1], _pixels(base64.b64decode(alone.json()["data"][0]["b64_json"]))
    )
    assert [m.id for m in client.models.list().data] == ["tiny-flux"]


def _accel_run(out: Path, *args: str) -> np.ndarray:
    command = [sys.executable, "-m", "accel.cli", "run", "tiny-flux", "--gpus", "2", "--warmup", "0", *args]
    done = commands.run([*command, "--out", str(out)], env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return _pixels(out.read_bytes())


def test_edits_on_a_text_to_image_server_run_the_pipeline_their_pictures_ask_for(
    flux_server: Server, tmp_path: Path
) -> None:
    """A FluxPipeline server answers an edit with a mask by FluxInpaintPipeline and one without by
    FluxImg2ImgPipeline, on its own modules and accelerators (two Ulysses ranks), as `accel run
    --pipeline` makes them; another pipeline is a 400 naming those on the served weights."""
    from openai import BadRequestError, OpenAI

    fox, mask = tmp_path / "fox.png", tmp_path / "mask.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(fox)
    Image.fromarray(np.kron(np.eye(2, dtype=np.uint8) * 255, np.ones((24, 32), np.uint8))).save(mask)
    client = OpenAI(base_url=f"{flux_server.url}/v1", api_key="unused", max_retries=0)
    common = ["--prompt", PROMPT, "--seed", "7", "--steps", "4", "--width", "64", "--height", "48", "--image", str(fox)]
    for pipeline_class, pictures in (
        ("FluxInpaintPipeline", ["--mask", str(mask)]),
        ("FluxImg2ImgPipeline", []),
    ):
        with fox.open("rb") as image, mask.open("rb") as repaint:
            edited = client.images.edit(
                image=image,
                prompt=PROMPT,
                size="64x48",
                extra_body={"seed": 7, "steps": 4},
                **({"mask": repaint} if pictures else {}),
            )
        made = _accel_run(tmp_path / f"{pipeline_class}.png", "--pipeline", pipeline_class, *common, *pictures)
        assert np.array_equal(_pixels(base64.b64decode(edited.data[0].b64_json)), made), pipeline_class
    with fox.open("rb") as image, pytest.raises(BadRequestError) as refused:
        client.images.edit(image=image, prompt=PROMPT, extra_body={"pipeline": "FluxKontextPipeline"})
    assert refused.value.body["param"] == "pipeline" and refused.value.body["message"] == (
        "pipeline: this server runs FluxPipeline, FluxImg2ImgPipeline, FluxInpaintPipeline, not 'FluxKontextPipeline'"
    )
    (model,) = httpx.get(f"{flux_server.url}/v1/models", timeout=30).json()["data"]
    assert model["pipelines"] == ["FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline"]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"size": "50x64"}, "size", "size: FLUX.1 makes widths in multiples of 16 pixels; use 48 or 64 (width 50)"),
        ({"size": "big"}, "size", 'size: write "WIDTHxHEIGHT" in pixels, e.g. "1024x1024", not \'big\''),
        ({"frames": 5}, "frames", "frames: not a field of this endpoint"),
        ({"n": 5}, "n", "n: Input should be less than or equal to 4"),
        ({"n": "two"}, "n", "n: Input should be a valid integer, unable to parse string as an integer"),
        ({"steps": 0}, "steps", "steps: Input should be greater than or equal to 1"),
        ({"model": "flux"}, "model", "model: this server serves 'tiny-flux', not 'flux'"),
        (
            {"response_format": "url"},
            "response_format",
            "response_format: only \"b64_json\" is served, not 'url' (a url would need file hosting)",
        ),
        ({"prompt": ""}, "prompt", "prompt: String should have at least 1 character"),
    ],
)
def test_bad_requests_are_400_naming_the_field_and_the_server_goes_on(
    flux_server: Server, body: dict[str, object], param: str, message: str
) -> None:
    response = _image(flux_server, **body)
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": message,
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }
    assert _image(flux_server, size="32x32", steps=2, seed=1).status_code == 200


def test_videos_on_an_image_model_and_a_missing_prompt_are_refused(flux_server: Server) -> None:
    video = httpx.post(f"{flux_server.url}/v1/videos", json={"prompt": PROMPT}, timeout=60)
    assert video.status_code == 400
    assert video.json()["error"]["message"] == "tiny-flux makes images, not videos: POST /v1/images/generations"
    missing = httpx.post(f"{flux_server.url}/v1/images/generations", json={"size": "32x32"}, timeout=60)
    assert missing.status_code == 400 and missing.json()["error"]["message"] == "prompt: required"
    garbage = httpx.post(
        f"{flux_server.url}/v1/images/generations",
        content=b"{not json",
        timeout=60,
        headers={"content-type": "application/json"},
    )
    assert garbage.status_code == 400


def test_a_10_mb_prompt_and_a_foreign_host_are_refused_at_the_door_and_the_server_goes_on(flux_server: Server) -> None:
    body = b'{"prompt": "' + b"x" * 10_000_000 + b'"}'
    huge = httpx.post(
        f"{flux_server.url}/v1/images/generations",
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    foreign = httpx.get(f"{flux_server.url}/health", headers={"host": "rebound.example"}, timeout=30)
    assert foreign.status_code == 421 and foreign.json()["error"]["code"] == "untrusted_host"
    assert _image(flux_server, size="32x32", steps=2, seed=1).status_code == 200


def test_a_full_queue_answers_429_and_the_others_are_unchanged(flux_server: Server) -> None:
    reference = _pixels(
        base64.b64decode(_image(flux_server, size="32x32", steps=6, seed=11).json()["data"][0]["b64_json"])
    )

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        f"{flux_server.url}/v1/images/generations",
                        json={"prompt": PROMPT, "size": "32x32", "steps": 6, "seed": 11},
                    )
                    for _ in range(8)
                )
            )

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
    for response in responses:
        if response.status_code == 429:
            assert response.json()["error"]["type"] == "rate_limit_error" and int(response.headers["retry-after"]) >= 1
        else:
            assert np.array_equal(_pixels(base64.b64decode(response.json()["data"][0]["b64_json"])), reference)
    metrics = httpx.get(f"{flux_server.url}/metrics", timeout=30).text
    assert 'accel_requests_total{endpoint="/v1/images/generations",status="429"}' in metrics
    assert "accel_request_seconds_bucket" in metrics and "accel_queue_depth 0.0" in metrics
    assert "accel_steps_per_second" in metrics


def test_sigterm_lets_the_request_in_flight_finish_then_exits_0(flux_server: Server) -> None:
    answers: list[httpx.Response] = []
    request = threading.Thread(target=lambda: answers.append(_image(flux_server, size="64x64", steps=48, seed=2)))
    request.start()
    wait_for(lambda: metric(flux_server, "accel_replicas_busy") == 1)  # the request is on the ranks
    code, out, err = flux_server.stop(signal.SIGTERM)
    request.join(60)
    assert code == 0, err
    assert answers and answers[0].status_code == 200 and len(answers[0].json()["data"]) == 1
    assert "stopping: the requests accepted have 60 s to finish" in out and "stopped" in out  # it was in flight


def test_twenty_concurrent_requests_over_two_replicas_all_match_their_seeds() -> None:
    """Each replica splits its weights over tp 2 and keeps the text encoder on its first rank only."""
    server = start(
        "tiny-wan",
        "--gpus",
        "4",
        "--replicas",
        "2",
        "--tp",
        "2",
        "--text-encoder",
        "rank0",
        "--oversubscribe",
        "--max-queue",
        "32",
        "--steps",
        "2",
    )
    try:
        health = httpx.get(f"{server.url}/health", timeout=30).json()
        assert health == {"status": "ok", "model": "tiny-wan", "replicas": 2, "processes": 4}

        async def many() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=600) as client:
                return await asyncio.gather(
                    *(
                        client.post(f"{server.url}/v1/videos/generations", json={"prompt": PROMPT, "seed": seed % 4})
                        for seed in range(20)
                    )
                )

        responses = asyncio.run(many())
        assert [r.status_code for r in responses] == [200] * 20
        videos: dict[int, bytes] = {}
        for seed, response in enumerate(responses):
            item = response.json()["data"][0]
            assert item["seed"] == seed % 4
            videos.setdefault(seed % 4, base64.b64decode(item["b64_json"]))
            assert base64.b64decode(item["b64_json"]) == videos[seed % 4], (
                "the same seed on either replica, the same video"
            )
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"accel-serve-{server.port}.mp4"
        path.write_bytes(videos[0])
        try:
            assert read_video(path).shape[0] > 1
        finally:
            path.unlink()
        assert videos[0] != videos[1]
        images = httpx.post(f"{server.url}/v1/images/generations", json={"prompt": PROMPT}, timeout=60)
        assert (
            images.status_code == 400
            and images.json()["error"]["message"] == "tiny-wan makes videos, not images: POST /v1/videos"
        )
    finally:
        code, _out, err = server.stop(signal.SIGTERM)
    assert code == 0, err


def test_a_killed_rank_fails_health_and_ends_the_server_naming_it() -> None:
    server = start("tiny-flux", "--gpus", "2")
    # The launcher's children are its ranks (forks of it on a CPU job: their command line and
    # /proc/PID/environ are the launcher's); rank 0 is the one serving the port.
    ranks = psutil.Process(server.process.pid).children()
    assert len(ranks) == 2
    victim = next(
        rank.pid
        for rank in ranks
        if not any(c.laddr.port == server.port and c.status == psutil.CONN_LISTEN for c in rank.net_connections())
    )
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    code = server.process.wait(timeout=30)
    elapsed = time.monotonic() - killed
    _out, err = server.process.communicate()
    assert code != 0 and elapsed < 10, (code, elapsed)
    assert "rank 1" in err
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=5)
    assert len(server.tree) == 3 and server.left_behind() == [], "no process left behind"


# --- without a server: the front's checks and the queue -----------------------------------------

FLUX = FAMILIES["flux"]
WAN = FAMILIES["wan"]


def test_requests_become_jobs_with_the_request_s_settings() -> None:
    job = to_job(
        ImageRequest(prompt="p", size="64x32", n=3, seed=7, steps=5, guidance_scale=2.0, negative_prompt="n"),
        Served("tiny-flux", FLUX, "image"),
        1,
    )
    assert job == Job(
        1,
        "image",
        {
            "prompt": "p",
            "width": 64,
            "height": 32,
            "seed": 7,
            "steps": 5,
            "guidance_scale": 2.0,
            "negative_prompt": "n",
        },
        3,
    )
    video = to_job(VideoRequest(prompt="p", frames=9), Served("tiny-wan", WAN, "video"), 2)
    assert video.generate["frames"] == 9 and 0 <= video.generate["seed"] and video.count == 1
    with pytest.raises(BadRequest) as refused:
        to_job(VideoRequest(prompt="p", frames=4), Served("tiny-wan", WAN, "video"), 3)
    assert (refused.value.param, refused.value.message) == (
        "frames",
        "frames: Wan 2.1 / 2.2 makes 4k+1 frames (1, 5, 9, …); use 1 or 5",
    )


def test_the_queue_refuses_beyond_its_bound_and_serves_in_order() -> None:
    release = threading.Event()
    order: list[int] = []

    def replica(job: Job) -> Outcome:
        if not job.stop:
            release.wait(30)
            order.append(job.id)
        return Outcome(True, seeds=[job.id])

    dispatcher = Dispatcher([replica], max_queue=2)
    dispatcher.start()

    async def flood() -> list[object]:
        first = asyncio.ensure_future(dispatcher.submit(Job(0, "image", {})))
        while dispatcher.busy == 0:  # job 0 is on the replica
            await asyncio.sleep(0.01)
        tasks = [first, *(asyncio.ensure_future(dispatcher.submit(Job(i, "image", {}))) for i in range(1, 5))]
        await asyncio.sleep(0.1)  # jobs 1 and 2 wait, 3 and 4 find the queue full
        release.set()
        return list(await asyncio.gather(*tasks, return_exceptions=True))

    results = asyncio.run(flood())
    dispatcher.stop()
    assert [r.seeds if isinstance(r, Outcome) else type(r).__name__ for r in results] == [
        [0],
        [1],
        [2],
        "QueueFull",
        "QueueFull",
    ]
    assert order == [0, 1, 2] and dispatcher.waiting == 0 and dispatcher.busy == 0
    assert str(QueueFull(2)) == "the queue is full (2 requests waiting); retry later"


def test_requests_arriving_together_at_an_idle_server_all_find_their_places() -> None:
    """One idle replica and a queue of 2 take 3 requests that arrive at once, whether or not the
    replica's thread drew the first before the others came (the switch interval keeps it from
    drawing during the burst), and refuse the fourth."""
    release = threading.Event()

    def replica(job: Job) -> Outcome:
        if not job.stop:
            release.wait(30)
        return Outcome(True, seeds=[job.id])

    dispatcher = Dispatcher([replica], max_queue=2)
    dispatcher.start()

    async def burst() -> list[object]:
        futures: list[object] = []
        interval = sys.getswitchinterval()
        sys.setswitchinterval(5.0)
        try:
            for i in range(4):
                try:
                    futures.append(dispatcher.enqueue(Job(i, "image", {})))
                except QueueFull as full:
                    futures.append(str(full))
        finally:
            sys.setswitchinterval(interval)
        release.set()
        return [await f if isinstance(f, asyncio.Future) else f for f in futures]

    results = asyncio.run(burst())
    dispatcher.stop()
    assert [r.seeds if isinstance(r, Outcome) else r for r in results] == [
        [0],
        [1],
        [2],
        "the queue is full (2 requests waiting); retry later",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replicas", "0"], "--replicas must be >= 1, got 0"),
        (
            ["--gpus", "3", "--replicas", "2"],
            "--gpus 3: it must be a multiple of --replicas (2), each replica gets --gpus / --replicas",
        ),
        (["--port", "0"], "--port must be between 1 and 65535, got 0"),
        (["--max-queue", "-1"], "--max-queue must be >= 0, got -1"),
    ],
)
def test_serve_refusals_are_one_line(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["serve", "tiny-flux", *args], catch_exceptions=False)
    assert result.exit_code == 2 and result.stderr.strip() == f"error: {message}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--gpus", "2", "--replicas", "2"],
            '[memory] offload = "group" serves one replica: each of the 2 replicas would stream its own '
            'whole copy from host memory; set offload = "none" with --replicas, or serve one replica',
        ),
        (
            ["--gpus", "2"],
            '[memory] offload = "group" runs one process: each rank would stream its own whole copy; '
            'set offload = "none" with a parallel layout, or run one process',
        ),
    ],
)
def test_serve_refuses_offload_on_more_than_one_process_before_any_rank_starts(
    tmp_path: Path, args: list[str], message: str
) -> None:
    recipe = tmp_path / "offload.toml"
    recipe.write_text('[model]\nname = "tiny-flux"\n\n[memory]\noffload = "group"\n')
    result = CliRunner().invoke(app, ["serve", "--recipe", str(recipe), *args], catch_exceptions=False)
    assert result.exit_code == 2 and " ".join(result.stderr.split()) == f"error: {message}"


def test_a_failure_on_one_rank_is_the_replica_s_500_and_the_next_request_runs() -> None:
    done = commands.run(
        [sys.executable, "-m", "accel.cli", "launch", "--gpus", "2", "tests/serve_fault.py"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "job 1: ok=False files=0 error=rank 1: RuntimeError: CUDA out of memory (injected on rank 1)",
        "job 2: ok=True files=1 error=None",
    ]
