"""Batching (`accel serve / accel batch --max-batch N`): waiting requests that differ only in prompt
and seed run as one pipeline call. Each family's batched outputs equal its unbatched ones at the same
seeds (sound included); the dispatcher groups what may share a call, oldest first, up to N outputs;
a replica's batch that fails is run again job by job so only the failing request fails, and a
request cancelled while its batch-mates run ends cancelled; on two ranks (Ulysses, CFG halves) a
batch equals one process's unbatched runs; the flag's refusals come before any rank starts."""

from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

import parallel_cases as cases
from families import FAMILY_CASES
from accel.cli import app
from accel.generate import generate_batch, generate_with_audio
from accel.models.call import generation_kwargs
from accel.models.registry import FAMILIES
from accel.recipe import Recipe
from accel.serve.batching import Batch, batch_key, batch_refusal
from accel.serve.cancel import LocalBoard
from accel.serve.dispatch import Dispatcher
from accel.serve.replica import Outcome, Replica
from accel.serve.requests import Job

# Prompts of different token counts: a pipeline that pads them to the longest must mask the padding.
PROMPTS = ["a red fox", "a blue whale in a deep green sea at night, seen from far below", "x"]
SEEDS = [3, 11, 40]
TOLERANCE = 1e-4  # of the [0, 1] output range: the batched arithmetic's rounding, not another picture


def _kwargs(name: str, pipe: Any) -> dict[str, Any]:
    """The tiny call, with a negative prompt where the pipeline takes one (its CFG branch, batched too)."""
    import inspect

    recipe = Recipe().with_overrides({"model": {"name": f"tiny-{name}"}}, source="test")
    kwargs = generation_kwargs(FAMILIES[name], True, recipe, pipe)
    if "negative_prompt" in inspect.signature(type(pipe).__call__).parameters:
        kwargs.setdefault("negative_prompt", "blurry, dark")
    return kwargs


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_batch_of_prompts_equals_each_prompt_run_alone(name: str) -> None:
    family = FAMILIES[name]
    pipe = cases.tiny_pipeline(f"tiny-{name}")
    if not family.batches:
        assert batch_refusal(pipe, {}) == f"{family.title}'s pipeline does not give a batched prompt its own output"
        return
    kwargs = _kwargs(name, pipe)
    if family.result is not None and not family.result.batched:
        assert batch_refusal(pipe, kwargs) == f"{family.title}'s result holds one sample"
        return
    assert batch_refusal(pipe, kwargs) is None
    alone = [generate_with_audio(pipe, dict(kwargs, prompt=prompt), seed) for prompt, seed in zip(PROMPTS, SEEDS)]
    batched = generate_batch(pipe, kwargs, PROMPTS, SEEDS)
    assert len(batched) == len(PROMPTS)
    for (output, audio), (together, together_audio) in zip(alone, batched):
        assert output.shape == together.shape
        assert np.abs(output.astype(np.float64) - together).max() <= TOLERANCE
        assert (audio is None) == (together_audio is None) == (family.audio is None)
        if audio is not None:
            assert audio.rate == together_audio.rate
            assert np.abs(audio.samples - together_audio.samples).max() <= TOLERANCE
    # Not one picture three times: the seeds and prompts still make different outputs.
    assert np.abs(batched[0][0] - batched[1][0]).max() > 0.01


def test_a_pipeline_that_takes_the_recipes_picture_runs_each_request_alone() -> None:
    pipe = cases.tiny_pipeline("tiny-flux")
    from accel.models.input_files import InputImage

    refusal = batch_refusal(pipe, {"prompt": "p", "image": InputImage("x.png")})
    assert refusal == "its call takes the recipe's input files"


def _job(job_id: int, width: int = 64, count: int = 1, **extra: Any) -> Job:
    return Job(job_id, "image", {"prompt": f"p{job_id}", "seed": 10 * job_id, "width": width, **extra}, count)


