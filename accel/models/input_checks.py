"""The inputs a run passes (input files, conditions, named inputs, `[generate] arguments`), checked
against the pipeline variant before any rank starts, one line naming the flag where one is wrong, and
made the call's keyword arguments (plain data until the call opens them: accel/models/input_files.py).
No torch at import: it runs in the launcher's preflight."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from accel.errors import UserError
from accel.models.input_files import (
    FrameMask,
    InputConditions,
    InputImage,
    InputImages,
    InputVideo,
    InputVideos,
    LATENTS_MARK,
    clip_frames,
    latents_input,
    load_latents,
)
from accel.models.variant_format import Conditions, NamedInput, Variant

# What each input is called on the command line and in the recipe.
FLAGS = {
    "image": "--image PATH ([generate] image)",
    "mask": "--mask PATH ([generate] mask)",
    "video": "--video PATH ([generate] video)",
}


def input_arguments(variant: Variant, image: str | None, mask: str | None, video: str | None = None) -> dict[str, str]:
    """The call's keyword arguments for the input files; a missing required one, one the pipeline
    does not take, or a file that cannot be read, is one line naming the flag."""
    arguments: dict[str, str] = {}
    for name, keyword, path in (
        ("image", variant.image, image),
        ("mask", variant.mask, mask),
        ("video", variant.video, video),
    ):
        if keyword is None and path is not None:
            raise UserError(f"[generate] {name}: {variant.pipeline_class} takes no {name}; remove --{name}")
        if keyword is not None and path is None and name not in variant.optional:
            raise UserError(f"{variant.pipeline_class} needs an input {name}: pass {FLAGS[name]}")
        if keyword is None or path is None:
            continue
        if name == "video":
            arguments[keyword] = (InputVideos if name in variant.in_list else InputVideo)(_readable_video(name, path))
        elif name == "mask" and variant.mask_frames:
            arguments[keyword] = _frame_mask(variant, path, video)
        else:
            arguments[keyword] = InputImage(_readable_image(name, path))
    return arguments


# The flag of each input a variant may take only one of (`Variant.one_of`), by its recipe key.
_ONE_OF_FLAGS = {"image": "--image", "mask": "--mask", "video": "--video", "conditions": "--condition"}


def refuse_together(variant: Variant, given: Mapping[str, Any]) -> None:
    """One line where a call gets two of the inputs a variant takes only one of (LTX's condition
    pipeline: a picture, a clip or condition objects), rather than the pipeline dropping one."""
    both = [name for name in variant.one_of if given.get(name)]
    if len(both) > 1:
        flags = ", ".join(_ONE_OF_FLAGS[name] for name in variant.one_of)
        raise UserError(f"[generate] {both[-1]}: {variant.pipeline_class} takes one of {flags}, not several; keep one")


def named_input_arguments(variant: Variant, given: Mapping[str, str], arguments: Mapping[str, Any]) -> dict[str, str]:
    """The call's keyword arguments for the variant's own input files (`--input KEYWORD=PATH`): a
    keyword it does not take, a missing required one, or an unreadable file is one line."""
    declared = {spec.keyword: spec for spec in variant.inputs}
    flagged = {
        keyword: name
        for name, keyword in (("image", variant.image), ("mask", variant.mask), ("video", variant.video))
        if keyword
    }
    for keyword in given:
        if keyword in flagged:
            raise UserError(
                f"[generate] inputs: {variant.pipeline_class} takes its {keyword} from {FLAGS[flagged[keyword]]}; use "
                "that instead"
            )
        if keyword not in declared:
            takes = (
                f"it takes {', '.join(declared)}" if declared else "it takes none besides --image / --mask / --video"
            )
            raise UserError(f"[generate] inputs: {variant.pipeline_class} takes no input {keyword} ({takes})")
    opened: dict[str, str] = {}
    for spec in variant.inputs:
        path = given.get(spec.keyword)
        if path is None:
            if _required(spec, arguments):
                condition = f" when {spec.when[0]} is {spec.when[1]!r}" if spec.when else ""
                raise UserError(
                    f"{variant.pipeline_class} needs an input {spec.keyword}{condition}: pass --input "
                    f"{spec.keyword}=PATH "
                    f"([generate] inputs), {_KINDS[spec.kind](spec)}"
                )
            continue
        name = f"inputs {spec.keyword}"
        if spec.kind == "latents":
            opened[spec.keyword] = latents_input(_readable_latents(name, path, spec), spec)
        else:
            opened[spec.keyword] = (
                InputVideo(_readable_video(name, path))
                if spec.kind == "video"
                else InputImage(_readable_image(name, path))
            )
    return opened


# What each kind of named input is, for the line a missing or wrong one gets.
_KINDS = {
    "image": lambda _spec: "an image file",
    "video": lambda _spec: "a video file",
    "latents": lambda spec: f"the .pt file `accel run --pipeline {spec.made_by[0]} --out NAME.pt` wrote",
}


def _readable_latents(name: str, path: str, spec: NamedInput) -> str:
    """A .pt file `--out NAME.pt` wrote, holding every field the input takes; anything else is one line."""
    file = Path(path).expanduser()
    expected = _KINDS["latents"](spec)
    if file.suffix.lower() != ".pt":
        raise UserError(f"[generate] {name}: {path} is not a latent pass (.pt); pass {expected}")
    if not file.is_file():
        raise UserError(f"[generate] {name}: {path} does not exist; pass {expected}")
    try:
        saved = load_latents(str(file))
    except Exception:  # noqa: BLE001 - torch raises many kinds for a file that is no checkpoint; its text suggests unpickling
        raise UserError(
            f"[generate] {name}: {path} is not a file of tensors torch can load safely (weights only); pass {expected}"
        ) from None
    fields = saved.get("fields") if isinstance(saved, dict) and saved.get("kind") == LATENTS_MARK else None
    missing = [field for field, _ in spec.fields if not isinstance(fields, dict) or field not in fields]
    if missing or saved.get("pipeline") not in spec.made_by:
        made = " or ".join(spec.made_by)
        raise UserError(f"[generate] {name}: {path} is not the latent output of a {made} pass; pass {expected}")
    return str(file)


def condition_arguments(
    variant: Variant, given: tuple[str, ...], tiny: bool, key: str = "conditions"
) -> dict[str, InputConditions]:
    """`--condition PATH@INDEX:STRENGTH` (`key` "conditions") or `--reference PATH@STRENGTH` ("references")
    as the call's condition objects: a pipeline that takes none, a bad index or strength, or an
    unreadable file is one line naming the key."""
    spec = variant.conditions if key == "conditions" else variant.references
    if not given:
        if spec is not None and spec.required:
            form = "PATH@INDEX:STRENGTH" if spec.index else "PATH@STRENGTH"
            raise UserError(
                f"{variant.pipeline_class} needs {'a condition' if key == 'conditions' else 'a reference video'}: "
                f"pass --{key.removesuffix('s')} {form} ([generate] {key})"
            )
        return {}
    if spec is None:
        raise UserError(f"[generate] {key}: {variant.pipeline_class} takes no {key}; remove --{key.removesuffix('s')}")
    items = []
    for text in given:
        path, index, strength = _parse_condition(text, spec, key)
        items.append((_picture_or_clip(key, path), index, strength))
    return {spec.keyword: InputConditions(items, spec, tiny)}


def picture_list(variant: Variant, first: Any, more: tuple[str, ...]) -> InputImages:
    """`--image` and each `--reference PATH` as the one list of pictures the call's `image` takes."""
    if first is None:
        raise UserError(
            f"[generate] references: {variant.pipeline_class} takes them after the first picture; pass --image too"
        )
    if 1 + len(more) > variant.pictures:
        raise UserError(
            f"[generate] references: {variant.pipeline_class} takes at most {variant.pictures} pictures (--image and "
            f"{variant.pictures - 1} --reference), got {1 + len(more)}"
        )
    return InputImages([first, *(InputImage(_readable_image("references", path)) for path in more)])


