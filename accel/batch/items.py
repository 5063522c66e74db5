"""A requests file: one JSON object per line, the fields of the endpoint the pipeline answers
(`POST /v1/images/generations` or `/v1/videos`), or OpenAI's batch-file line wrapping them
(`{"custom_id", "method", "url", "body"}`).

Each line is an item named by its `custom_id` (its output files take that name) or, without one,
by its line number. An item is also known by a digest of its request, so a line edited between two
runs is a new item, not one already done. A line that is not such an object is a `BadLine` with
its number; it never stops the others (unless the caller refuses the file for it).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from accel.serve.requests import ImageRequest, VideoRequest, validation_message

# The endpoints an OpenAI batch line may name, by the output they make.
URLS = {"/v1/images/generations": "image", "/v1/videos": "video", "/v1/videos/generations": "video"}
# A custom_id becomes a file name: letters, digits and . _ - only, not starting with a dot.
CUSTOM_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")
LINE_WIDTH = 6  # an item without custom_id is named by its line number, zero-padded: 000042


@dataclass(frozen=True)
class Item:
    line: int  # 1-based, as an editor shows it
    key: str  # custom_id, else the zero-padded line number: the output files' name
    body: dict[str, Any]  # the endpoint's fields
    digest: str  # of the body: a changed request is a new item
    kind: str | None = None  # "image" / "video" where the line's url says

    def request(self, kind: str) -> ImageRequest | VideoRequest:
        """The body as the `kind` endpoint checks it; ValueError with the server's words where it is not one."""
        if self.kind is not None and self.kind != kind:
            raise ValueError(f"url asks for {self.kind}s; this pipeline makes {kind}s")
        model = VideoRequest if kind == "video" else ImageRequest
        try:
            return model.model_validate(self.body)
        except ValidationError as error:
            raise ValueError(validation_message(error.errors()).message) from None  # type: ignore[arg-type]


@dataclass(frozen=True)
class BadLine:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def read_items(path: Path, kind: str | None = None) -> tuple[list[Item], list[BadLine]]:
    """Every line of `path` as an item or a bad line; blank lines are neither. With `kind` known
    (before loading, from the model's registry entry), the fields are checked too."""
    items: list[Item] = []
    bad: list[BadLine] = []
    seen: dict[str, int] = {}
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                item = _item(number, raw, kind)
            except ValueError as problem:
                bad.append(BadLine(number, str(problem)))
                continue
            if item.key in seen:
                bad.append(
                    BadLine(number, f"custom_id {item.key!r} is also line {seen[item.key]}'s; give each its own")
                )
                continue
            seen[item.key] = number
            items.append(item)
    return items, bad


def strict_refusal(path: Path, bad: list[BadLine]) -> str:
    """`--strict`'s one line for a file with bad lines: the first, and how many more."""
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return f"{path} {bad[0]}{more}; fix the file, or run without --strict to skip such lines"


def _item(number: int, raw: bytes, kind: str | None) -> Item:
    try:
        line = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"not JSON ({_json_reason(error)})") from None
    if not isinstance(line, dict):
        raise ValueError(f"a JSON object of the request's fields, not {type(line).__name__}")
    line = dict(line)
    custom_id = line.pop("custom_id", None)
    wrapped_kind = None
    if "body" in line:  # OpenAI's batch-file line
        body, method, url = line.pop("body"), line.pop("method", "POST"), line.pop("url", None)
        if line:
            raise ValueError(f"{sorted(line)[0]}: not a field of a batch line (custom_id, method, url, body)")
        if not isinstance(body, dict):
            raise ValueError("body: a JSON object of the request's fields")
        if method != "POST":
            raise ValueError(f"method: only POST, not {method!r}")
        if url is not None:
            if url not in URLS:
                raise ValueError(f"url: one of {', '.join(URLS)}, not {url!r}")
            wrapped_kind = URLS[url]
        line = body
    if custom_id is None:
        key = f"{number:0{LINE_WIDTH}d}"
    elif not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
        raise ValueError(
            f"custom_id: 1 to 100 letters, digits, '.', '_' or '-' (it names the output files), not {custom_id!r}"
        )
    else:
        key = custom_id
    canonical = json.dumps(line, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    item = Item(number, key, line, digest(canonical), wrapped_kind)
    if kind is not None:
        item.request(kind)
    return item


def digest(text: str) -> str:
    """The short digest that tells one request (and what made it) from another."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _json_reason(error: Exception) -> str:
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} at column {error.colno}"
    return "not UTF-8 text"
