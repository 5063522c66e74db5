"""A pipeline as named by its index, without weights: its class, its transformers' classes and configs,
its VAE and text encoders, read from a folder's or a hub repo's model_index.json, else from a registry
family's flagship configs (accel plan's), else from the family's class names alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel.errors import ModelError
from accel.models.folder_check import read_index, read_json
from accel.models.refs import ModelRef


@dataclass(frozen=True)
class PipelineClasses:
    """A pipeline as named by its index: class names and configs, no weights."""

    pipeline: str
    transformers: tuple[tuple[str, str, dict[str, Any] | None], ...]  # (attr, class, config)
    vae: str | None
    text_encoders: tuple[str, ...]


def classes_of(ref: ModelRef) -> PipelineClasses:
    folder = Path(ref.source)
    if folder.is_dir():
        index = read_index(folder)
        return _from_index(index, lambda attr: _folder_config(folder, attr))
    from accel.models.flagships import FLAGSHIPS, flagship_of_repo
    from accel.models.refs import _cached_json

    if ref.family is None or ref.source != ref.family.repo:
        index = _cached_json(ref.source, "model_index.json")
        if index is not None:
            return _from_index(index, lambda attr: _cached_json(ref.source, f"{attr}/config.json"))
    key = ref.family.name if ref.family is not None and ref.source == ref.family.repo else flagship_of_repo(ref.source)
    if key is not None and key in FLAGSHIPS:
        flagship = FLAGSHIPS[key]
        from accel.models.registry import FAMILIES

        vae = next((c.cls for c in flagship.of_kind("vae")), None)
        transformers = tuple((c.attr, c.cls, dict(c.config)) for c in flagship.of_kind("transformer"))
        return PipelineClasses(
            FAMILIES[key].pipeline_class, transformers, vae, tuple(c.attr for c in flagship.of_kind("text_encoder"))
        )
    if ref.family is not None:  # a family without a flagship config: its class names alone
        family = ref.family
        return PipelineClasses(
            family.pipeline_class, ((family.transformer_attrs[0], family.transformer_class, None),), family.vae, ()
        )
    return _from_index(
        _hub_json(ref.source, "model_index.json"), lambda attr: _hub_json(ref.source, f"{attr}/config.json")
    )


def _folder_config(folder: Path, attr: str) -> dict[str, Any] | None:
    path = folder / attr / "config.json"
    return read_json(path) if path.is_file() else None


def _hub_json(repo: str, filename: str) -> dict[str, Any]:
    """A small JSON file of a hub repo (no weights), downloaded; a ModelError in one line when it cannot be."""
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(repo, filename)
    except Exception as error:  # noqa: BLE001 - offline, gated, missing: one line says which
        raise ModelError(
            f"cannot read {repo}'s {filename} ({type(error).__name__}); download the pipeline and pass its folder"
        ) from None
    return read_json(Path(path))


def _from_index(index: dict[str, Any], config_of: Callable[[str], dict[str, Any] | None]) -> PipelineClasses:
    def named(key: str) -> str | None:
        entry = index.get(key)
        return str(entry[-1]) if isinstance(entry, list) and len(entry) == 2 and entry[-1] else None

    keys = sorted(key for key in index if not key.startswith("_"))
    transformers = tuple(
        (key, cls, config_of(key)) for key in keys if key.startswith("transformer") and (cls := named(key))
    )
    encoders = tuple(key for key in keys if key.startswith("text_encoder") and named(key))
    return PipelineClasses(str(index.get("_class_name")), transformers, named("vae"), encoders)
