"""`accel serve`'s limits and door, in process (FastAPI's TestClient over the real app and queue,
a replica that records what reaches it): every refusal comes before any work, in OpenAI's error
shape, with its exact status and message, and the server answers the next request."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from accel.cli import app
from accel.cli.serve import _api_keys
from accel.errors import UserError
from accel.models.registry import FAMILIES
from accel.serve.dispatch import Dispatcher
from accel.serve.front import Metrics, build_app, retry_after
from accel.serve.limits import MAX_PROMPT_TOKENS, Limits, TokenCounter, positional_limits, token_counters
from accel.serve.replica import Outcome
from accel.serve.requests import BadRequest, ImageRequest, Job, Served, VideoRequest, to_job
from accel.serve.security import Door, Guard, beyond_loopback, exposure_warning, host_name

WAN_DEFAULTS = {"width": 64, "height": 64, "frames": 9, "steps": 4}  # tiny-wan's own call
WAN_POSITIONS = positional_limits(
    SimpleNamespace(
        transformer=SimpleNamespace(config=SimpleNamespace(rope_max_seq_len=1024, patch_size=(1, 2, 2))),
        vae_scale_factor_spatial=8,
        vae_scale_factor_temporal=4,
    )
)
KEY = "sk-test-0123456789"


@dataclass
class Replica:
    """Answers every job with one file, keeping the jobs it ran; `error`: fails them instead."""

    error: str | None = None
    jobs: list[Job] = field(default_factory=list)

    def __call__(self, job: Job) -> Outcome:
        if job.stop:
            return Outcome(True)
        self.jobs.append(job)
        if self.error:
            return Outcome(False, error=self.error)
        return Outcome(
            True, [b"video"], [int(job.generate["seed"])], seconds=0.5, steps=int(job.generate.get("steps") or 0)
        )


@dataclass
class Front:
    client: TestClient
    replica: Replica

    def video(self, body: dict[str, Any] | None = None, **headers: str) -> Any:
        return self.client.post("/v1/videos/generations", json={"prompt": "a fox", **(body or {})}, headers=headers)

    def raw(self, content: bytes, **headers: str) -> Any:
        return self.client.post(
            "/v1/videos/generations", content=content, headers={"content-type": "application/json", **headers}
        )


def front(
    limits: Limits = Limits(),
    door: Door | None = None,
    replica: Replica | None = None,
    max_queue: int = 2,
    family: Any = FAMILIES["wan"],
    tokenizers: tuple[TokenCounter, ...] = (),
) -> Iterator[Front]:
    replica = replica or Replica()
    dispatcher = Dispatcher([replica], max_queue)
    metrics = Metrics(dispatcher)
    dispatcher.on_outcome = metrics.record
    served = Served("tiny-wan", family, "video", dict(WAN_DEFAULTS), limits, WAN_POSITIONS, tokenizers)
    dispatcher.start()
    try:
        with TestClient(
            build_app(served, dispatcher, metrics, 1, door),
            base_url="http://127.0.0.1:8000",
            raise_server_exceptions=False,
        ) as client:
            yield Front(client, replica)
    finally:
        dispatcher.stop(5)


@pytest.fixture
def wan() -> Iterator[Front]:
    yield from front()


def error(
    message: str, param: str | None = None, kind: str = "invalid_request_error", code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def served_next(wan: Front) -> None:
    """The server goes on: a normal request is answered, and it is the only one that reached a replica."""
    before = len(wan.replica.jobs)
    assert wan.video().status_code == 200
    assert len(wan.replica.jobs) == before + 1


def test_a_10_mb_body_is_413_and_a_10_mb_prompt_under_a_raised_body_limit_is_400(wan: Front) -> None:
    huge = "x" * 10_000_000
    response = wan.video({"prompt": huge})
    assert response.status_code == 413
    assert response.json() == error(
        "the request body is larger than this server's limit of 1048576 bytes (accel serve --max-body)",
        code="request_too_large",
    )
    served_next(wan)
    assert len(wan.replica.jobs) == 1
    for other in front(Limits(max_body=30_000_000)):
        for key in ("prompt", "negative_prompt"):
            refused = other.video({key: huge})
            assert refused.status_code == 400
            assert refused.json() == error(
                f"{key}: 10000000 characters, more than this server's limit of 10000 "
                "(accel serve --max-prompt); shorten it",
                key,
            )
        assert other.video({"prompt": "y" * 10_000}).status_code == 200
        assert [job.generate["prompt"] for job in other.replica.jobs] == ["y" * 10_000]


def flux_served(pipe: Any, limits: Limits) -> Served:
    return Served(
        "tiny-flux",
        FAMILIES["flux"],
        "image",
        {"width": 64, "height": 64, "steps": 2},
        limits,
        {},
        token_counters(pipe),
    )


def refusal(served: Served, **body: Any) -> tuple[str | None, str]:
    with pytest.raises(BadRequest) as refused:
        to_job(ImageRequest(**body), served, 1)
    return refused.value.param, refused.value.message


def test_the_served_pipeline_s_fast_tokenizers_count_a_prompt_s_tokens(tiny_flux: Any) -> None:
    """tiny-flux's CLIP and T5 tokenizers are fast, with a token a letter (a space joins the letter
    next to it): "a fox" is 4 tokens in each, special tokens not counted; an emoji is 4 of CLIP's
    byte tokens and 2 of T5's (its leading space, then the emoji)."""
    counters = token_counters(tiny_flux)
    assert [counter.name for counter in counters] == ["tokenizer", "tokenizer_2"]
    assert [counter.count("a fox") for counter in counters] == [4, 4]
    assert [counter.count("\N{FOX FACE}") for counter in counters] == [4, 2]
    assert (
        token_counters(SimpleNamespace(components={"tokenizer": SimpleNamespace(is_fast=False), "vae": object()})) == ()
    )


