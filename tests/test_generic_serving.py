"""`accel serve` and `accel tune` on a pipeline no family describes (issue 34 item 1): a saved Chroma
folder, through the generic path only. The server's pixels equal `accel run`'s at the same seed; tune
measures MagCache's curve on the learned blocks."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tomli_w
from PIL import Image
from cli_runs import accel_run
from test_generic import pipeline
from test_serve import Server, start
from typer.testing import CliRunner

from accel.cli import app
from accel.recipe import load_recipe

PROMPT = "a red fox in the snow"


@pytest.fixture(scope="module")
def chroma_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("generic-serving") / "chroma"
    pipeline("chroma").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def chroma_server(chroma_folder: Path) -> Iterator[Server]:
    # Two default steps: the warm-up generation runs at the model's default size (Chroma's 1024 px) and
    # steps, where the requests here ask for 64 px and 3 steps themselves.
    server = start(str(chroma_folder), "--dtype", "float32", "--cache", "0.1", "--max-queue", "2", "--steps", "2")
    yield server
    if server.process.poll() is None:
        server.process.kill()
        server.process.communicate()


def _pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def test_the_server_makes_what_accel_run_makes(chroma_server: Server, chroma_folder: Path, tmp_path: Path) -> None:
    response = httpx.post(
        f"{chroma_server.url}/v1/images/generations",
        timeout=300,
        json={"prompt": PROMPT, "size": "64x64", "seed": 3, "steps": 3, "response_format": "b64_json"},
    )
    assert response.status_code == 200, response.text
    served = _pixels(base64.b64decode(response.json()["data"][0]["b64_json"]))
    out = tmp_path / "run.png"
    result = accel_run(
        *[str(chroma_folder), "--prompt", PROMPT, "--seed", "3", "--steps", "3", "--width", "64", "--height", "64"],
        *["--cache", "0.1", "--dtype", "float32", "--warmup", "0", "--out", str(out)],
        threads=1,  # as the server's process (OMP_NUM_THREADS=1): the pixels are compared
    )
    assert result.exit_code == 0, result.output
    assert served.shape == (64, 64, 3) and np.array_equal(served, _pixels(out.read_bytes()))
    bad = httpx.post(f"{chroma_server.url}/v1/images/generations", json={"prompt": PROMPT, "steps": 0}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "steps"


def test_tune_calibrates_magcache_on_the_learned_blocks(chroma_folder: Path, tmp_path: Path) -> None:
    recipe, out = tmp_path / "chroma.toml", tmp_path / "chroma-magcache.toml"
    recipe.write_bytes(
        tomli_w.dumps(
            {
                "model": {"name": str(chroma_folder), "dtype": "float32", "device": "cpu"},
                "generate": {"steps": 4, "height": 32, "width": 32},
            }
        ).encode()
    )
    result = CliRunner().invoke(app, ["tune", str(recipe), "--calibrate", "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    tuned = load_recipe(out)
    assert tuned.cache.method == "magcache" and tuned.model.name == str(chroma_folder)
    # One measured ratio per step of the learned blocks' call sequence (per CFG branch the pipeline runs).
    assert tuned.cache.mag_ratios and all(
        len(branch) == 4 and all(ratio > 0 for ratio in branch) for branch in tuned.cache.mag_ratios
    )
