"""Checks of a saved pipeline folder before diffusers loads it, so each fault a user can cause is one
accurate line (which file, what is wrong, what to do) rather than a library traceback.

Cheap: JSON files are parsed and safetensors headers (8-byte little-endian length + JSON) are read, no
tensor data. Weights are then loaded by diffusers as usual; this only refuses folders it would choke on,
and pickled checkpoints, which accel never loads."""

from __future__ import annotations

import difflib
import importlib
import json
import struct
import sys
from pathlib import Path
from typing import Any

from accel.errors import ModelError

REDO = "re-download or re-save the pipeline"
MAX_HEADER = 100_000_000  # safetensors' own limit on the header's size
PICKLE_MAGIC = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")  # torch.save's zip, a pickle
# Which other JSON files of a component are parsed when present (the library reads them all).
EXTRA_JSON = ("tokenizer_config.json", "special_tokens_map.json", "preprocessor_config.json", "generation_config.json")


def read_index(folder: Path) -> dict[str, Any]:
    """model_index.json as a dict, or a ModelError saying what is wrong with it."""
    path = folder / "model_index.json"
    if not path.is_file():
        raise ModelError(
            f"{folder} is not a diffusers pipeline folder: it has no model_index.json; pass the folder "
            "save_pretrained wrote, or a downloaded pipeline"
        )
    index = read_json(path)
    if not isinstance(index.get("_class_name"), str):
        raise ModelError(f"{path}: no _class_name naming the pipeline class; {REDO}")
    return index


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_bytes())
    except json.JSONDecodeError as error:
        raise ModelError(
            f"{path} is not valid JSON ({error.msg}: line {error.lineno} column {error.colno}); "
            "fix it, or re-download the pipeline"
        ) from None
    except UnicodeDecodeError:
        raise ModelError(f"{path} is not valid JSON (not UTF-8 text); {REDO}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path} holds a JSON {type(data).__name__}, not the object expected; {REDO}")
    return data


