"""OpenAI's image edits on `accel serve`: the openai client's `images.edit` with a picture and a
mask reaches the served pipeline as `accel run --image --mask` gives them, and equals its output;
uploads are checked before any work, and an edit to a pipeline that takes no picture names the
ones that do."""

from __future__ import annotations

import base64
import io
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from PIL import Image

from accel.launch.environment import free_port
from accel.models.registry import FAMILIES
from accel.models.variants import variant_of
from accel.serve.dispatch import Dispatcher
from accel.serve.front import Metrics, build_app
from accel.serve.replica import Outcome
from accel.serve.requests import Job, Served

FLUX_DEFAULTS = {"width": 64, "height": 64, "steps": 4}


def picture(size: tuple[int, int] = (64, 64), mode: str = "RGB", seed: int = 0) -> bytes:
    buffer = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    (Image.fromarray(pixels) if mode == "RGB" else Image.new(mode, size)).save(buffer, format="PNG")
    return buffer.getvalue()


@dataclass
class Replica:
    """Answers each job with the bytes of the picture it was given, keeping the jobs."""

    jobs: list[Job] = field(default_factory=list)

    def __call__(self, job: Job) -> Outcome:
        if job.stop:
            return Outcome(True)
        self.jobs.append(job)
        named = [job.generate[name] for name in ("image", "mask") if name in job.generate]
        files = [Path(path).read_bytes() for path in [*named, *job.generate.get("references", ())]]
        return Outcome(True, files, [int(job.generate["seed"])] * len(files))


@contextmanager
def edit_front(pipeline_class: str, family: str | None = None) -> Iterator[tuple[openai.OpenAI, Replica, str]]:
    """A front serving `pipeline_class` (of the family that lists it) on a replica that echoes its pictures."""
    family = family or next(
        name
        for name, found in FAMILIES.items()
        if pipeline_class == found.pipeline_class or any(v.pipeline_class == pipeline_class for v in found.variants)
    )
    replica = Replica()
    dispatcher = Dispatcher([replica], 4)
    metrics = Metrics(dispatcher)
    variant = variant_of(FAMILIES[family], pipeline_class)
    output = FAMILIES[family].output_of(pipeline_class)
    served = Served(f"tiny-{family}", FAMILIES[family], output, dict(FLUX_DEFAULTS), variant=variant, needs_mask=True)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(served, dispatcher, metrics, 1), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    dispatcher.start()
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        yield openai.OpenAI(base_url=url, api_key="none", max_retries=0), replica, url
    finally:
        server.should_exit = True
        thread.join(10)
        dispatcher.stop(5)


def test_the_picture_and_the_mask_reach_the_pipeline_as_files_and_go_with_the_request() -> None:
    with edit_front("FluxInpaintPipeline") as (client, replica, _url):
        result = client.images.edit(
            image=("fox.png", picture(seed=1), "image/png"),
            mask=("mask.png", picture(seed=2), "image/png"),
            prompt="a red fox",
            size="64x64",
            extra_body={"seed": 4},
        )
        assert [base64.b64decode(item.b64_json) for item in result.data] == [picture(seed=1), picture(seed=2)]
        (job,) = replica.jobs
        assert job.generate["seed"] == 4 and (job.generate["width"], job.generate["height"]) == (64, 64)
        assert not Path(job.generate["image"]).exists() and not Path(job.generate["mask"]).exists()


def test_several_pictures_reach_a_pipeline_that_combines_them_in_their_order() -> None:
    """FLUX.2 combines reference pictures: the openai client's list of images is the call's picture
    (the first) and its references (the others, in order), as `accel run --image A --reference B`."""
    sent = [picture(seed=seed) for seed in (1, 2, 3)]
    with edit_front("Flux2Pipeline", family="flux2") as (client, replica, _url):
        result = client.images.edit(
            image=[(f"{index}.png", data, "image/png") for index, data in enumerate(sent)],
            prompt="the fox of the first in the light of the others",
            extra_body={"seed": 4},
        )
        assert [base64.b64decode(item.b64_json) for item in result.data] == sent
        (job,) = replica.jobs
        assert len(job.generate["references"]) == 2


