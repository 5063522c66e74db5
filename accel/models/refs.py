"""Where a model name points, known without torch: a registry family, a saved folder or a hub id.

`accel run` and `accel bench` refuse an unknown name with this before torch loads (seconds)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from accel.errors import ModelError, UserError
from accel.models.base import Family
from accel.models.folder_check import read_index, read_json
from accel.models.registry import family_of_classes, lookup, unknown_model_message


@dataclass(frozen=True)
class ModelRef:
    """Where a model name points: a registry family (maybe its tiny variant) or a path / repo id."""

    name: str
    family: Family | None
    tiny: bool
    source: str  # hub repo id or folder; "" for tiny variants
    # The pipeline class a saved folder names (its model_index.json); None: the family's own, or unknown.
    pipeline: str | None = None


def resolve_model(name: str) -> ModelRef:
    if not name:
        raise UserError("no model given: pass MODEL (e.g. tiny-flux) or set [model] name in the recipe")
    found = lookup(name)
    if found is not None:
        family, tiny = found
        return ModelRef(name, family, tiny, "" if tiny else family.repo)
    folder = Path(name).expanduser()
    if folder.is_dir():
        return ModelRef(name, _family_of_folder(folder), False, str(folder), _pipeline_of_folder(folder))
    if _looks_like_repo_id(name):
        return ModelRef(name, None, False, name)
    raise ModelError(unknown_model_message(name))


def heads_before_start(ref: ModelRef) -> int | None:
    """Attention heads of the model's transformer, known without loading it (None when unknown; the
    ranks check once loaded). Lets Ulysses and TP degrees be refused before start-up. The checkpoint's
    own config where one is readable: a folder's transformer/config.json, or a hub id's in the local
    Hugging Face cache (no network); else a hub id that is a family's default repo or a flagship
    (accel plan's bundled config). A registry alias is its family's default checkpoint."""
    if ref.family is not None and (ref.tiny or ref.source == ref.family.repo):
        return ref.family.tiny_heads if ref.tiny else ref.family.heads
    folder = Path(ref.source)
    config = folder / "transformer" / "config.json"
    if config.is_file():
        return _heads_in(ref.family, read_json(config))
    if ref.family is None and not folder.is_dir() and _looks_like_repo_id(ref.source):
        return _hub_heads(ref.source)
    return None


def _heads_in(family: Family | None, settings: dict) -> int | None:
    if family is not None:
        return family.heads_in(settings)
    heads = settings.get("num_attention_heads")
    return int(heads) if isinstance(heads, int) else None


def _cached_json(repo: str, filename: str) -> dict | None:
    """A file of a hub repo's newest cached snapshot, as JSON (None: not cached, or not a JSON object)."""
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(repo, filename)
    if not isinstance(path, str):
        return None
    try:
        settings = read_json(Path(path))
    except ModelError:
        return None
    return settings if isinstance(settings, dict) else None


def _hub_heads(repo: str) -> int | None:
    """A hub id's heads without the network: its cached transformer config (the family from its cached
    model_index.json or the config's class), else a family's default repo's, else a flagship's."""
    from accel.models.registry import FAMILIES

    settings = _cached_json(repo, "transformer/config.json")
    if settings is not None:
        index = _cached_json(repo, "model_index.json") or {}
        entry, pipeline = index.get("transformer"), index.get("_class_name")
        transformer = str(entry[-1]) if isinstance(entry, list) and entry else settings.get("_class_name")
        family = (
            family_of_classes(transformer, pipeline if isinstance(pipeline, str) else None)
            if isinstance(transformer, str)
            else None
        )
        return _heads_in(family, settings)
    family = next((f for f in FAMILIES.values() if f.repo.lower() == repo.lower()), None)
    if family is not None:
        return family.heads
    from accel.models.flagships import flagship_heads, flagship_of_repo

    key = flagship_of_repo(repo)
    return flagship_heads(key) if key is not None else None


def _family_of_folder(folder: Path) -> Family | None:
    """The family a saved pipeline belongs to, from its model_index.json (a ModelError if it has none
    or it is not valid JSON)."""
    index = read_index(folder)
    entry = index.get("transformer")
    if not isinstance(entry, list) or not entry:
        return None
    pipeline = index.get("_class_name")
    return family_of_classes(str(entry[-1]), pipeline if isinstance(pipeline, str) else None)


def _pipeline_of_folder(folder: Path) -> str | None:
    """The pipeline class a saved pipeline's model_index.json names (None: it names none)."""
    pipeline = read_index(folder).get("_class_name")
    return pipeline if isinstance(pipeline, str) else None


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(part and not part.startswith(".") for part in parts)