def test_the_dispatcher_batches_waiting_jobs_that_share_a_call_oldest_first() -> None:
    calls: list[Any] = []
    busy: list[int] = []  # the replicas busy, as /metrics reports them, during each call

    def run(work: Any) -> Any:
        calls.append(work)
        if work.stop:
            return Outcome(True)
        busy.append(dispatcher.busy)
        jobs = work.jobs if isinstance(work, Batch) else (work,)
        outcomes = [Outcome(True, seeds=[job.generate["seed"]]) for job in jobs]
        return outcomes if isinstance(work, Batch) else outcomes[0]

    jobs = [
        _job(1),
        _job(2),
        _job(3, width=32),  # another size: another call
        _job(4, count=2),
        _job(5),  # past the 4 outputs of the first call: the next one
        _job(6, image="in.png"),  # an input picture: alone
        _job(7),
    ]
    assert batch_key(jobs[5]) is None and batch_key(jobs[0]) == batch_key(jobs[1]) != batch_key(jobs[2])

    dispatcher = Dispatcher([run], max_queue=10, max_batch=4)

    async def main() -> list[Outcome]:
        futures = [dispatcher.enqueue(job) for job in jobs]  # all waiting before the replica draws
        dispatcher.start()
        outcomes = list(await asyncio.gather(*futures))
        assert dispatcher.waiting == dispatcher.busy == 0 and dispatcher.idle()
        dispatcher.stop()
        return outcomes

    outcomes = asyncio.run(main())
    assert [o.seeds for o in outcomes] == [[10 * job.id] for job in jobs]  # each request got its own answer
    drawn = [[job.id for job in call.jobs] if isinstance(call, Batch) else call.id for call in calls[:-1]]
    assert drawn == [[1, 2, 4], 3, [5, 7], 6]
    assert busy == [1, 1, 1, 1]  # one replica, whatever its call holds
    assert calls[-1].stop


def test_max_batch_one_runs_every_job_alone() -> None:
    drawn: list[Any] = []

    def run(job: Any) -> Outcome:
        drawn.append(job)
        return Outcome(True)

    async def main() -> None:
        dispatcher = Dispatcher([run], max_queue=10)
        futures = [dispatcher.enqueue(_job(i)) for i in (1, 2, 3)]
        dispatcher.start()
        await asyncio.gather(*futures)
        dispatcher.stop()

    asyncio.run(main())
    assert [job.id for job in drawn[:3]] == [1, 2, 3] and not any(isinstance(job, Batch) for job in drawn)


@pytest.fixture(scope="module")
def flux_replica() -> Any:
    import accel

    pipe = cases.tiny_pipeline("tiny-flux")
    recipe = Recipe().with_overrides({"model": {"name": "tiny-flux"}}, source="test")
    handle = accel.apply(pipe, recipe)
    board = LocalBoard()
    replica = Replica(pipe, handle, recipe, True, "image", None, 0, board)
    yield replica, board
    replica.close()
    handle.remove()


def _pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)), dtype=np.int16)


def _flux_job(job_id: int, prompt: str, seed: int, count: int = 1) -> Job:
    return Job(job_id, "image", {"prompt": prompt, "seed": seed, "steps": 2}, count)


def test_a_batch_on_a_replica_answers_each_request_as_its_own_run(flux_replica: Any) -> None:
    replica, _ = flux_replica
    jobs = (_flux_job(11, PROMPTS[0], 5, count=2), _flux_job(12, PROMPTS[1], 9))
    outcomes = replica.lead(Batch(jobs))
    assert [o.ok for o in outcomes] == [True, True]
    assert [o.seeds for o in outcomes] == [[5, 6], [9]]
    for job, outcome in zip(jobs, outcomes):
        alone = replica.lead(job)
        assert len(outcome.files) == job.count
        for mine, own in zip(outcome.files, alone.files):
            assert np.abs(_pixels(mine) - _pixels(own)).max() <= 1