@pytest.mark.parametrize("key", ["prompt", "negative_prompt"])
def test_a_prompt_past_the_token_limit_is_refused_naming_the_field_count_limit_and_option(
    tiny_flux: Any, key: str
) -> None:
    served = flux_served(tiny_flux, Limits(max_prompt_tokens=10))
    body = {"prompt": "a fox", key: "a fox in the snow"}  # 13 tokens
    assert refusal(served, **body) == (
        key,
        f"{key}: 13 tokens, more than this server's limit of 10 (accel serve --max-prompt-tokens); shorten it",
    )
    job = to_job(ImageRequest(prompt="a fox in the", negative_prompt="blurry sky"), served, 2)  # 9 and 9 tokens
    assert (job.generate["prompt"], job.generate["negative_prompt"]) == ("a fox in the", "blurry sky")


def test_the_token_refusal_is_400_in_the_openai_shape_and_the_server_goes_on(tiny_flux: Any) -> None:
    for other in front(Limits(max_prompt_tokens=10), tokenizers=token_counters(tiny_flux)):
        refused = other.video({"negative_prompt": "a fox in the snow"})
        assert refused.status_code == 400
        assert refused.json() == error(
            "negative_prompt: 13 tokens, more than this server's limit of 10 "
            "(accel serve --max-prompt-tokens); shorten it",
            "negative_prompt",
        )
        served_next(other)
        assert [job.generate["prompt"] for job in other.replica.jobs] == ["a fox"]


def test_the_count_is_the_largest_of_the_tokenizers(tiny_flux: Any) -> None:
    """Three emoji: 12 byte tokens in CLIP, 2 in T5; the refusal names the larger count."""
    served = flux_served(tiny_flux, Limits(max_prompt_tokens=11))
    assert refusal(served, prompt="\N{FOX FACE}" * 3) == (
        "prompt",
        "prompt: 12 tokens, more than this server's limit of 11 (accel serve --max-prompt-tokens); shorten it",
    )


def test_the_character_limit_is_checked_before_any_tokenizer_sees_the_text(tiny_flux: Any) -> None:
    seen: list[int] = []

    class Spy(TokenCounter):
        def __init__(self) -> None:
            self.name = "spy"

        def count(self, text: str) -> int:
            seen.append(len(text))
            return 0

    served = Served("tiny-flux", FAMILIES["flux"], "image", {}, Limits(max_prompt=20), {}, (Spy(),))
    assert refusal(served, prompt="a fox", negative_prompt="x" * 21) == (
        "negative_prompt",
        "negative_prompt: 21 characters, more than this server's limit of 20 (accel serve --max-prompt); shorten it",
    )
    assert seen == [5]  # the prompt was counted, never the over-long negative prompt