def _parse_condition(text: str, spec: Conditions, key: str) -> tuple[str, int, float]:
    """PATH@INDEX:STRENGTH, or PATH@STRENGTH where the class has no position (IC-LoRA's references)."""
    path, at, position = text.rpartition("@")
    if not at:
        return text, 0, 1.0
    index_text, colon, strength_text = position.partition(":") if spec.index else ("0", ":", position)
    form = (
        f"PATH@INDEX:STRENGTH, INDEX a whole number ({spec.units}), STRENGTH from 0 to 1, e.g. end.png@-1:0.8"
        if spec.index
        else "PATH@STRENGTH, STRENGTH from 0 to 1, e.g. depth.mp4@0.9"
    )
    try:
        index = int(index_text)
        strength = float(strength_text) if colon else 1.0
    except ValueError:
        raise UserError(f"[generate] {key}: {text}: write {form}") from None
    if not 0 <= strength <= 1:
        raise UserError(f"[generate] {key}: {text}: the strength must be from 0 to 1, got {strength_text}")
    return path, index, strength


def _required(spec: NamedInput, arguments: Mapping[str, Any]) -> bool:
    return spec.required and (spec.when is None or arguments.get(spec.when[0]) == spec.when[1])


# Keywords accel gives every call itself: a recipe argument cannot replace them.
_CALL_OWN = ("generator", "output_type", "return_dict", "callback_on_step_end", "callback_on_step_end_tensor_inputs")


