"""The playground at `/`: its two endpoints against the real app over a replica that holds its job
(what the pipeline takes; a synchronous request's progress by its X-Request-Id), the page open
without a key while the API keeps asking for one, `--no-playground`; and the page itself in a
real headless Chromium against `accel serve tiny-flux` with a LoRA: a prompt typed and submitted
with the LoRA at a scale, the picture appearing, equal to the API's answer at the same seed, a
screenshot kept in outputs/test-artifacts."""

from __future__ import annotations

import base64
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from accel.launch.environment import free_port
from accel.models.registry import FAMILIES
from accel.serve.cancel import LocalBoard
from accel.serve.dispatch import Dispatcher
from accel.serve.front import Metrics, build_app
from accel.serve.replica import Outcome
from accel.serve.requests import Job, Served
from accel.serve.security import Door

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "outputs" / "test-artifacts"
FLUX_DEFAULTS = {"width": 64, "height": 64, "steps": 4}


@contextmanager
def front(served: Served, door: Door | None = None, playground: bool = True) -> Iterator[tuple[str, threading.Event]]:
    """The real app on uvicorn in a thread, over a replica that notes 1 of 4 steps and waits for `go`."""
    board = LocalBoard()
    go = threading.Event()

    def replica(job: Job) -> Outcome:
        if job.stop:
            return Outcome(True)
        board.progress(job.id, 1, 4)
        go.wait(30)
        return Outcome(True, [b"png"], [int(job.generate["seed"])], steps=4)

    dispatcher = Dispatcher([replica], 4, board=board)
    app = build_app(served, dispatcher, Metrics(dispatcher), 1, door, None, playground)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    dispatcher.start()
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", go
    finally:
        go.set()
        server.should_exit = True
        thread.join(10)
        dispatcher.stop(5)


def test_the_page_says_what_the_pipeline_takes_and_a_request_s_progress_by_its_id() -> None:
    from accel.models.variants import variant_of

    flux = FAMILIES["flux"]
    inpaint = Served("tiny-flux", flux, "image", dict(FLUX_DEFAULTS), variant=variant_of(flux, "FluxInpaintPipeline"))
    with front(inpaint) as (url, go):
        config = httpx.get(f"{url}/v1/playground").json()
        assert config == {
            "model": "tiny-flux",
            "output": "image",
            "picture": True,
            "needs_picture": False,
            "mask": True,
            "needs_mask": False,
            "defaults": FLUX_DEFAULTS,
            "max_images": 4,
            "loras": [],
        }
        answer: list[httpx.Response] = []
        asking = threading.Thread(
            target=lambda: answer.append(
                httpx.post(
                    f"{url}/v1/images/generations",
                    json={"prompt": "a red fox", "seed": 3},
                    headers={"X-Request-Id": "pg-1"},
                    timeout=30,
                )
            )
        )
        asking.start()
        deadline = time.monotonic() + 30
        while (state := httpx.get(f"{url}/v1/requests/pg-1")).status_code == 404 or state.json()["progress"] == 0:
            assert time.monotonic() < deadline, state.text
            time.sleep(0.02)
        assert state.json() == {"id": "pg-1", "status": "in_progress", "progress": 25}
        go.set()
        asking.join(30)
        assert answer[0].status_code == 200 and answer[0].json()["data"][0]["seed"] == 3
        gone = httpx.get(f"{url}/v1/requests/pg-1")  # answered: no longer known
        assert gone.status_code == 404
        assert gone.json()["error"]["message"] == "no request 'pg-1' waiting or running (it is answered, or never came)"


def test_the_page_opens_without_a_key_the_api_behind_it_does_not_and_it_can_be_left_out() -> None:
    served = Served("tiny-flux", FAMILIES["flux"], "image", dict(FLUX_DEFAULTS))
    with front(served, Door(api_keys=("secret",))) as (url, _go):
        page = httpx.get(f"{url}/")
        assert page.status_code == 200 and "<title>accel playground</title>" in page.text
        for name, kind in (("playground.js", "text/javascript"), ("playground.css", "text/css")):
            asset = httpx.get(f"{url}/playground/{name}")
            assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind) and asset.text
        assert httpx.get(f"{url}/v1/playground").status_code == 401
        keyed = httpx.get(f"{url}/v1/playground", headers={"Authorization": "Bearer secret"})
        assert keyed.status_code == 200 and keyed.json()["model"] == "tiny-flux"
        assert httpx.get(f"{url}/playground/other.js").status_code == 401  # not one of the open files
    with front(served) as (url, _go):
        assert httpx.get(f"{url}/playground/other.js").status_code == 404
    with front(served, playground=False) as (url, _go):
        assert httpx.get(f"{url}/").status_code == 404
        assert httpx.get(f"{url}/playground/playground.js").status_code == 404


def _chromium() -> str | None:
    return next(
        (found for name in ("chromium", "chromium-browser", "google-chrome") if (found := shutil.which(name))), None
    )


