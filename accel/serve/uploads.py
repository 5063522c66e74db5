"""Pictures a request uploads (an edit's image and mask, a video job's input_reference): read from a
multipart body, kept as files for the ranks to open as `accel run --image` opens one, and checked
as it checks one (a picture Pillow reads, under its decompression-bomb limit) before any work."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fastapi import Request

from accel.errors import UserError
from accel.serve.requests import BadRequest, Served

# Largest number of pictures one request may upload: the most a pipeline combines (FLUX.2's ten) and a mask.
MAX_PICTURES = 11


# The fields holding an object (name -> value), which a form sends as NAME[KEY]=VALUE or as JSON text.
OBJECT_FIELDS = ("lora",)
OBJECT_ENTRY = re.compile(rf"({'|'.join(OBJECT_FIELDS)})\[([^\[\]]+)\]")


async def request_fields(request: Request, files: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The fields of a JSON or multipart body, and the uploads of the file fields `files` (a field
    sent as a list, `image[]`, counts as `image`)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "multipart/form-data":
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise BadRequest(None, "the body must be a JSON object in UTF-8 (or multipart/form-data)") from None
        if not isinstance(body, dict):
            raise BadRequest(None, "the body must be a JSON object")
        return body, {}
    form = await request.form()
    fields: dict[str, Any] = {}
    uploads: dict[str, list[Any]] = {}
    for key, value in form.multi_items():
        name = key.removesuffix("[]")
        if isinstance(value, str):
            if name in files:
                raise BadRequest(name, f"{name}: a file, not text")
            if (entry := OBJECT_ENTRY.fullmatch(key)) is not None:  # lora[pixel]=0.8, as the openai client sends a dict
                fields.setdefault(entry[1], {})[entry[2]] = value
            elif key in OBJECT_FIELDS and value.lstrip().startswith("{"):  # or the object as JSON text
                try:
                    fields[key] = json.loads(value)
                except ValueError:
                    raise BadRequest(key, f"{key}: a JSON object, or {key}[NAME]=VALUE fields") from None
            else:
                fields[key] = value
        elif name in files:
            uploads.setdefault(name, []).append(value)
        else:
            raise BadRequest(key, f"{key}: not a file field (the file fields are {', '.join(files)})")
    if sum(len(found) for found in uploads.values()) > MAX_PICTURES:
        raise BadRequest(None, f"at most {MAX_PICTURES} pictures a request")
    return fields, uploads


def save_picture(upload: Any, path_stem: Path) -> Path:
    """The upload as a file next to `path_stem`, with its own suffix (Pillow reads by content)."""
    suffix = "".join(c for c in Path(upload.filename or "").suffix.lower()[:8] if c.isalnum() or c == ".") or ".png"
    path = path_stem.with_name(path_stem.name + suffix)
    path.write_bytes(upload.file.read())
    return path


def check_pictures(served: Served, pictures: dict[str, Path], variant: Any) -> None:
    """The saved uploads, by input name (image, mask), as the pipeline chosen for them (`variant`,
    the served one or a sibling) takes them: one it takes no such input for, or one Pillow cannot
    read, is a BadRequest naming the field."""
    from accel.models.input_checks import readable_picture

    for name, path in pictures.items():
        if variant is None or getattr(variant, name) is None:
            owner = f"{served.name}'s pipeline" if variant is served.variant else variant.pipeline_class
            raise BadRequest(name, f"{name}: {owner} takes no {name}")
        try:
            readable_picture(name, str(path))
        except UserError as bad:
            message = str(bad).replace(str(path), "the upload").replace(f"[generate] {name}", name)
            raise BadRequest(name, message) from None


def pipelines_that_do(served: Served, output: str) -> str:
    """The refusal's hint naming the served family's pipelines that take a picture and make `output`."""
    family = served.family
    takes = [
        v.pipeline_class
        for v in family.variants
        if v.image is not None and family.output_of(v.pipeline_class) == output
    ]
    return f"serve one that does ({', '.join(takes) or f'no {family.title} pipeline does'})"
