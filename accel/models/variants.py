"""Pipeline variants: the other diffusers pipelines of a family's transformer.

A family is its transformer class, so FluxKontextPipeline or QwenImageEditPipeline get every
accelerator the base pipeline has; what differs is the call: an input image, a mask, a video. This module
picks the variant (`[model] pipeline`, or the class a repo loads as), says what it makes, and checks the
components it needs; accel/models/input_checks.py checks its inputs before any rank starts and
accel/models/input_files.py opens them for the call. No torch at import: it runs in the launcher's preflight.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from accel.errors import UserError
from accel.models.base import OUTPUT_FILES, Family, OutputKind
from accel.models.variant_format import Variant


def variant_of(family: Family, pipeline_class: str) -> Variant:
    """The family's entry for `pipeline_class` (the base pipeline, unless listed: a variant with no inputs)."""
    for variant in family.variants:
        if variant.pipeline_class == pipeline_class:
            return variant
    if pipeline_class == family.pipeline_class:
        return Variant(pipeline_class)
    known = ", ".join(family.pipeline_classes)
    raise UserError(
        f"[model] pipeline: {pipeline_class} is not a pipeline accel runs for {family.title} "
        f"({family.transformer_class}); use one of {known}, or build it in your own script and call accel.apply"
    )


def variant_of_class(family: Family, cls: type) -> Variant:
    """The variant a loaded pipeline is (its class or the nearest listed base class). A pipeline
    class accel does not list (a user's own) gets no input keywords: it is called as the base one."""
    names = [klass.__name__ for klass in cls.__mro__]
    for name in names:
        if name in family.pipeline_classes:
            return variant_of(family, name)
    return Variant(cls.__name__)


def made_by(family: Family, pipeline_class: str) -> tuple[str, OutputKind]:
    """What `pipeline_class` makes, and the name a message gives its maker: the family's title, or
    the pipeline class where it makes another kind than the family (Kandinsky 5's image pipelines)."""
    kind = family.output_of(pipeline_class)
    return (family.title if kind == family.output else pipeline_class), kind


def planned_output(family: Family, pipeline: str | None) -> tuple[str, OutputKind]:
    """`made_by` for the pipeline a run asks for (`[model] pipeline`, else the family's own)."""
    return made_by(family, variant_of(family, pipeline or family.pipeline_class).pipeline_class)


def check_out_suffix(out: Path, maker: str, kind: OutputKind) -> None:
    """`--out` must end in a suffix accel writes this kind of output as (OUTPUT_FILES); else one line
    naming each accepted one (an HDR video's two: the .npy frames, the .mp4 preview)."""
    noun, files = OUTPUT_FILES[kind]
    if out.suffix.lower() not in [suffix for suffix, _ in files]:
        endings = files[0][0] if len(files) == 1 else " or ".join(f"{suffix} ({what})" for suffix, what in files)
        raise UserError(f"--out {out}: {maker} makes {noun}, so the name must end in {endings}")


def component_folders(variant: Variant, given: Mapping[str, str], converted: bool) -> dict[str, str]:
    """`[model] components` checked against what the variant needs beyond the family's checkpoint:
    a name it does not take, a folder that is not there, or, where the model is `converted` to the
    variant (not saved as it, nor its tiny builder), a missing one that cannot be built without
    weights, is one line before loading."""
    declared = {component.name: component for component in variant.components}
    for name, folder in given.items():
        if name not in declared:
            takes = f"it takes {', '.join(declared)}" if declared else "it needs none besides the model's"
            raise UserError(f"[model] components: {variant.pipeline_class} takes no component {name} ({takes})")
        if not Path(folder).expanduser().is_dir():
            raise UserError(
                f"[model] components: {name}: {folder} is not a folder; pass the folder a "
                f"{declared[name].cls.rpartition('.')[2]} "
                "was saved to (save_pretrained)"
            )
    for component in variant.components:
        if converted and component.build is None and component.name not in given:
            cls = component.cls.rpartition(".")[2]
            raise UserError(
                f"{variant.pipeline_class} needs a {component.name} ({cls}) the model does not hold: pass --component "
                f"{component.name}=FOLDER ([model] components), the folder it was saved to"
            )
    return {name: str(Path(folder).expanduser()) for name, folder in given.items()}
