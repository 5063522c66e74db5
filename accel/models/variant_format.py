"""What a family says about the other pipelines of its transformer (`Variant`): their inputs
(`NamedInput`, `Conditions`), the components they need (`Component`), their own plans and outputs.
accel/models/variants.py, input_checks.py and input_files.py read them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from accel.models.base import GenerationDefaults, OutputKind
from accel.parallel.plan_format import FromDiffusers, ParallelPlan

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline


@dataclass(frozen=True)
class NamedInput:
    """An input file a variant's call takes under a keyword of its own, which `--input KEYWORD=PATH`
    (`[generate] inputs`) fills: Wan Animate's pose and face videos, CogVideoX Fun's control video.
    The call receives a "video" as a list of RGB PIL frames, an "image" as one RGB PIL image.
    `when` = (argument, value) makes a required input required only for calls with that argument
    (Animate's background video, needed when `mode` is "replace").

    A "latents" input is the latent output an earlier pass saved (`--out NAME.pt` on a variant with
    `latent_output`), for a multi-pass workflow: `fields` says which saved output field goes to which
    call keyword, `made_by` names the pipelines whose output it takes (for the error a wrong file
    gets), and `settings` gives the call keywords the fields fix (the size of the canvas they hold),
    which accel passes and a recipe may not contradict."""

    keyword: str
    kind: Literal["image", "video", "latents"]
    required: bool = True
    when: tuple[str, Any] | None = None
    fields: tuple[tuple[str, str], ...] = ()
    made_by: tuple[str, ...] = ()
    settings: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None


@dataclass(frozen=True)
class Component:
    """A component a variant's pipeline needs that the family's checkpoints do not hold: `name` is its
    keyword in the pipeline, `cls` its class (a dotted path), loaded with `from_pretrained` from the
    folder `[model] components` (`--component NAME=FOLDER`) names. `build` makes it without weights
    instead (a scheduler of another class), so no folder is needed. The variant's tiny builder makes
    every one of them itself; a folder given replaces its tiny one."""

    name: str
    cls: str
    build: Callable[[], Any] | None = None


@dataclass(frozen=True)
class Conditions:
    """How a variant takes pictures and clips pinned to positions in the video it makes
    (`--condition PATH@INDEX:STRENGTH`, `[generate] conditions`): the call gets a list under
    `keyword` of diffusers' `cls` objects (a dotted path), each built with the file (one RGB PIL
    image, or a clip as a list of them) under `frames` (under `video` for a clip where the class
    keeps the two apart), the position under `index` (None: the class has none, as IC-LoRA's
    reference videos, given as `--reference PATH@STRENGTH`), the strength under `strength`. `units`
    says what the index counts, for the help and errors; `tiny` are fields only the tiny variant's
    conditions get (LTX-2's `crf=0`, which skips a PyAV re-encode). `required`: a call needs at least
    one (LTX-2 HDR makes an HDR version of its reference clip; without one there is nothing to
    convert), refused in one line before start instead of a run of a video of nothing asked for.
    `sets_frames`: the first one, where it is a clip, gives the call its frame count unless `[generate]
    frames` says otherwise (HDR's output is the clip converted, frame for frame)."""

    cls: str
    units: str
    keyword: str = "conditions"
    frames: str = "frames"
    video: str | None = None
    index: str | None = "index"
    strength: str = "strength"
    tiny: tuple[tuple[str, Any], ...] = ()
    required: bool = False
    sets_frames: bool = False


@dataclass(frozen=True)
class Variant:
    """Another diffusers pipeline class that runs the family's transformer (img2img, inpaint, edit, …).

    `image`, `mask` and `video` are the call's keywords that `--image`, `--mask` and `--video` fill
    (None: the pipeline takes none; a video arrives as a list of PIL frames, as diffusers' video
    pipelines take it); each one named is required unless `optional` lists it ("image": FLUX.2's
    reference pictures). `one_of` names inputs of which a call takes at most one ("image", "mask",
    "video", "conditions": LTX's condition pipeline takes a picture, a clip or condition objects;
    given a picture and a clip, it would drop the clip). `in_list` names inputs the call takes
    inside a list, one item per condition (that pipeline reads `video` as a list of clips, and a
    bare list of frames as that many one-frame clips). `seed` is the call's own seed keyword, which
    accel gives the run's seed besides the generator (LTX's long multi-prompt pipeline seeds every
    temporal window's generator from it, 0 unless told). `mask_frames`: the mask is one per video
    frame (VACE), so `--mask` is a picture used for every frame of `--video`, or a video of masks.
    A family lists its own pipeline class here only to give it inputs. `area` is the keyword by which the pipeline
    rescales
    the size asked to a pixel budget (Kontext's `max_area`, 1024² by default): accel passes
    height x width there, so the size asked is the size made; `fixed` are keyword arguments every
    call gets, for the same reason (Kontext inpaint's `_auto_resize=False`). `tiny` builds the tiny variant where its
    transformer
    needs another config than the family's tiny one (FLUX.1 Fill reads 384 input channels); None:
    the family's tiny pipeline, converted with `from_pipe`. `transformer_class` names the variant's
    own transformer class where it has one (Wan VACE's sibling of WanTransformer3DModel, with the
    same blocks and extra ones): a pipeline holding it is this family, run under `parallel`, that
    class's plan (None: that class runs on one process, or with CFG parallelism alone). `inputs` are
    the call's other input files, each under its own keyword (`NamedInput`); `conditions` how it takes
    pictures and clips at chosen frames (`Conditions`), `references` its reference videos without a
    position (`--reference`).
    `not_split` says why sequence
    parallelism cannot cut this pipeline's transformer calls (its attention processors slice the whole
    sequence by position): Ulysses and Ring are then refused with that reason, every other
    accelerator still applies. `output` is what the pipeline makes where it differs from the
    family's (Kandinsky 5's text-to-image pipeline makes pictures with a video family's transformer):
    accel then writes that kind of file (OUTPUT_FILES) and passes a frame count only to videos; an
    "hdr-video" pipeline (LTX-2 HDR) is called with output_type "np" for its linear float32 frames,
    written as `--out X.npy` whole or `--out X.mp4` as an SDR preview; `vae` names its VAE class where it
    differs from the family's (its parallel decode: accel/models/vaes.py), and `defaults` the settings
    to start from where the family's do not fit it (None: the family's). `transformer_config` are
    (config key, value) pairs the variant's transformer must have (SkyReels-V1 image-to-video reads
    32 input channels): loading another checkpoint as this variant is refused in one line, not a
    shape error mid-run. `latent_output` are the fields of its output that `--out NAME.pt` saves
    (the call then returns latents, `output_type="latent"`), for a later pass's "latents" input
    (`NamedInput`); empty: it hands on no latents. `components` are the components it needs beyond
    the family's checkpoint (`Component`); `fps` the rate its videos play at, from the call's
    arguments, where it differs from the family's (DFR's refine round plays at twice its input's).
    """

    pipeline_class: str
    image: str | None = None
    mask: str | None = None
    video: str | None = None
    mask_frames: bool = False
    area: str | None = None
    fixed: tuple[tuple[str, Any], ...] = ()
    # Keyword arguments only the tiny variant's calls get: LTX-2 image-to-video's `image_crf=0` skips
    # the H.264 re-compression of the picture that matches the real model's training (and needs PyAV).
    tiny_fixed: tuple[tuple[str, Any], ...] = ()
    tiny: Callable[[], DiffusionPipeline] | None = None
    optional: tuple[str, ...] = ()
    one_of: tuple[str, ...] = ()
    in_list: tuple[str, ...] = ()
    seed: str | None = None
    inputs: tuple[NamedInput, ...] = ()
    conditions: Conditions | None = None
    references: Conditions | None = None
    # How many pictures the call's `image` takes, as a list (FLUX.2's and Qwen-Image-Edit-Plus's
    # several references): `--image` is the first, each `--reference PATH` ([generate] references)
    # the next, up to this many in all. 1: one picture.
    pictures: int = 1
    # Call arguments the variant needs a value for, with the one accel gives unless `[generate]
    # arguments` (`--arg`) says otherwise: SkyReels-V2 video extension's `overlap_history`.
    arguments: tuple[tuple[str, Any], ...] = ()
    transformer_class: str | None = None
    parallel: ParallelPlan | FromDiffusers | None = None
    not_split: str | None = None
    output: OutputKind | None = None
    vae: str | None = None
    defaults: GenerationDefaults | None = None
    transformer_config: tuple[tuple[str, Any], ...] = ()
    latent_output: tuple[str, ...] = ()
    components: tuple[Component, ...] = ()
    fps: Callable[[Mapping[str, Any]], float] | None = None
    # The pipeline class whose checkpoint this one runs as it is (img2img and inpaint on the
    # text-to-image weights): a server of either answers the other's requests on the same modules
    # (accel/serve/tasks.py). None: its own checkpoint, or not known to share one.
    same_weights_as: str | None = None


def img2img_and_inpaint(base: str, prefix: str) -> tuple[Variant, Variant]:
    """`{prefix}Img2ImgPipeline` and `{prefix}InpaintPipeline`: what diffusers builds on a text-to-image
    checkpoint (`base`) as it is, taking `image` (and `mask_image`)."""
    return (
        Variant(f"{prefix}Img2ImgPipeline", image="image", same_weights_as=base),
        Variant(f"{prefix}InpaintPipeline", image="image", mask="mask_image", same_weights_as=base),
    )
