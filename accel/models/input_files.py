"""The input files of a pipeline call: plain data (paths, JSON, agreed across ranks) from the checks
before any rank starts (accel/models/input_checks.py) until the call, where `open_inputs` opens them as
the pipelines take them. No torch at import (only a latent pass's .pt file is read with torch, when one
is given)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from accel.models.variant_format import Conditions, NamedInput


class InputImage(str):
    """A path the pipeline call receives as a PIL image: it stays a path (and JSON) until the call."""


class InputVideo(str):
    """A path the pipeline call receives as a list of RGB PIL frames (diffusers' video input)."""


class InputImages(tuple):  # type: ignore[type-arg]
    """Pictures the call receives as one list (InputImage paths), opened by `open_inputs`."""


class InputVideos(InputVideo):
    """A clip the call receives as the only item of a list of clips (LTX's conditioning videos)."""


class InputLatents(str):
    """A latent .pt file an earlier pass saved: plain data (a path) until the call, when `open_inputs`
    puts its fields under the call keywords `spec` names."""

    spec: NamedInput


def latents_input(path: str, spec: NamedInput) -> InputLatents:
    made = InputLatents(path)
    made.spec = spec
    return made


# What `--out NAME.pt` writes: the fields of a pipeline's latent output, marked as accel's, with the pipeline that made
# them.
LATENTS_MARK = "accel latents"


def load_latents(path: str) -> dict[str, Any]:
    """A latent .pt file as saved (torch.load with weights only: tensors and plain values, no code)."""
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def latent_settings(path: InputLatents) -> dict[str, Any]:
    """The call keywords the saved fields fix (the canvas they hold), as the input's spec says."""
    spec = path.spec
    return dict(spec.settings(load_latents(path)["fields"])) if spec.settings is not None else {}


class FrameMask(str):
    """A picture the call receives once per frame of its input video (VACE's per-frame mask)."""


class InputConditions(tuple):  # type: ignore[type-arg]
    """(file, index, strength) per condition, the file an InputImage or an InputVideo: plain data (JSON,
    rank agreement) until the call, when `open_inputs` builds the pipeline's condition objects as
    `spec` says."""

    spec: Conditions
    tiny: bool

    def __new__(
        cls, items: list[tuple[InputImage | InputVideo, int, float]], spec: Conditions, tiny: bool
    ) -> InputConditions:
        made = super().__new__(cls, items)
        made.spec, made.tiny = spec, tiny
        return made


def clip_frames(path: str) -> int:
    """How many frames the video at `path` holds (RuntimeError or OSError if ffmpeg cannot read it)."""
    stat = Path(path).stat()
    return _count_frames(path, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=8)
def _count_frames(path: str, _mtime_ns: int, _size: int) -> int:
    """ffmpeg decodes the file once per version of it (the preflight check, then the frame count)."""
    import imageio_ffmpeg

    return int(imageio_ffmpeg.count_frames_and_secs(path)[0])


def read_clip(path: str) -> list[Any]:
    """The video's frames as RGB PIL images, in order."""
    from PIL import Image

    from accel.media import read_video

    return [Image.fromarray(frame) for frame in read_video(Path(path))]


def _rgb(path: str) -> Any:
    """The picture at `path` as an RGB PIL image, the file closed."""
    from PIL import Image

    with Image.open(path) as picture:
        return picture.convert("RGB")


def open_inputs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments with every input file opened as the pipelines take it: an InputImage as
    an RGB PIL image, an InputVideo as a list of them (InputVideos: that list inside a list), a
    FrameMask as its picture once per frame of the call's input video, InputImages as a list of
    pictures."""
    opened = dict(kwargs)
    for key, value in kwargs.items():
        if isinstance(value, (InputImage, FrameMask)):
            opened[key] = _rgb(value)
        elif isinstance(value, InputImages):
            opened[key] = [_rgb(path) for path in value]
        elif isinstance(value, InputVideo):
            opened[key] = read_clip(value)
        elif isinstance(value, InputConditions):
            opened[key] = [_condition(value.spec, file, index, strength, value.tiny) for file, index, strength in value]
        elif isinstance(value, InputLatents):
            fields = load_latents(value)["fields"]
            del opened[key]
            opened.update({keyword: fields[field] for field, keyword in value.spec.fields})
    frames = max((len(opened[key]) for key, value in kwargs.items() if isinstance(value, InputVideo)), default=1)
    for key, value in kwargs.items():
        if isinstance(value, FrameMask):
            opened[key] = [opened[key]] * frames
        elif isinstance(value, InputVideos):
            opened[key] = [opened[key]]
    return opened


def _condition(spec: Conditions, file: InputImage | InputVideo, index: int, strength: float, tiny: bool) -> Any:
    """One condition of the pipeline's class from a picture file (an RGB image) or a clip (its frames)."""
    from PIL import Image

    if isinstance(file, InputVideo):
        return condition_object(spec, read_clip(file), index, strength, tiny)
    with Image.open(file) as picture:
        return condition_object(spec, picture.convert("RGB"), index, strength, tiny)


def condition_object(spec: Conditions, content: Any, index: int, strength: float, tiny: bool) -> Any:
    """The pipeline's condition object for a picture (a PIL image) or a clip (a list of them)."""
    import importlib

    module, _, name = spec.cls.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    field = spec.video if isinstance(content, list) and spec.video else spec.frames
    position = {spec.index: index} if spec.index else {}
    return cls(**{field: content, **position, spec.strength: strength}, **dict(spec.tiny if tiny else ()))


def takes_files(kwargs: dict[str, Any]) -> bool:
    """Whether a call's keyword arguments (generation_kwargs) hold input files from the recipe."""
    return any(
        isinstance(value, (InputImage, InputVideo, InputImages, InputLatents, InputConditions))
        for value in kwargs.values()
    )