def test_the_default_token_limit_takes_every_ascii_prompt_the_character_cap_takes(tiny_flux: Any) -> None:
    """A prompt of one letter repeated is one token a character in tiny-flux's tokenizers, ASCII's
    worst: the longest under the default --max-prompt passes, and the default token limit is the
    20,000 characters every run takes."""
    assert MAX_PROMPT_TOKENS == 20_000 == Limits().max_prompt_tokens
    served = flux_served(tiny_flux, Limits())
    text = "x" * Limits().max_prompt
    assert [counter.count(text) for counter in served.tokenizers] == [10_000, 10_000]
    assert to_job(ImageRequest(prompt=text, negative_prompt=text), served, 1).generate["prompt"] == text


def test_a_streamed_body_is_cut_at_the_limit_without_reading_the_rest() -> None:
    """A chunked 500 MB body without Content-Length: the door reads one chunk past the limit, then 413."""
    sent: list[dict[str, Any]] = []
    chunks = {"read": 0}
    reached: list[str] = []

    async def receive() -> dict[str, Any]:
        chunks["read"] += 1
        return {"type": "http.request", "body": b"x" * (1 << 20), "more_body": chunks["read"] < 500}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/videos/generations",
        "server": ("127.0.0.1", 8000),
        "headers": [(b"host", b"127.0.0.1:8000"), (b"transfer-encoding", b"chunked")],
    }
    asyncio.run(Guard(inner, Door(max_body=3 << 20))(scope, receive, send))
    assert chunks["read"] == 4 and reached == []
    assert sent[0]["status"] == 413 and b"larger than this server's limit of 3145728 bytes" in sent[1]["body"]


def test_a_1001_frame_request_is_refused_by_the_default_work_limit_and_served_under_a_raised_one(wan: Front) -> None:
    big = {"frames": 1001, "size": "512x512", "steps": 50}
    response = wan.video(big)
    assert response.status_code == 400
    assert response.json() == error(
        "size × frames × steps × n: 512x512 × 1001 × 50 × 1 is 13,120 megapixel-steps, more than this "
        "server's limit of 10,000 (accel serve --max-work); ask for a smaller size, fewer frames, "
        "fewer steps or fewer outputs"
    )
    # Unset keys count at the pipeline's defaults: 64² × 9 frames × 4 steps passes, 10001 default-step frames do not.
    assert wan.video({"frames": 10001, "size": "512x512"}).status_code == 400
    served_next(wan)
    for raised in front(Limits(max_work=20_000)):
        assert raised.video(big).status_code == 200
        assert raised.replica.jobs[0].generate | {"seed": 0} == {
            "prompt": "a fox",
            "width": 512,
            "height": 512,
            "frames": 1001,
            "steps": 50,
            "seed": 0,
        }