def call_arguments(
    pipeline: type, arguments: Mapping[str, Any], taken: Mapping[str, Any], settings_of: Mapping[str, str]
) -> dict[str, Any]:
    """`[generate] arguments` checked against the pipeline's call: a keyword it does not take, or one
    accel already fills (`taken`, whose recipe key `settings_of` names), is one line."""
    import inspect

    parameters = inspect.signature(pipeline.__call__).parameters
    open_ended = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    checked: dict[str, Any] = {}
    for keyword, value in arguments.items():
        if keyword in _CALL_OWN:
            raise UserError(f"[generate] arguments: accel sets {keyword} for every call; remove it")
        if keyword in taken:
            source = settings_of.get(keyword)
            where = f"set it with [generate] {source}" if source else "it follows from the other [generate] keys"
            raise UserError(f"[generate] arguments: {keyword} is one accel fills itself; {where}")
        if keyword not in parameters and not open_ended:
            names = [name for name in parameters if name != "self" and name not in _CALL_OWN]
            close = difflib.get_close_matches(keyword, names, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UserError(f"[generate] arguments: {pipeline.__name__} takes no argument {keyword}{hint}")
        checked[keyword] = list(value) if isinstance(value, tuple) else value
    return checked


def _frame_mask(variant: Variant, path: str, video: str | None) -> str:
    """A per-frame mask: a picture for every frame, or a video of masks; it needs the input video."""
    if video is None:
        raise UserError(
            f"[generate] mask: {variant.pipeline_class} takes a mask only with an input video; pass {FLAGS['video']}"
        )
    found = _picture_or_clip("mask", path)
    return FrameMask(found) if isinstance(found, InputImage) else found


def _picture_or_clip(name: str, path: str) -> InputImage | InputVideo:
    """A file that is a picture, else a video ffmpeg can read; anything else is one line naming `name`."""
    file = Path(path).expanduser()
    if file.is_file() and _is_picture(file, name):
        return InputImage(str(file))
    return InputVideo(_readable_video(name, path, "a picture or a video"))


def _is_picture(file: Path, name: str = "image") -> bool:
    from PIL import UnidentifiedImageError

    try:
        _verify_picture(file, name, str(file))
    except (UnidentifiedImageError, OSError, SyntaxError):
        return False
    return True


def readable_picture(name: str, path: str) -> str:
    """`path` if it is a picture Pillow reads, under its decompression-bomb limit; else a UserError
    naming `[generate] name` (accel serve checks uploads with it)."""
    return _readable_image(name, path)


def _readable_image(name: str, path: str) -> str:
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"[generate] {name}: {path} does not exist; pass an image file (PNG, JPEG, WebP, …)")
    from PIL import UnidentifiedImageError

    try:
        _verify_picture(file, name, path)
    except (UnidentifiedImageError, OSError, SyntaxError) as error:
        raise UserError(f"[generate] {name}: {path} is not an image Pillow can read ({error})") from None
    return str(file)


def _verify_picture(file: Path, name: str, path: str) -> None:
    """Read the picture's header and check its data without decoding it; one whose pixel count passes
    Pillow's decompression-bomb limit (Image.MAX_IMAGE_PIXELS, about 89 million: 9459²) is refused
    here, from its header, before anything decodes it."""
    import warnings

    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(file) as picture:
                width, height = picture.size
                if limit is not None and width * height > limit:
                    raise Image.DecompressionBombError(f"{width}×{height}")
                picture.verify()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise UserError(
                f"[generate] {name}: {path} has more than {limit:,} pixels (Pillow's decompression-bomb "
                "limit); pass a smaller image"
            ) from None


def _readable_video(name: str, path: str, kind: str = "a video file (MP4, WebM, …)") -> str:
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"[generate] {name}: {path} does not exist; pass {kind}")
    try:
        frames = clip_frames(str(file))
    except (RuntimeError, OSError) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise UserError(
            f"[generate] {name}: {path} is not a video ffmpeg can read ({lines[-1] if lines else type(error).__name__})"
        ) from None
    if frames == 0:
        raise UserError(f"[generate] {name}: {path} holds no video frames; pass {kind}")
    return str(file)
