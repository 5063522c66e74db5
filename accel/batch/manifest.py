"""What a batch has done, kept in its output folder: the outputs, each published whole under its
item's name (accel/files/publish.py), and one manifest line per outcome, appended with a single
write and synced, after the item's files. A run killed at any point leaves whole outputs and whole
lines (a torn last line is ignored), so a rerun knows exactly which items are done.

Each shard appends to a manifest of its own (`manifest.jsonl`, or `manifest.shard-I-of-N.jsonl`
with --shard), so machines sharing the folder never write one file together; a run reads them all.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from accel.batch.items import Item
from accel.files.claims import process_alive
from accel.files.publish import temporary_owner, write_file

DONE = "done"
FAILED = "failed"


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        """'I/N': this machine takes items I, I + N, I + 2N, … (0 <= I < N) in file order."""
        index, sep, count = text.partition("/")
        if not sep or not index.strip().isdigit() or not count.strip().isdigit() or int(count) < 1:
            raise ValueError(f"--shard: write I/N with 0 <= I < N (e.g. 0/4), not {text!r}")
        if int(index) >= int(count):
            raise ValueError(f"--shard {text}: the index counts from 0, so it must be below {int(count)}")
        return cls(int(index), int(count))

    def takes(self, position: int) -> bool:
        return position % self.count == self.index

    @property
    def manifest(self) -> str:
        return "manifest.jsonl" if self.count == 1 else f"manifest.shard-{self.index}-of-{self.count}.jsonl"


WHOLE = Shard(0, 1)


@dataclass(frozen=True)
class Record:
    """One outcome of one item: a manifest line."""

    key: str
    line: int
    digest: str
    status: str  # done or failed
    request: dict[str, Any]
    files: list[str] = field(default_factory=list)  # names in the output folder
    seeds: list[int] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    finished_at: float = 0.0  # Unix time
    batch: int = 1  # the items of the pipeline call that made it (--max-batch); `seconds` is that call's

    @classmethod
    def of(cls, item: Item, status: str, **outcome: Any) -> Record:
        return cls(item.key, item.line, item.digest, status, item.body, finished_at=time.time(), **outcome)


class Manifest:
    """The folder's manifests: read once at the start, this shard's appended to as items end."""

    def __init__(self, folder: Path, shard: Shard = WHOLE) -> None:
        self.folder = folder
        self.path = folder / shard.manifest
        self.records = read_records(folder)
        if shard == WHOLE:  # the folder's only writer: what a killed run was writing goes
            _remove_orphans(folder)

    def done(self, item: Item) -> bool:
        """An outcome `done` for this very request whose files are all there."""
        return any(
            record.status == DONE and all((self.folder / name).is_file() for name in record.files)
            for record in self._of(item)
        )

    def failures(self, item: Item) -> int:
        return sum(record.status == FAILED for record in self._of(item))

    def write_outputs(self, item: Item, suffix: str, files: list[bytes]) -> list[str]:
        """The item's files, each published whole: KEY.png, or KEY_0.png, KEY_1.png, … for several."""
        names = [f"{item.key}{suffix}"] if len(files) == 1 else [f"{item.key}_{k}{suffix}" for k in range(len(files))]
        for name, data in zip(names, files):
            write_file(self.folder / name, lambda temp, data=data: temp.write_bytes(data), replace=True)
        return names

    def append(self, record: Record) -> None:
        """One line, one write on an append-only descriptor, synced before the next item counts as done."""
        line = (json.dumps(asdict(record), ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.records.setdefault(record.key, []).append(record)

    def _of(self, item: Item) -> list[Record]:
        return [record for record in self.records.get(item.key, []) if record.digest == item.digest]


def read_records(folder: Path) -> dict[str, list[Record]]:
    """Every shard's records in the folder by item key; a line that is not a whole record (the
    torn end of a killed run's write) is skipped."""
    records: dict[str, list[Record]] = {}
    for path in sorted(folder.glob("manifest*.jsonl")):
        with path.open("rb") as lines:
            for raw in lines:
                try:
                    record = Record(**json.loads(raw))
                except (ValueError, TypeError):
                    continue
                records.setdefault(record.key, []).append(record)
    return records


def _remove_orphans(folder: Path) -> None:
    """Temporary outputs of runs whose process is gone (a shard's run elsewhere may still own them,
    so only an unsharded run, the folder's only writer, removes them)."""
    for path in folder.iterdir():
        owner = temporary_owner(path.name)
        if owner is not None and not process_alive(owner):
            path.unlink(missing_ok=True)
