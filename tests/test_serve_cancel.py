"""Fairness, cancellation and shutdown of `accel serve`: a request past --request-timeout stops at
a step (504) on every rank together and the replica serves the next one unchanged; a client that
goes away frees its place in the queue or its replica; SIGTERM with a queue answers every client
(503 for what the drain did not finish) and exits 0 without a traceback, on one and on two ranks.

Long requests are 1000 steps at 256² on tiny FLUX (a minute or more on a CPU): they only ever end
by being stopped. The time limit (20 s) is far longer than anything a test does before it, so which
of the two stops a request never depends on the machine's speed; no timing decides an assertion."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
from collections.abc import Iterator

import httpx
import pytest
from test_serve import PROMPT, Server, metric, start, wait_for

from accel.models.registry import FAMILIES
from accel.serve.cancel import LocalBoard
from accel.serve.dispatch import Dispatcher, ShuttingDown
from accel.serve.front import Metrics, build_app
from accel.serve.limits import Limits
from accel.serve.replica import Outcome
from accel.serve.requests import Job, Served

LONG = {"prompt": PROMPT, "size": "256x256", "steps": 1000, "seed": 5}
SHORT = {"prompt": PROMPT, "size": "64x64", "steps": 2, "seed": 7}
# The time limit of the servers that stop requests. It also bounds the window in which a SIGTERM test
# sees one request running and three waiting (the running one is stopped at the limit), so it is long
# enough for a machine with a load of 4 to submit them and look (8 s was not, on a busy 2-core machine).
LIMIT_S = "20"
STOPPED = re.compile(
    rf"the request ran past this server's limit of {LIMIT_S} s \(accel serve --request-timeout\) and was stopped "
    r"at step \d+ after \d+\.\d s; ask for less work"
)
SHUTTING = {
    "message": "the server is shutting down and takes no new requests; retry on another server",
    "type": "server_error",
    "param": None,
    "code": None,
}


def post(server: Server, body: dict[str, object], timeout: float = 300) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=timeout)


def sigterm_with_a_queue(server: Server) -> None:
    """One request running, three waiting, SIGTERM: the drain (1 s) cannot finish them, so every
    client gets the shutdown's 503; a request during the drain too; exit 0, no traceback."""
    answers: dict[int, httpx.Response] = {}
    clients = [
        threading.Thread(target=lambda i=i: answers.__setitem__(i, post(server, dict(LONG, seed=i)))) for i in range(4)
    ]
    for client in clients:
        client.start()
    wait_for(lambda: metric(server, "accel_queue_depth") == 3 and metric(server, "accel_replicas_busy") == 1)
    server.process.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(f"{server.url}/health", timeout=5).status_code == 503, 30)
    assert httpx.get(f"{server.url}/health", timeout=5).json() == {"status": "draining", "model": "tiny-flux"}
    late = post(server, SHORT, timeout=30)
    assert (late.status_code, late.json()) == (503, {"error": SHUTTING})
    out, err = server.process.communicate(timeout=120)
    for client in clients:
        client.join(30)
    assert server.process.returncode == 0, err
    assert sorted(answers) == [0, 1, 2, 3]
    assert all((r.status_code, r.json()) == (503, {"error": SHUTTING}) for r in answers.values()), [
        r.text for r in answers.values()
    ]
    assert "Traceback" not in err and "Event loop is closed" not in err, err
    assert out.splitlines()[-2:] == [
        "stopping: the requests accepted have 1 s to finish (a second Ctrl-C cancels them)",
        "stopped",
    ]
    assert server.left_behind() == [], "no process left behind"


# --- one process ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def limited() -> Iterator[Server]:
    server = start(
        "tiny-flux", "--request-timeout", LIMIT_S, "--drain", "1", "--max-work", "1000000", "--max-queue", "3"
    )
    yield server
    if server.process.poll() is None:
        server.stop()


def test_a_request_past_the_time_limit_is_504_and_the_replica_serves_the_next_unchanged(limited: Server) -> None:
    before = post(limited, SHORT)
    stopped = post(limited, LONG)
    assert stopped.status_code == 504 and STOPPED.fullmatch(stopped.json()["error"]["message"]), stopped.text
    after = post(limited, SHORT)
    assert before.status_code == after.status_code == 200
    assert after.json()["data"] == before.json()["data"], "the stopped request left nothing behind"
    assert metric(limited, 'accel_cancelled_total{reason="time_limit"}') == 1


