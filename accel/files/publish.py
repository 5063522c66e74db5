"""Write a file whole under a temporary name, then publish it: replacing what is at the name, only
where the name is still free, or under the first free name of a series. A write that fails after
the long work is written once more to the system's temporary folder, and the error says where."""

from __future__ import annotations

import itertools
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from accel import interrupts
from accel.errors import UserError, os_reason
from accel.files import in_flight
from accel.files.exclusive_create import check_unswapped, created, held, open_created

OVERWRITE_HINT = "choose another name or pass --overwrite to replace it"

Write = Callable[[Path], None]
# What `_temporary` names: .NAME.accel-PID-SERIAL.tmpSUFFIX
_TEMPORARY = re.compile(r"\..+\.accel-(\d+)-\d+\.tmp(\.\w+)?")


def write_file(
    path: Path, write: Write, *, replace: bool, hint: str = OVERWRITE_HINT, rescue: Path | None = None
) -> Path:
    """`write(temp)` then publish temp as `path`: replacing what is there, or only if the name is
    still free (else UserError naming the path; `hint` says what to do). Returns `path`. A write
    that fails with an OSError is retried in `rescue` (default: the system's temporary folder) and
    reported as a UserError naming where the result went."""
    _refuse_folder(path)
    if not replace and os.path.lexists(path):
        raise UserError(f"{path} already exists; {hint}")
    try:
        with _temporary(path) as temp:
            write(temp)
            _sync(temp)
            check_unswapped(temp)
            interrupts.raise_if_pending()  # an interruption lost in a finalizer still stops the output
            if replace:
                try:
                    os.replace(temp, path)
                except IsADirectoryError:  # a folder took the name while we wrote
                    _refuse_folder(path)
                    raise
            elif not _publish(temp, path):
                raise UserError(f"{path} already exists (another run wrote it first); {hint}")
    except OSError as error:
        raise _rescued(path, write, error, rescue) from None
    _sync_folder(path.parent)
    return path


def write_fresh(folder: Path, stem: str, suffix: str, write: Write, rescue: Path | None = None) -> Path:
    """`write(temp)` once, then publish it as the first free of folder/stem+suffix, stem-1+suffix, …
    Each try is exclusive, so concurrent runs never get the same name. Returns the name chosen.
    A failed write is rescued as in `write_file`."""
    try:
        with _temporary(folder / f"{stem}{suffix}") as temp:
            write(temp)
            _sync(temp)
            check_unswapped(temp)
            for index in itertools.count():
                path = folder / (f"{stem}{suffix}" if index == 0 else f"{stem}-{index}{suffix}")
                if _publish(temp, path):
                    break
    except OSError as error:
        raise _rescued(folder / f"{stem}{suffix}", write, error, rescue) from None
    _sync_folder(folder)
    return path


def _rescued(path: Path, write: Write, error: OSError, rescue: Path | None) -> Exception:
    """The one-line error for a write of `path` that failed with `error`, after writing the result
    once more into a new folder under `rescue` (the system's temporary folder by default), so a
    full disk does not cost a generation that took minutes."""
    if in_flight.closing.is_set():
        return error
    reason = os_reason(error)
    try:
        folder = Path(tempfile.mkdtemp(prefix="accel-rescued-", dir=rescue))
        copy = folder / path.name
        write(copy)
    except OSError as second:
        return UserError(
            f"cannot write {path} ({reason}), nor a copy in {rescue or tempfile.gettempdir()} "
            f"({os_reason(second)}); the result is lost: free space or choose another folder"
        )
    return UserError(f"cannot write {path} ({reason}); the result was saved to {copy} instead")


def by_descriptor(save: Callable[[BinaryIO], object]) -> Write:
    """The `Write` of a saver that takes a file object (PIL's save, numpy's save, matplotlib's
    print_png): it gets `open_created(path)`, never the name, so what it writes lands in the file
    `write_file` created, whatever is at the name by then."""

    def write(path: Path) -> None:
        with open_created(path) as file:
            save(file)

    return write


def temporary_owner(name: str) -> int | None:
    """The pid of the process whose `_temporary` has this file name (None: not one of ours)."""
    found = _TEMPORARY.fullmatch(name)
    return int(found.group(1)) if found is not None else None


@contextmanager
def _temporary(path: Path) -> Iterator[Path]:
    """A hidden name next to `path`, unique to this process, keeping its suffix (PIL and ffmpeg
    choose the format from it); removed on the way out, whatever happens."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.parent / f".{path.name[:120]}.accel-{os.getpid()}-{next(in_flight.serial)}.tmp{path.suffix}"
    with created(temp):  # a link planted at the name is refused, never written through
        with in_flight.registry:
            in_flight.temps.add(temp)
        try:
            in_flight.list_in_job(temp)
            yield temp
        finally:
            _forget(temp)


def _forget(temp: Path) -> None:
    """`temp` is done with: off the list `discard_temps` removes, and its name gone."""
    with in_flight.registry:
        in_flight.temps.discard(temp)
    try:
        temp.unlink(missing_ok=True)
    except OSError:
        pass


def _publish(temp: Path, path: Path) -> bool:
    """Give the complete temp the name `path` only if nothing has it; False if something has."""
    try:
        os.link(temp, path)
        return True
    except FileExistsError:
        return False
    except FileNotFoundError:
        raise
    except OSError:  # no hard links on this file system: take the name empty, then fill it at once
        pass
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    try:
        os.replace(temp, path)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return True


def _refuse_folder(path: Path) -> None:
    if path.is_dir():
        raise UserError(f"{path} is a folder, not a file; choose a file name")


def _sync(path: Path) -> None:
    """Data on disk before the rename, so a crash cannot publish a name whose bytes never landed:
    the file `created` holds for `path`, else the one at the name."""
    held_fd = held(path)
    fd = os.dup(held_fd) if held_fd is not None else os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
