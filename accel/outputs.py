"""What a run writes: --out checked before the load, the output written whole (a picture, a video with
its sound, a latent pass's fields), and the sizes it came out at."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from accel.errors import UserError
from accel.files.publish import write_file, write_fresh
from accel.media import Audio, output_writer
from accel.models.base import OUTPUT_FILES, OutputKind
from accel.models.variants import check_out_suffix


LATENT_SUFFIX = ".pt"


def _suffix(kind: OutputKind) -> str:
    """The suffix of a name accel picks itself for this kind of output."""
    return OUTPUT_FILES[kind][1][0][0]


def saves_latents(out: Path | None) -> bool:
    """Whether --out names a latent pass's file (.pt), not a picture or video."""
    return out is not None and out.suffix.lower() == LATENT_SUFFIX


def check_out(out: Path | None, overwrite: bool, made: tuple[str, OutputKind] | None, variant: Any = None) -> None:
    """Refuse a bad --out before the (possibly long) load, not after the generation; `made` is
    `made_by`'s (maker, kind), None while the model's family is not known yet. A .pt name saves
    the latents of a variant that hands them on (its `latent_output`)."""
    if out is None:
        return
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; pass --overwrite to replace it or choose another --out")
    if saves_latents(out) and made is not None and not (variant is not None and variant.latent_output):
        raise UserError(
            f"--out {out}: {variant.pipeline_class if variant else made[0]} hands on no latents, so the name must end "
            "in "
            f"{_suffix(made[1])}"
        )
    if made is not None and not saves_latents(out):
        check_out_suffix(out, *made)


def write_output(
    name: str,
    fps: float,
    kind: OutputKind,
    out: Path | None,
    overwrite: bool,
    output: np.ndarray | dict[str, Any],
    audio: Audio | None = None,
) -> Path:
    """Write the output whole (accel.files), with its sound where it has some: to `out` as given
    (replaced only with --overwrite), else to a fresh name under outputs/ taken exclusively; a latent
    pass's fields with torch.save. Returns the path written."""
    suffix = out.suffix if out is not None else _suffix(kind)  # an HDR video: its .npy frames or .mp4 preview
    if isinstance(output, dict):
        write = functools.partial(torch.save, output)
    else:
        write = output_writer(output, kind, suffix, fps, audio)
    if out is not None:
        return write_file(out, write, replace=overwrite, hint="pass --overwrite to replace it or choose another --out")
    return write_fresh(Path("outputs"), Path(name).name or "output", suffix, write)


def first_free(folder: Path, stem: str, suffix: str = "") -> Path:
    """folder/stem+suffix, or the first of stem-1, stem-2, … not taken now. Only a guess: another
    run may take it next; accel.files.publish.write_fresh / accel.files.folders.fresh_folder take a name exclusively."""
    candidate, index = folder / f"{stem}{suffix}", 1
    while candidate.exists():
        candidate, index = folder / f"{stem}-{index}{suffix}", index + 1
    return candidate


def written_size(output: np.ndarray | dict[str, Any]) -> tuple[int, int, int] | None:
    """(width, height, frames) of a picture (H, W, C) or video (F, H, W, C) output; None for latents."""
    if not isinstance(output, np.ndarray):
        return None
    return int(output.shape[-2]), int(output.shape[-3]), int(output.shape[0]) if output.ndim == 4 else 1


def size_notes(
    call: Mapping[str, Any], written: tuple[int, int, int] | None, frames_arg: str | None, frames_as_asked: bool
) -> list[str]:
    """A size the pipeline changed on the way (one Family.size_step does not foresee): said, not silent."""
    if written is None:
        return []
    asked = [("width", call.get("width"), written[0]), ("height", call.get("height"), written[1])]
    if frames_arg is not None and frames_as_asked:
        asked.append(("frames", call.get(frames_arg), written[2]))
    return [
        f"{key}: {value} asked, {made} made (the pipeline rounds it)"
        for key, value, made in asked
        if isinstance(value, int) and value != made
    ]