def test_a_failure_in_a_batch_fails_only_the_request_that_fails_alone(flux_replica: Any) -> None:
    replica, _ = flux_replica
    pipe = replica.pipe
    encode = pipe.encode_prompt

    def refuse_boom(*args: Any, **kwargs: Any) -> Any:  # this instance only: a request the pipeline rejects
        prompt = kwargs.get("prompt", args[0] if args else None)
        if "boom" in ([prompt] if isinstance(prompt, str) else list(prompt)):
            raise ValueError("the prompt boom is refused")
        return encode(*args, **kwargs)

    pipe.encode_prompt = refuse_boom
    try:
        jobs = (_flux_job(21, PROMPTS[0], 5), _flux_job(22, "boom", 6), _flux_job(23, PROMPTS[2], 7))
        outcomes = replica.lead(Batch(jobs))
    finally:
        del pipe.encode_prompt
    assert [o.ok for o in outcomes] == [True, False, True]
    assert outcomes[1].error == "ValueError: the prompt boom is refused"
    alone = replica.lead(jobs[2])
    assert np.abs(_pixels(outcomes[2].files[0]) - _pixels(alone.files[0])).max() <= 1


def test_a_request_cancelled_in_a_batch_ends_cancelled_and_the_others_finish(flux_replica: Any) -> None:
    replica, board = flux_replica
    jobs = (_flux_job(31, PROMPTS[0], 5), _flux_job(32, PROMPTS[1], 6))
    board.cancel(32, "client_gone")
    try:
        first, second = replica.lead(Batch(jobs))
        assert first.ok and len(first.files) == 1
        assert not second.ok and second.cancelled == "client_gone" and not second.files
        board.cancel(31, "shutdown")  # every job marked: the call itself stops, at its first step
        stopped = replica.lead(Batch(jobs))
        assert [o.cancelled for o in stopped] == ["shutdown", "shutdown"]
        assert all(o.error.startswith("stopped at step 0 ") for o in stopped)
    finally:
        board.forget(31)
        board.forget(32)


@pytest.mark.parametrize("parallel", [{"ulysses": 2}, {"cfg": 2}], ids=["ulysses2", "cfg2"])
def test_a_batch_on_two_ranks_equals_one_process_unbatched(rank_pools: Any, parallel: dict[str, int]) -> None:
    call = dict(FAMILY_CASES["wan"].call, num_inference_steps=2)
    expected = [cases.tiny_output("tiny-wan", {}, dict(call, prompt=p), seed) for p, seed in zip(PROMPTS, SEEDS)]
    runs = rank_pools(2).run(cases.batched_outputs, "tiny-wan", {"parallel": parallel}, call, PROMPTS, SEEDS)
    for outputs in runs:  # every rank gathers the whole output
        for output, reference in zip(outputs, expected):
            assert np.abs(output.astype(np.float64) - reference[0]).max() <= TOLERANCE


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
        (
            ["--max-batch", "4", "--cache", "0.1"],
            "--max-batch 4: the step cache ([cache] method fbcache) decides per call, so the requests of a batch "
            "would share its skips and differ from their own runs; use --max-batch 1 or turn the cache off "
            "(--cache 0)",
        ),
    ],
)
def test_serve_and_batch_refuse_a_bad_max_batch_in_one_line(flags: list[str], message: str, tmp_path: Any) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt": "x"}\n')
    for command in (["serve", "tiny-flux"], ["batch", str(requests), "tiny-flux", "--out", str(tmp_path / "o")]):
        result = CliRunner().invoke(app, [*command, *flags], env={"COLUMNS": "400"})
        assert result.exit_code == 2 and result.output.strip().splitlines()[-1] == f"error: {message}"