def test_a_prompt_typed_in_the_page_in_a_real_browser_shows_the_picture_the_api_makes(tmp_path: Path) -> None:
    browser_path = _chromium()
    if browser_path is None:
        pytest.skip("no Chromium on this machine (make test installs Debian's chromium when it may use apt-get)")
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    import interop_cases
    from test_serve import start

    interop_cases.make_lora(str(tmp_path), seed=1)
    lora = f"pixel={tmp_path / 'pytorch_lora_weights.safetensors'}"
    server = start("tiny-flux", "--steps", "4", "--lora", lora)
    try:
        with playwright.sync_playwright() as driver:
            browser = driver.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1000, "height": 700})
                page.goto(server.url)
                page.wait_for_function("document.getElementById('status').textContent === 'ready'", timeout=30_000)
                assert page.input_value("#width") == "64" and page.input_value("#steps") == "4"
                # A text-to-image pipeline: no frames; a picture and a mask to give if one likes (its img2img
                # and inpaint siblings on the same weights edit them), neither asked for.
                assert page.is_hidden("#frames-field")
                assert all(page.is_visible(f"#{name}-field") for name in ("picture", "mask"))
                assert not page.eval_on_selector("#picture", "e => e.required")
                page.fill("#prompt", "a red fox in the snow")
                page.fill("#seed", "11")
                page.fill("input[data-lora=pixel]", "0.8")  # the server's one LoRA, at a scale
                page.click("#generate")
                page.wait_for_selector("#output img", timeout=120_000)
                page.wait_for_function("document.getElementById('status').textContent.startsWith('done')")
                assert page.text_content("#status") == "done: seed 11"
                assert (
                    page.get_attribute("#progress", "hidden") is None
                    and page.eval_on_selector("#progress", "bar => bar.value") == 100
                )
                shown = page.get_attribute("#output img", "src")
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "playground.png"))
            finally:
                browser.close()
        direct = httpx.post(
            f"{server.url}/v1/images/generations",
            json={"prompt": "a red fox in the snow", "seed": 11, "lora": {"pixel": 0.8}},
            timeout=120,
        )
        assert shown == "data:image/png;base64," + direct.json()["data"][0]["b64_json"]
        plain = httpx.post(  # the LoRA changes the picture: the page sent it
            f"{server.url}/v1/images/generations", json={"prompt": "a red fox in the snow", "seed": 11}, timeout=120
        )
        assert plain.json()["data"][0]["b64_json"] != direct.json()["data"][0]["b64_json"]
        assert base64.b64decode(shown.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
        assert (ARTIFACTS / "playground.png").stat().st_size > 0
    finally:
        code, out, err = server.stop()
        assert code == 0, err[-2000:]
        assert "; the playground at /); Ctrl-C stops" in out


def test_a_video_job_from_the_page_shows_its_progress_and_plays_the_mp4_the_job_made(tmp_path: Path) -> None:
    browser_path = _chromium()
    if browser_path is None:
        pytest.skip("no Chromium on this machine (make test installs Debian's chromium when it may use apt-get)")
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    from test_serve import start

    server = start("tiny-wan", "--steps", "4", "--video-dir", str(tmp_path / "videos"))
    try:
        with playwright.sync_playwright() as driver:
            browser = driver.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
            try:
                page = browser.new_page()
                page.goto(server.url)
                page.wait_for_function("document.getElementById('status').textContent === 'ready'", timeout=30_000)
                assert page.is_visible("#frames-field") and page.is_hidden("#picture-field")
                page.fill("#prompt", "a red fox running")
                page.fill("#frames", "5")
                page.fill("#seed", "3")
                seen: list[str] = []
                page.expose_function("note", lambda text: seen.append(text))
                page.evaluate(  # every status line the page shows while it works
                    "new MutationObserver(() => note(document.getElementById('status').textContent))"
                    ".observe(document.getElementById('status'), {childList: true, characterData: true, subtree: true})"
                )
                page.click("#generate")
                page.wait_for_selector("#output video", timeout=120_000)
                status = page.text_content("#status") or ""
                assert status.startswith("done: video_"), status
                played = page.eval_on_selector(
                    "#output video",
                    "async clip => { const data = new Uint8Array(await (await fetch(clip.src)).arrayBuffer());"
                    " let text = ''; for (const byte of data) text += String.fromCharCode(byte); return btoa(text); }",
                )
            finally:
                browser.close()
        video_id = status.removeprefix("done: ")
        content = httpx.get(f"{server.url}/v1/videos/{video_id}/content", timeout=30)
        assert base64.b64decode(played) == content.content and content.content[4:8] == b"ftyp"
        assert any(line.startswith(("queued", "in progress")) for line in seen), seen
        job = httpx.get(f"{server.url}/v1/videos/{video_id}").json()
        assert (job["status"], job["prompt"], job["size"]) == ("completed", "a red fox running", "64x64")
    finally:
        code, _out, err = server.stop()
        assert code == 0, err[-2000:]
