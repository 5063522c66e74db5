"""A broken pipeline folder is refused in one accurate line (which file, what is wrong, what to do),
as a ModelError: never a library traceback, never advice to unpickle. One tiny-flux folder is saved
per module; each test corrupts its own copy."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import commands
import torch
from safetensors.torch import load as load_safetensors

import accel
from accel.errors import ModelError
from accel.models.folder_check import check_folder, read_index
from accel.models.loading import _first_line
from accel.models.registry import FAMILIES

REDO = "re-download or re-save the pipeline"


@pytest.fixture(scope="module")
def saved(tiny_flux: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("faults") / "tiny-flux"
    tiny_flux.save_pretrained(folder)
    return folder


@pytest.fixture
def folder(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "pipe"
    shutil.copytree(saved, copy)
    return copy


def refused(folder: Path) -> str:
    with pytest.raises(ModelError) as caught:
        accel.load_pipeline(str(folder))
    assert caught.value.__suppress_context__ or caught.value.__context__ is None  # no chained library error
    return str(caught.value)


def edit_index(folder: Path, change: Callable[[dict], None]) -> None:
    path = folder / "model_index.json"
    index = json.loads(path.read_text())
    change(index)
    path.write_text(json.dumps(index, indent=2))


class Trap:
    """Unpickling this creates `marker`: proof that a pickle was (not) loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return open, (str(self.marker), "w")


# model_index.json


def test_missing_model_index(folder: Path) -> None:
    (folder / "model_index.json").unlink()
    assert refused(folder) == (
        f"{folder} is not a diffusers pipeline folder: it has no model_index.json; "
        "pass the folder save_pretrained wrote, or a downloaded pipeline"
    )


def test_model_index_not_json(folder: Path) -> None:
    (folder / "model_index.json").write_text('{\n  "_class_name": "FluxPipeline",\n  "vae": ]\n}')
    assert refused(folder) == (
        f"{folder}/model_index.json is not valid JSON (Expecting value: line 3 column 10); "
        "fix it, or re-download the pipeline"
    )


def test_class_name_that_is_no_pipeline(folder: Path) -> None:
    edit_index(folder, lambda index: index.update(_class_name="FluxPipelineX"))
    assert refused(folder) == (
        f"{folder}/model_index.json: _class_name 'FluxPipelineX' is not a diffusers pipeline "
        "(did you mean 'FluxPipeline'?); set it to the pipeline class the folder was saved with, "
        "or re-download the pipeline"
    )


@pytest.mark.parametrize(
    "component, entry, why",
    [
        ("transformer", ["diffusers", "NoSuchModel"], "diffusers has no class NoSuchModel"),
        ("text_encoder", ["transformers", "NoSuchEncoder"], "transformers has no class NoSuchEncoder"),
        (
            "transformer",
            ["transformerz", "X"],
            "'transformerz' is not a library diffusers loads components from "
            "(diffusers, transformers, onnxruntime.training)",
        ),
    ],
)
def test_component_of_unknown_class_or_library(folder: Path, component: str, entry: list, why: str) -> None:
    edit_index(folder, lambda index: index.update({component: entry}))
    assert refused(folder) == (
        f"{folder}/model_index.json: component '{component}' is ['{entry[0]}', '{entry[1]}'], "
        f"but {why}; fix the entry, or re-download the pipeline"
    )


def test_component_folder_missing(folder: Path) -> None:
    shutil.rmtree(folder / "tokenizer")  # diffusers would quietly build a 2-token tokenizer
    assert refused(folder) == (
        f"{folder}/tokenizer is missing, but model_index.json lists component 'tokenizer' "
        f"(transformers CLIPTokenizer); {REDO}"
    )


# a component's config


@pytest.mark.parametrize("component", ["transformer", "text_encoder"])
def test_component_config_missing(folder: Path, component: str) -> None:
    (folder / component / "config.json").unlink()  # transformers would fall back to a default config
    assert refused(folder) == f"{folder}/{component}/config.json is missing; {REDO}"


@pytest.mark.parametrize("config", ["transformer/config.json", "scheduler/scheduler_config.json"])
def test_component_config_not_json(folder: Path, config: str) -> None:
    (folder / config).write_text("{nope")
    assert refused(folder) == (
        f"{folder}/{config} is not valid JSON (Expecting property name enclosed in double quotes: "
        "line 1 column 2); fix it, or re-download the pipeline"
    )


# weights


def truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def test_truncated_safetensors_names_the_file(folder: Path) -> None:
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    size = weights.stat().st_size
    truncate(weights, size - 100)  # a download cut short: the header is whole, the data is not
    data = size - 8 - int.from_bytes(weights.read_bytes()[:8], "little")
    assert refused(folder) == (
        f"{weights} is not a valid safetensors file (truncated: its tensors need {data} bytes of data "
        f"but the file holds {data - 100}); re-download or re-save it"
    )


def test_safetensors_cut_inside_its_header(folder: Path) -> None:
    weights = folder / "text_encoder" / "model.safetensors"
    header = int.from_bytes(weights.read_bytes()[:8], "little")
    truncate(weights, 100)
    assert refused(folder) == (
        f"{weights} is not a valid safetensors file (truncated: its {header}-byte header runs past "
        "the end of the 100-byte file); re-download or re-save it"
    )


def test_garbage_safetensors(folder: Path) -> None:
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    assert refused(folder) == (
        f"{weights} is not a valid safetensors file (its header is not valid JSON); re-download or re-save it"
    )


