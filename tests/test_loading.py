"""load_pipeline and the registry: aliases, tiny variants, folders, repo ids, clear refusals."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import accel
from accel.errors import ModelError, UserError
from accel.models.registry import FAMILIES, family_of
from conftest import FLUX_CALL, generate


def test_registry_has_every_family_with_its_facts() -> None:
    assert list(FAMILIES) == [
        "flux",
        "hunyuan",
        "wan",
        "cogvideox",
        "mochi",
        "ltx",
        "qwenimage",
        "flux2-klein",
        "sd3",
        "flux2",
        "zimage",
        "hunyuan15",
        "skyreels2",
        "kandinsky5",
        "ltx2",
        "chronoedit",
        "hunyuanimage",
        "qwenimage21",
        "helios",
        "cosmos3",
        "kandinsky6",
    ]
    import diffusers

    for family in FAMILIES.values():
        assert hasattr(diffusers, family.pipeline_class), family.pipeline_class
        assert hasattr(diffusers, family.transformer_class), family.transformer_class
        assert family.output in ("image", "video") and "/" in family.repo
        assert (family.frames_arg is not None) == (family.output == "video")
        assert family.blocks, "the cache needs the block lists"
    assert FAMILIES["flux"].tiny_alias == "tiny-flux" and FAMILIES["wan"].tiny_alias == "tiny-wan"


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-wan"])
def test_every_block_list_exists_on_the_tiny_transformer(name: str) -> None:
    pipe = accel.load_pipeline(name)
    family = family_of(pipe)
    for spec in family.blocks:
        blocks = getattr(pipe.transformer, spec.attr)
        assert len(blocks) >= 2


def test_tiny_alias_loads_in_the_asked_dtype() -> None:
    pipe = accel.load_pipeline("tiny-flux", dtype="bfloat16", device="cpu")
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.vae.dtype == torch.bfloat16
    assert family_of(pipe).name == "flux"


def test_local_folder_loads_the_same_pipeline(tiny_flux: Any, flux_reference: np.ndarray, tmp_path: Path) -> None:
    tiny_flux.save_pretrained(tmp_path / "saved")
    pipe = accel.load_pipeline(str(tmp_path / "saved"), dtype="float32")
    pipe.set_progress_bar_config(disable=True)
    assert np.array_equal(generate(pipe, FLUX_CALL), flux_reference)


def test_a_saved_folder_takes_its_family_default_dtype(tiny_flux: Any, tmp_path: Path) -> None:
    tiny_flux.save_pretrained(tmp_path / "saved")
    assert accel.load_pipeline(str(tmp_path / "saved")).transformer.dtype == torch.bfloat16  # FLUX's default


def test_a_folder_that_is_not_a_pipeline_is_refused(tmp_path: Path) -> None:
    message = (
        f"{tmp_path} is not a diffusers pipeline folder: it has no model_index.json; "
        "pass the folder save_pretrained wrote, or a downloaded pipeline"
    )
    with pytest.raises(ModelError, match=f"^{re.escape(message)}$"):
        accel.load_pipeline(str(tmp_path))


def test_real_model_not_available_offline_says_how_to_get_it() -> None:
    with pytest.raises(ModelError) as caught:
        accel.load_pipeline("flux")
    message = str(caught.value)
    assert message.startswith(
        "model 'black-forest-labs/FLUX.1-dev' is not available locally and could not be downloaded ("
    )
    assert "hf download black-forest-labs/FLUX.1-dev" in message and "\n" not in message


def test_unknown_model_gets_did_you_mean() -> None:
    with pytest.raises(
        ModelError, match=re.escape("unknown model 'tiny-flx' (did you mean 'tiny-flux'?): use one of flux, hunyuan,")
    ):
        accel.load_pipeline("tiny-flx")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "float64"}, "dtype must be one of auto, float32, float16, bfloat16, got 'float64'"),
        ({"device": "tpu"}, "device must be one of auto, cpu, cuda, got 'tpu'"),
    ],
)
def test_bad_dtype_or_device(kwargs: dict, message: str) -> None:
    with pytest.raises(UserError, match=re.escape(message)):
        accel.load_pipeline("tiny-flux", **kwargs)