@pytest.mark.parametrize(
    "name, expected, refusal",
    [
        ("flux", 4, None),
        ("kandinsky5", 1, "Kandinsky 5.0 Video's pipeline does not give a batched prompt its own output"),
    ],
)
def test_the_server_batches_what_its_pipeline_can(name: str, expected: int, refusal: str | None) -> None:
    from accel.models.variants import variant_of_class
    from accel.serve.limits import Limits
    from accel.serve.server import _served

    pipe = cases.tiny_pipeline(f"tiny-{name}")
    family = FAMILIES[name]
    recipe = Recipe().with_overrides({"model": {"name": f"tiny-{name}"}}, source="test")
    served = _served(recipe, pipe, family, variant_of_class(family, type(pipe)), family.output, True, Limits(), {}, 4)
    assert (served.max_batch, served.batch_refusal) == (expected, refusal)


def test_concurrent_openai_clients_get_their_own_pictures_from_batched_calls() -> None:
    """The real server with --max-batch 4 on a replica of two Ulysses ranks (the batch goes to both):
    a long request holds the replica while four clients ask for other prompts and seeds at the same
    size; those wait, run as batched calls, and each gets the picture the server makes for it alone
    (asked one at a time first)."""
    import httpx
    import openai

    from test_serve import start

    server = start("tiny-flux", "--gpus", "2", "--max-batch", "4", "--max-queue", "8", "--steps", "2")
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
    asked = [(PROMPTS[index % 3], 100 + index) for index in range(4)]

    async def one(prompt: str, seed: int, steps: int = 2) -> bytes:
        result = await client.images.generate(
            prompt=prompt, response_format="b64_json", extra_body={"seed": seed, "steps": steps}
        )
        return base64.b64decode(result.data[0].b64_json)

    async def both() -> tuple[list[bytes], list[bytes]]:
        alone = [await one(prompt, seed) for prompt, seed in asked]
        blocker = asyncio.create_task(one("a long one", 1, steps=24))
        await asyncio.sleep(0.5)  # the blocker is on the replica; the four below wait behind it
        answers = await asyncio.gather(*(one(prompt, seed) for prompt, seed in asked))
        await blocker
        return alone, list(answers)

    try:
        alone, batched = asyncio.run(both())
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    finally:
        server.stop()
    for mine, own in zip(batched, alone):
        assert np.abs(_pixels(mine) - _pixels(own)).max() <= 1
    assert len({bytes(_pixels(picture)) for picture in alone}) == 4
    observed = {
        line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("accel_batch_")
    }
    # Nine requests: five alone (the four asked first and the blocker), then calls of more than one.
    assert observed["accel_batch_requests_count"] == 9
    assert observed['accel_batch_requests_bucket{le="1.0"}'] == 5
    assert observed["accel_batch_requests_sum"] > 9


def test_accel_batch_with_max_batch_makes_what_it_makes_item_by_item(tmp_path: Any) -> None:
    """Five lines at one size on one process: with --max-batch 4 they share calls from the first one
    on (the manifest says how many items each call made) and every picture is the one --max-batch 1
    makes."""
    import json

    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"prompt": PROMPTS[i % 3], "seed": 20 + i}) + "\n" for i in range(5)))
    records: dict[int, dict[str, dict[str, Any]]] = {}
    for most in (1, 4):
        out = tmp_path / f"out-{most}"
        command = ["batch", str(requests), "tiny-flux", "--out", str(out), "--steps", "2", "--max-batch", str(most)]
        result = CliRunner().invoke(app, command, env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        lines = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
        records[most] = {record["key"]: record for record in lines}
        assert sorted(records[most]) == [f"00000{i}" for i in range(1, 6)]
        assert all(record["status"] == "done" for record in lines)
    assert {record["batch"] for record in records[1].values()} == {1}
    # The five are queued before the replica draws: the first call takes four, the last runs alone.
    assert sorted(record["batch"] for record in records[4].values()) == [1, 4, 4, 4, 4]
    for key, record in records[4].items():
        assert record["seeds"] == records[1][key]["seeds"]
        mine = (tmp_path / "out-4" / record["files"][0]).read_bytes()
        own = (tmp_path / "out-1" / record["files"][0]).read_bytes()
        assert np.abs(_pixels(mine) - _pixels(own)).max() <= 1