def test_pickled_text_encoder_is_refused_unloaded(folder: Path, tmp_path: Path) -> None:
    directory = folder / "text_encoder"
    (directory / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps({"trap": Trap(marker)}, protocol=4))
    message = refused(folder)
    assert message == (
        f"{directory}/pytorch_model.bin is a pickled PyTorch checkpoint, which accel will not load for "
        "safety (unpickling can run arbitrary code); convert it to safetensors, saved as model.safetensors beside it"
    )
    assert not marker.exists() and "weights_only" not in message


def test_pickled_transformer_is_refused_unloaded(folder: Path, tmp_path: Path) -> None:
    directory = folder / "transformer"
    state = load_safetensors((directory / "diffusion_pytorch_model.safetensors").read_bytes())
    (directory / "diffusion_pytorch_model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    torch.save({**state, "trap": Trap(marker)}, directory / "diffusion_pytorch_model.bin")  # zip-based
    assert refused(folder) == (
        f"{directory}/diffusion_pytorch_model.bin is a pickled PyTorch checkpoint, which accel will not load "
        "for safety (unpickling can run arbitrary code); convert it to safetensors, saved as "
        "diffusion_pytorch_model.safetensors beside it"
    )
    assert not marker.exists()


def test_pickle_saved_under_a_safetensors_name(folder: Path) -> None:
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    torch.save(load_safetensors(weights.read_bytes()), weights)  # not mmapped: it is overwritten
    assert refused(folder) == (
        f"{weights} is not a valid safetensors file (it is a pickled PyTorch file, which accel will not "
        "load); re-download or re-save it"
    )


@pytest.mark.parametrize(
    "weights, stem",
    [
        ("transformer/diffusion_pytorch_model.safetensors", "diffusion_pytorch_model"),
        ("text_encoder_2/model.safetensors", "model"),
    ],
)
def test_weights_missing(folder: Path, weights: str, stem: str) -> None:
    (folder / weights).unlink()
    component = weights.split("/")[0]
    assert refused(folder) == f"{folder}/{component} has no weights: {stem}.safetensors is missing; {REDO}"


def test_missing_shard_of_a_sharded_checkpoint(folder: Path) -> None:
    directory = folder / "transformer"
    index = {"metadata": {}, "weight_map": {"a": "diffusion_pytorch_model-00001-of-00002.safetensors"}}
    (directory / "diffusion_pytorch_model.safetensors").unlink()
    (directory / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    assert refused(folder) == (
        f"{directory}/diffusion_pytorch_model-00001-of-00002.safetensors is missing "
        f"(listed in diffusion_pytorch_model.safetensors.index.json); {REDO}"
    )


def test_a_header_length_that_starts_like_a_pickle_is_no_pickle(tmp_path: Path) -> None:
    from safetensors.torch import save

    from accel.models.folder_check import safetensors_problem

    raw = save({"w": torch.arange(4.0)})
    length = int.from_bytes(raw[:8], "little")
    padded = 0x0480  # little-endian b"\x80\x04...", a pickle's protocol-4 opening
    header = raw[8 : 8 + length] + b" " * (padded - length)
    path = tmp_path / "w.safetensors"
    path.write_bytes(padded.to_bytes(8, "little") + header + raw[8 + length :])
    assert path.read_bytes()[:2] == b"\x80\x04" and safetensors_problem(path) is None
    assert torch.equal(load_safetensors(path.read_bytes())["w"], torch.arange(4.0))


@pytest.mark.parametrize("alias", [family.tiny_alias for family in FAMILIES.values()])
def test_every_tiny_family_saved_passes_the_check(alias: str, tmp_path: Path) -> None:
    accel.load_pipeline(alias).save_pretrained(tmp_path)
    check_folder(tmp_path, read_index(tmp_path))


# messages are whole


def test_a_long_reason_is_cut_at_a_word_with_an_ellipsis() -> None:
    reason = " ".join(["unfinishedword"] * 30)
    cut = _first_line(OSError(reason + "\nsecond line"))
    assert cut.endswith("unfinishedword…") and len(cut) <= 201 and "\n" not in cut
    assert _first_line(OSError("short reason.\nmore")) == "short reason."


# the CLI: one line, exit 2


def test_the_cli_prints_one_line_and_exits_2(saved: Path, tmp_path: Path) -> None:
    bad_class, pickled = tmp_path / "bad_class", tmp_path / "pickled"
    shutil.copytree(saved, bad_class)
    shutil.copytree(saved, pickled)
    edit_index(bad_class, lambda index: index.update(_class_name="FluxPipelineX"))
    (pickled / "text_encoder" / "model.safetensors").unlink()
    (pickled / "text_encoder" / "pytorch_model.bin").write_bytes(pickle.dumps({"w": torch.zeros(2)}))
    expected = {
        bad_class: f"error: {bad_class}/model_index.json: _class_name 'FluxPipelineX' is not a diffusers pipeline",
        pickled: f"error: {pickled}/text_encoder/pytorch_model.bin is a pickled PyTorch checkpoint",
    }
    runs = {  # both at once: each spends most of its time importing torch and diffusers
        folder: commands.popen(
            [sys.executable, "-m", "accel.cli", "run", str(folder), "--steps", "1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        for folder in expected
    }
    for folder, run in runs.items():
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 2, stderr
        lines = stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(expected[folder]), stderr
        assert "Traceback" not in stderr + stdout and "weights_only" not in stderr
        assert re.search(r"(re-download the pipeline|convert it to safetensors)", lines[0])