@pytest.mark.parametrize(
    "pipeline_class, upload, param, message",
    [
        (
            "FluxPipeline",
            {"image": [picture()]},
            None,
            "tiny-flux's pipeline edits no pictures; serve one that does (FluxImg2ImgPipeline, FluxInpaintPipeline, "
            "FluxKontextPipeline, FluxKontextInpaintPipeline, FluxFillPipeline, FluxControlPipeline)",
        ),
        ("FluxKontextPipeline", {}, "image", "image: required, the picture to edit"),
        (
            "FluxKontextPipeline",
            {"image": [picture(), picture()]},
            "image",
            "image: FluxKontextPipeline takes one picture, not 2",
        ),
        (
            "QwenImageEditPlusPipeline",
            {"image": [picture()] * 4},
            "image",
            "image: QwenImageEditPlusPipeline takes at most 3 pictures, not 4",
        ),
        (
            "FluxKontextPipeline",
            {"image": [picture()], "mask": [picture()]},
            "mask",
            "mask: tiny-flux's pipeline takes no mask",
        ),
        (
            "FluxInpaintPipeline",
            {"image": [picture()]},
            "mask",
            "mask: FluxInpaintPipeline repaints where a mask says; upload one",
        ),
        (
            "FluxKontextPipeline",
            {"image": [b"not a picture"]},
            "image",
            "image: the upload is not an image Pillow can read (cannot identify image file",
        ),
        (
            "FluxKontextPipeline",
            {"image": [picture((10_000, 9_000), "1")]},
            "image",
            "image: the upload has more than 89,478,485 pixels (Pillow's decompression-bomb limit); "
            "pass a smaller image",
        ),
    ],
)
def test_an_edit_the_pipeline_cannot_make_is_400_before_any_work(
    pipeline_class: str, upload: dict[str, list[bytes]], param: str | None, message: str
) -> None:
    with edit_front(pipeline_class) as (_client, replica, url):
        files = [("prompt", (None, "a red fox"))]
        files += [(name, (f"{name}.png", data, "image/png")) for name, found in upload.items() for data in found]
        refused = httpx.post(f"{url}/images/edits", files=files, timeout=60)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == param and error["message"].startswith(message), error
        assert replica.jobs == []


def test_the_openai_clients_edit_with_a_mask_is_what_accel_run_makes(tmp_path: Path) -> None:
    """tiny-flux's inpaint pipeline (its recipe's picture and mask serve the warm-up): the edit's
    PNG equals `accel run --image --mask` at the same seed."""
    from cli_runs import accel_run
    from test_serve import start

    fox, mask = tmp_path / "fox.png", tmp_path / "mask.png"
    fox.write_bytes(picture(seed=1))
    Image.fromarray(np.kron(np.eye(2, dtype=np.uint8) * 255, np.ones((32, 32), np.uint8))).save(mask)
    (tmp_path / "gray.png").write_bytes(picture(mode="L"))
    recipe = tmp_path / "inpaint.toml"
    recipe.write_text(
        '[model]\nname = "tiny-flux"\npipeline = "FluxInpaintPipeline"\n\n'
        f'[generate]\nsteps = 2\nimage = "{tmp_path / "gray.png"}"\nmask = "{tmp_path / "gray.png"}"\n'
    )
    server = start("--recipe", str(recipe))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        with fox.open("rb") as image, mask.open("rb") as repaint:
            result = client.images.edit(
                image=image, mask=repaint, prompt="a red fox", size="64x64", extra_body={"seed": 3}
            )
        edited = base64.b64decode(result.data[0].b64_json)
    finally:
        code, _out, err = server.stop(signal.SIGTERM)
    assert code == 0, err
    out = tmp_path / "run.png"
    run = accel_run(
        *["--recipe", str(recipe), "--image", str(fox), "--mask", str(mask)],
        *["--seed", "3", "--width", "64", "--height", "64", "--prompt", "a red fox", "--out", str(out)],
        threads=1,  # as the server's process (OMP_NUM_THREADS=1): the pixels are compared
    )
    assert run.exit_code == 0, run.output
    with Image.open(io.BytesIO(edited)) as served, Image.open(out) as written:
        assert np.array_equal(np.asarray(served), np.asarray(written))