def test_sizes_and_frames_past_the_positional_range_are_400_naming_the_field(wan: Front) -> None:
    assert WAN_POSITIONS == {"frames": 4093, "height": 16384, "width": 16384}
    assert positional_limits(SimpleNamespace(transformer=SimpleNamespace(config=SimpleNamespace(patch_size=2)))) == {}
    for raised in front(Limits(max_work=10**9)):
        frames = raised.video({"frames": 4097})
        assert frames.status_code == 400
        assert frames.json() == error("frames: 4097 is past tiny-wan's positional range; at most 4093", "frames")
        size = raised.video({"size": "64x16400"})
        assert size.status_code == 400
        assert size.json() == error("size: height 16400 is past tiny-wan's positional range; at most 16384", "size")
        assert raised.video({"frames": 4093}).status_code == 200
        assert [job.generate["frames"] for job in raised.replica.jobs] == [4093]


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        (
            b'{"prompt": "a", "guidance_scale": Infinity}',
            "guidance_scale: Input should be a finite number",
            "guidance_scale",
        ),
        (
            b'{"prompt": "a", "guidance_scale": NaN}',
            "guidance_scale: Input should be a finite number",
            "guidance_scale",
        ),
        (
            b'{"prompt": "a", "guidance_scale": 1e308}',
            "guidance_scale: Input should be less than or equal to 1000",
            "guidance_scale",
        ),
        (
            b'{"prompt": "a", "size": "' + b"9" * 5000 + b'x64"}',
            "size: at most 6 digits a side, not '" + "9" * 40 + "'…",
            "size",
        ),
        (
            b'{"prompt": "a", "frames": ' + b"9" * 5000 + b"}",
            "the body must be a JSON object in UTF-8 (numbers of at most 4300 digits)",
            None,
        ),
        (b'{"prompt": "\xff\xfe"}', "the body must be a JSON object in UTF-8 (numbers of at most 4300 digits)", None),
        (b"{not json", "the body must be a JSON object", None),
        (b"[1, 2]", "the body must be a JSON object", None),
    ],
)
def test_numbers_that_overflow_and_undecodable_bodies_are_400_in_the_openai_shape(
    wan: Front, body: bytes, message: str, param: str | None
) -> None:
    response = wan.raw(body)
    assert response.status_code == 400
    assert response.json() == error(message, param)
    served_next(wan)
    assert len(wan.replica.jobs) == 1


@dataclass
class Holding(Replica):
    """Holds each job until released, so the next request finds the replica busy."""

    running: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def __call__(self, job: Job) -> Outcome:
        if not job.stop:
            self.running.set()
            self.release.wait(30)
        return super().__call__(job)


def test_a_full_queue_is_429_with_retry_after() -> None:
    """With no queue (`--max-queue 0`) an idle replica still takes a request; the next, while it
    runs, is 429."""
    holding = Holding()
    for full in front(max_queue=0, replica=holding):
        first: list[Any] = []
        taken = threading.Thread(target=lambda: first.append(full.video()))
        taken.start()
        assert holding.running.wait(30)
        response = full.video()
        holding.release.set()
        taken.join(30)
        assert first[0].status_code == 200
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        assert response.json() == error("the queue is full (0 requests waiting); retry later", kind="rate_limit_error")
    busy = SimpleNamespace(waiting=3, busy=1, replicas=[None, None])
    assert retry_after(busy, 2.5) == 5  # type: ignore[arg-type]
    assert retry_after(busy, 0.0) == 1  # type: ignore[arg-type]


def test_a_failure_is_500_with_a_request_id_and_the_reason_only_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="accel.serve")
    for failing in front(replica=Replica(error="rank 1: RuntimeError: secret path /home/op/model")):
        response = failing.video()
        assert response.status_code == 500
        message = response.json()["error"]["message"]
        found = re.fullmatch(
            r"the server failed on this request \(request id (req_[0-9a-f]{16})\); its log has the reason", message
        )
        assert found and "secret" not in response.text
        assert f"{found.group(1)}: rank 1: RuntimeError: secret path /home/op/model" in caplog.messages

    class Broken:
        title = "Broken"

        def size_problem(self, key: str, value: int) -> str | None:
            raise RuntimeError("internal detail")

    for crashing in front(family=Broken()):
        response = crashing.video({"size": "64x64"})
        assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
        assert "internal detail" not in response.text
        request_id = re.search(r"req_[0-9a-f]{16}", response.text)
        assert (
            request_id
            and f"{request_id.group(0)}: POST /v1/videos/generations: RuntimeError: internal detail" in caplog.messages
        )


def test_a_request_without_steps_counts_the_pipeline_s_default_steps(wan: Front) -> None:
    job = to_job(VideoRequest(prompt="p"), Served("tiny-wan", FAMILIES["wan"], "video", dict(WAN_DEFAULTS)), 1)
    assert job.generate["steps"] == 4
    assert wan.video().status_code == 200
    assert "accel_steps_per_second 8.0" in wan.client.get("/metrics").text  # 4 steps in 0.5 s


