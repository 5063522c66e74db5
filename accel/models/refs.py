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
    """Attention heads of the model's transformer, known without loading it (None when unknown: a hub
    id; the ranks check once loaded). Lets Ulysses degrees be refused before start-up."""
    if ref.family is not None and (ref.tiny or ref.source == ref.family.repo):
        return ref.family.tiny_heads if ref.tiny else ref.family.heads
    config = Path(ref.source) / "transformer" / "config.json"
    if config.is_file():
        settings = read_json(config)
        if ref.family is not None:
            return ref.family.heads_in(settings)
        heads = settings.get("num_attention_heads")
        return int(heads) if isinstance(heads, int) else None
    return None


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
