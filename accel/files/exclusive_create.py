"""Create a file only where no name (a symbolic link included) is, and write through the descriptor
that created it: a link planted at the name, or swapped in after the creation, is never written
through."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from accel.errors import UserError

_holding = threading.Lock()
_descriptors: dict[Path, int] = {}  # names `created` holds open, for `open_created`


@contextmanager
def created(path: Path) -> Iterator[Path]:
    """Create `path` empty, only if no name (a link included) is there (a UserError naming what is
    in the way otherwise), and keep its descriptor open inside the block, so that
    `open_created(path)` writes through the very file created, whatever is at the name by then.
    The name itself is left for the caller to remove."""
    fd = _create(path)
    with _holding:
        _descriptors[path] = fd
    try:
        yield path
    finally:
        with _holding:
            _descriptors.pop(path, None)
        os.close(fd)


def open_created(path: Path) -> BinaryIO:
    """`path` open for writing (binary), through the descriptor `created` holds for it: a link or
    another file swapped in at the name since is never written. A name `created` does not hold (a
    rescue copy in its own new folder, a caller's own path) is created here, as exclusively."""
    fd = held(path)
    return os.fdopen(_create(path) if fd is None else os.dup(fd), "wb")


def held(path: Path) -> int | None:
    """The descriptor `created` holds open for `path` (None: it holds none)."""
    with _holding:
        return _descriptors.get(path)


def check_unswapped(path: Path) -> None:
    """Refuse to publish a name `created` holds that is no longer the file created: the writer
    wrote through the descriptor, so the link or file swapped in is untouched, but publishing the
    name would give the output's name to it."""
    fd = held(path)
    if fd is None:
        return
    ours, there = os.fstat(fd), os.lstat(path)
    if (ours.st_dev, ours.st_ino) != (there.st_dev, there.st_ino):
        raise UserError(
            f"{path} was replaced while accel wrote it (someone else writes this folder); "
            "nothing was published: write to a folder only you can write"
        )


def _create(path: Path) -> int:
    """A new file at `path`, opened for writing; never through a link. Mode 0o666 less the umask,
    as a writer's own open would give the published file."""
    try:
        return os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0), 0o666)
    except FileExistsError:
        kind = "a symbolic link" if os.path.islink(path) else "a file accel did not create"
        raise UserError(
            f"{path} is {kind}; remove it (accel never writes through a name it did not create) and run again"
        ) from None