def test_an_api_key_is_required_on_every_endpoint_but_health_and_the_openai_client_sends_it() -> None:
    from openai import AuthenticationError, OpenAI

    for keyed in front(door=Door(api_keys=("other-key-1", KEY))):
        refusal = error("a valid API key is required: send it as 'Authorization: Bearer KEY'", code="invalid_api_key")
        for headers in (
            {},
            {"authorization": "Bearer wrong"},
            {"authorization": f"Basic {KEY}"},
            {"authorization": KEY},
        ):
            for response in (
                keyed.video(**headers),
                keyed.client.get("/v1/models", headers=headers),
                keyed.client.get("/metrics", headers=headers),
            ):
                assert response.status_code == 401 and response.json() == refusal
        assert keyed.client.get("/health").status_code == 200
        assert keyed.replica.jobs == []
        assert keyed.video(authorization=f"Bearer {KEY}").status_code == 200
        client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY, http_client=keyed.client, max_retries=0)
        assert [model.id for model in client.models.list().data] == ["tiny-wan"]
        wrong = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="wrong", http_client=keyed.client, max_retries=0)
        with pytest.raises(AuthenticationError) as refused:
            wrong.models.list()
        assert refused.value.status_code == 401 and refused.value.body == refusal["error"]


def test_a_foreign_host_header_is_421_and_local_names_are_served() -> None:
    for door in front(door=Door(host="127.0.0.1", trusted_hosts=("gpu-box.internal",))):
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
            response = door.client.get("/health", headers={"host": host})
            assert response.status_code == 421
            name = host_name(host)
            assert response.json() == error(
                f"Host {name!r} is not one this server answers to; add it with accel serve --trusted-host",
                code="untrusted_host",
            )
        for host in ("localhost:8000", "127.0.0.1", "[::1]:8000", "GPU-box.internal:8000"):
            assert door.client.get("/health", headers={"host": host}).status_code == 200, host
    assert Door(host="0.0.0.0").trusts("10.1.2.3", "10.1.2.3")  # the address the client connected to
    assert not Door(host="0.0.0.0").trusts("attacker.example", "10.1.2.3")
    assert Door(trusted_hosts=("*",)).trusts("anything.example", None)
    assert [
        beyond_loopback(host) for host in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "::", "10.0.0.2", "gpu-box")
    ] == [False, False, False, True, True, True, True]
    assert exposure_warning("0.0.0.0", 8000, ()) == (
        "warning: listening on 0.0.0.0 without an API key: anyone who reaches port 8000 "
        "can use this server; pass --api-key or set ACCEL_API_KEY"
    )
    assert exposure_warning("0.0.0.0", 8000, (KEY,)) is None and exposure_warning("127.0.0.1", 8000, ()) is None


def test_api_keys_come_from_the_option_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_API_KEY", "one, two ,")
    assert _api_keys(None) == ("one", "two")
    assert _api_keys(["three"]) == ("three",)
    monkeypatch.delenv("ACCEL_API_KEY")
    assert _api_keys(None) == ()
    with pytest.raises(UserError, match="^--api-key / ACCEL_API_KEY: a key is printable characters without spaces$"):
        _api_keys(["bad\tkey"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-prompt", "0"], "--max-prompt must be >= 1, got 0"),
        (["--max-body", "-5"], "--max-body must be >= 1, got -5"),
        (["--max-work", "0"], "--max-work must be >= 1, got 0"),
        (["--max-prompt-tokens", "0"], "--max-prompt-tokens must be >= 1, got 0"),
        (["--max-prompt-tokens", "-3"], "--max-prompt-tokens must be >= 1, got -3"),
        (["--api-key", "two words"], "--api-key / ACCEL_API_KEY: a key is printable characters without spaces"),
        (
            ["--max-prompt", "20001"],
            "--max-prompt 20001 is above the 20,000 characters every accel run takes; "
            "set ACCEL_MAX_PROMPT_CHARS to raise both",
        ),
    ],
)
def test_serve_limit_options_are_refused_in_one_line(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["serve", "tiny-flux", *args], catch_exceptions=False)
    assert result.exit_code == 2 and result.stderr.strip() == f"error: {message}"