def test_a_client_that_goes_away_frees_its_place_in_the_queue_and_its_replica(limited: Server) -> None:
    holder: list[httpx.Response] = []
    holding = threading.Thread(target=lambda: holder.append(post(limited, LONG)))  # stopped by the time limit
    holding.start()
    wait_for(lambda: metric(limited, "accel_replicas_busy") == 1)
    with pytest.raises(httpx.ReadTimeout):
        post(limited, SHORT, timeout=1.0)  # waits behind it, then its client gives up
    wait_for(lambda: metric(limited, "accel_queue_depth") == 0, 10)  # dropped while the long one still runs
    assert metric(limited, "accel_replicas_busy") == 1
    holding.join(120)
    assert holder[0].status_code == 504
    limited_before = metric(limited, 'accel_cancelled_total{reason="time_limit"}')
    with pytest.raises(httpx.ReadTimeout):
        post(limited, LONG, timeout=1.5)  # running, then its client gives up: stopped at its next step
    assert post(limited, SHORT).status_code == 200
    assert metric(limited, 'accel_cancelled_total{reason="client_gone"}') == 2
    assert metric(limited, 'accel_cancelled_total{reason="time_limit"}') == limited_before, (
        "stopped for its client, not its limit"
    )
    assert metric(limited, 'accel_requests_total{endpoint="/v1/images/generations",status="499"}') == 2


def test_sigterm_with_a_queue_answers_every_client_503_and_exits_0(limited: Server) -> None:
    sigterm_with_a_queue(limited)


# --- two processes ---------------------------------------------------------------------------------
def test_two_ranks_stop_at_the_same_step_and_drain_a_queue_on_sigterm() -> None:
    server = start(
        "tiny-flux",
        "--gpus",
        "2",
        "--request-timeout",
        LIMIT_S,
        "--drain",
        "1",
        "--max-work",
        "1000000",
        "--max-queue",
        "3",
    )
    try:
        before = post(server, SHORT)
        stopped = post(server, LONG)
        assert stopped.status_code == 504 and STOPPED.fullmatch(stopped.json()["error"]["message"]), stopped.text
        after = post(server, SHORT)  # both ranks left the call at the same step: no collective is left waiting
        assert before.status_code == after.status_code == 200 and after.json()["data"] == before.json()["data"]
        sigterm_with_a_queue(server)
    finally:
        if server.process.poll() is None:
            server.process.kill()


# --- the front's parts, without a pipeline ---------------------------------------------------------
def test_a_waiting_job_cancelled_is_answered_at_once_and_never_runs() -> None:
    release = threading.Event()
    ran: list[int] = []
    board = LocalBoard()

    def replica(job: Job) -> Outcome:
        if not job.stop:
            ran.append(job.id)
            release.wait(30)
            ran.append(-job.id if board.reason(job.id) else job.id)
        return Outcome(True)

    dispatcher = Dispatcher([replica], max_queue=2, board=board)
    dispatcher.start()

    async def scenario() -> list[Outcome]:
        running = asyncio.ensure_future(dispatcher.submit(Job(1, "image", {})))
        while dispatcher.busy == 0:
            await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(dispatcher.submit(Job(2, "image", {})))
        await asyncio.sleep(0.05)
        dispatcher.cancel(2, "client_gone")
        dropped = await asyncio.wait_for(waiting, 5)  # answered while job 1 still runs
        assert dispatcher.waiting == 0 and dispatcher.busy == 1
        dispatcher.cancel(1, "client_gone")  # running: marked for its next step
        release.set()
        return [dropped, await running]

    dropped, finished = asyncio.run(scenario())
    dispatcher.stop()
    assert (dropped.ok, dropped.cancelled, dropped.error) == (
        False,
        "client_gone",
        "cancelled while waiting: client gone",
    )
    assert finished.ok and ran == [1, -1], "job 2 never ran; job 1 saw its mark"
    assert board.reason(1) is None, "the board forgets a finished job"
    dispatcher.close()

    async def refused() -> None:
        await dispatcher.submit(Job(3, "image", {}))

    with pytest.raises(ShuttingDown):
        asyncio.run(refused())


def test_health_reports_a_replica_still_on_a_request_past_the_time_limit() -> None:
    release = threading.Event()

    def stuck(job: Job) -> Outcome:  # a step that never ends: no cancellation reaches it
        if not job.stop:
            release.wait(30)
        return Outcome(True)

    async def scenario(replicas: list[object]) -> tuple[int, dict[str, object]]:
        dispatcher = Dispatcher(replicas, max_queue=2)  # type: ignore[arg-type]
        dispatcher.start()
        served = Served("tiny-flux", FAMILIES["flux"], "image", limits=Limits(request_timeout_s=0.2))
        app = build_app(served, dispatcher, Metrics(dispatcher), 1)
        job = asyncio.ensure_future(dispatcher.submit(Job(1, "image", {})))
        while dispatcher.busy == 0:  # on a replica now
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # past the 0.2 s limit
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost") as client:
            health = await client.get("/health")
        release.set()
        await job
        dispatcher.stop()
        return health.status_code, health.json()

    code, report = asyncio.run(scenario([stuck]))
    late = report.pop("late")
    assert (code, report) == (503, {"status": "busy", "model": "tiny-flux", "replicas": 1, "processes": 1})
    assert [(entry["replica"], entry["request"], entry["limit"]) for entry in late] == [(0, 1, 0.2)]  # type: ignore[index]
    assert late[0]["seconds"] >= 0.2  # type: ignore[index]
    release.clear()
    code, report = asyncio.run(scenario([stuck, stuck]))  # one job: the other replica is free and still serves
    assert (code, report["status"]) == (200, "degraded")