def check_folder(folder: Path, index: dict[str, Any]) -> None:
    """Everything diffusers will read from `folder`, checked before it reads it."""
    import diffusers

    path = folder / "model_index.json"
    name = index["_class_name"]
    pipeline = getattr(diffusers, name, None)
    if not (isinstance(pipeline, type) and issubclass(pipeline, diffusers.DiffusionPipeline)):
        close = difflib.get_close_matches(name, [n for n in dir(diffusers) if n.endswith("Pipeline")], n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ModelError(
            f"{path}: _class_name '{name}' is not a diffusers pipeline{hint}; set it to the pipeline class "
            "the folder was saved with, or re-download the pipeline"
        )
    for component, entry in index.items():
        if component.startswith("_") or not (isinstance(entry, list) and len(entry) == 2) or entry[0] is None:
            continue  # config values, and components saved as None
        library, class_name = entry
        if not (isinstance(library, str) and isinstance(class_name, str)):
            raise ModelError(
                f"{path}: component '{component}' must be [library, class], got {json.dumps(entry)}; {REDO}"
            )
        cls = _component_class(folder, path, component, library, class_name)
        _check_component(folder, component, f"{library} {class_name}", cls)


def _component_class(folder: Path, path: Path, component: str, library: str, class_name: str) -> type | None:
    """The class diffusers will build `component` from; None where it cannot be judged (custom code)."""
    from diffusers import pipelines
    from diffusers.pipelines import pipeline_loading_utils as utils

    declared = f"['{library}', '{class_name}']"
    if (folder / component / f"{library}.py").is_file():
        return None  # custom code shipped with the component: diffusers decides (and wants trust_remote_code)
    loadable = list(getattr(utils, "LOADABLE_CLASSES", ("diffusers", "transformers")))
    if library in loadable:
        module = importlib.import_module(library)
    elif hasattr(pipelines, library):
        module = getattr(pipelines, library)
    elif library in sys.modules:
        module = sys.modules[library]
    else:
        raise ModelError(
            f"{path}: component '{component}' is {declared}, but '{library}' is not a library diffusers "
            f"loads components from ({', '.join(loadable)}); fix the entry, or re-download the pipeline"
        )
    cls = getattr(module, class_name, None)
    remap = getattr(utils, "_maybe_remap_transformers_class", None)
    if cls is None and library == "transformers" and remap is not None:
        cls = getattr(module, remap(class_name) or class_name, None)
    if not isinstance(cls, type):
        raise ModelError(
            f"{path}: component '{component}' is {declared}, but {library} has no class {class_name}; "
            "fix the entry, or re-download the pipeline"
        )
    return cls


def _check_component(folder: Path, component: str, declared: str, cls: type | None) -> None:
    directory = folder / component
    if not directory.is_dir():
        raise ModelError(
            f"{directory} is missing, but model_index.json lists component '{component}' ({declared}); {REDO}"
        )
    if cls is None:
        return
    config, stem = _config_and_weights(cls)
    if config is not None and not (directory / config).is_file():
        raise ModelError(f"{directory / config} is missing; {REDO}")
    for name in dict.fromkeys(name for name in (config, *EXTRA_JSON) if name is not None):
        if (directory / name).is_file():
            read_json(directory / name)
    if stem is not None:
        _check_weights(directory, stem)


def _config_and_weights(cls: type) -> tuple[str | None, str | None]:
    """The config file `cls` needs and the stem of its weights file (None: it has none)."""
    from diffusers import ConfigMixin, ModelMixin

    if issubclass(cls, ModelMixin):
        return cls.config_name, "diffusion_pytorch_model"
    if issubclass(cls, ConfigMixin):
        return cls.config_name, None  # schedulers and the like
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None, None
    if issubclass(cls, PreTrainedModel):
        return "config.json", "model"
    return None, None  # tokenizers, processors: their files vary, the library checks them


def _check_weights(directory: Path, stem: str) -> None:
    single = directory / f"{stem}.safetensors"
    sharded = directory / f"{stem}.safetensors.index.json"
    if single.is_file():
        _check_safetensors(single)
        return
    if sharded.is_file():
        weight_map = read_json(sharded).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelError(f"{sharded} has no weight_map listing the shards; {REDO}")
        for shard in sorted({str(name) for name in weight_map.values()}):
            if not (directory / shard).is_file():
                raise ModelError(f"{directory / shard} is missing (listed in {sharded.name}); {REDO}")
            _check_safetensors(directory / shard)
        return
    pickles = [f"{stem}.bin", f"{stem}.bin.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"]
    for name in dict.fromkeys(pickles):
        if (directory / name).is_file():
            what = "an index of pickled PyTorch shards" if name.endswith(".json") else "a pickled PyTorch checkpoint"
            raise ModelError(
                f"{directory / name} is {what}, which accel will not load for safety (unpickling can run "
                f"arbitrary code); convert it to safetensors, saved as {single.name} beside it"
            )
    raise ModelError(f"{directory} has no weights: {single.name} is missing; {REDO}")


def _check_safetensors(path: Path) -> None:
    problem = safetensors_problem(path)
    if problem is not None:
        raise ModelError(f"{path} is not a valid safetensors file ({problem}); re-download or re-save it")


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a readable safetensors file, from its header alone; None if it looks whole."""
    with path.open("rb") as file:
        head = file.read(8)
        problem = _header_problem(file, head, path.stat().st_size)
    if problem is not None and head.startswith(PICKLE_MAGIC):
        return "it is a pickled PyTorch file, which accel will not load"  # a header's length may start so too
    return problem


def _header_problem(file: Any, head: bytes, size: int) -> str | None:
    if len(head) < 8:
        return f"it is {size} bytes, too short to hold a header"
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER:
        return f"its header length {length} is implausible"
    if 8 + length > size:
        return f"truncated: its {length}-byte header runs past the end of the {size}-byte file"
    try:
        header = json.loads(file.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "its header is not valid JSON"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return f"tensor '{name}' has a malformed header entry"
        end = max(end, offsets[1])
    held = size - 8 - length
    if end > held:
        return f"truncated: its tensors need {end} bytes of data but the file holds {held}"
    if end < held:
        return f"{held - end} unexpected bytes follow the tensor data"
    return None
