"""Claiming an output name for this run before the long work: a flock on a hidden lock file next to
it, which the kernel drops when the process dies, so a second live run is refused at start-up and a
killed run's lock is taken over, never obeyed. The lock is never opened through a symbolic link."""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path
from types import TracebackType

from accel.errors import UserError, os_reason
from accel.files import in_flight

LOCK_SUFFIX = ".accel-lock"


class Claim:
    """This process is the one writing `path`; held through a flock on `.<name>.accel-lock`, which
    the kernel drops when the process dies, so a killed run's lock is taken over, never obeyed."""

    def __init__(self, path: Path, lock: Path, fd: int) -> None:
        self.path, self.lock = path, lock
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Give the path up and remove the lock file (idempotent, from any thread)."""
        with in_flight.registry:
            fd, self._fd = self._fd, None
            in_flight.held_claims.discard(self)
        if fd is None:
            return
        try:
            if _same_file(fd, self.lock):  # unlink before unlocking: nobody can lock a name we remove
                os.unlink(self.lock)
        except OSError:
            pass
        finally:
            os.close(fd)

    def __enter__(self) -> Claim:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.release()


def claim(path: Path) -> Claim:
    """Claim `path` for this run before the long work that ends in writing it; UserError when
    another live accel run holds it. A lock left by a dead run is taken over."""
    lock = path.parent / f".{path.name}{LOCK_SUFFIX}"
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create the folder of {path} ({os_reason(error)}); choose another name") from None
    while True:
        fd = _open_lock(lock, path)
        try:
            if not _lock(fd):
                raise UserError(
                    f"{path} is being written by another accel run (pid {_holder(fd)}); choose another name or wait "
                    "for it"
                )
            if _same_file(fd, lock):  # else its holder removed it between our open and our lock: again
                try:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                except OSError as error:  # ENOSPC, EIO: give the lock up rather than leave it behind
                    _unlink_if_same(fd, lock)
                    raise UserError(
                        f"cannot write the lock {lock} ({os_reason(error)}); free space or choose another name"
                    ) from None
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    held = Claim(path, lock, fd)
    with in_flight.registry:
        in_flight.held_claims.add(held)
    in_flight.list_in_job(lock)
    return held


def _open_lock(lock: Path, path: Path) -> int:
    """Open (creating) the lock file without following a symbolic link planted in its place: a link
    there would have us truncate and overwrite its target."""
    try:
        return os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as error:
        if os.path.islink(lock):
            raise UserError(
                f"{lock} is a symbolic link, not an accel lock; remove it (accel never follows a link "
                f"there) and run again, or choose another name than {path}"
            ) from None
        if isinstance(error, IsADirectoryError) or os.path.isdir(lock):
            raise UserError(
                f"{lock} is a folder, not an accel lock; remove it or choose another name than {path}"
            ) from None
        raise UserError(
            f"cannot create the lock {lock} ({os_reason(error)}); choose another name than {path}"
        ) from None


def _unlink_if_same(fd: int, path: Path) -> None:
    try:
        if _same_file(fd, path):
            os.unlink(path)
    except OSError:
        pass


def _lock(fd: int) -> bool:
    """Lock the open lock file without waiting; False when a live process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
    pid = _read_pid(fd)  # no flock on this file system: trust the pid the file names
    return pid is None or not process_alive(pid)


def _holder(fd: int) -> str:
    """The pid in a held lock file; its holder may not have written it yet, so wait a moment."""
    for _ in range(50):
        pid = _read_pid(fd)
        if pid is not None:
            return str(pid)
        time.sleep(0.01)
    return "unknown"


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        return None


def process_alive(pid: int) -> bool:
    """A process with this pid exists (zombies included; ours are reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _same_file(fd: int, path: Path) -> bool:
    """Is the open file still the one at `path`? (Its holder may have removed or replaced it.)"""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def remove_unheld_lock(lock: Path) -> None:
    """Remove a lock file only while holding it ourselves: one a live run holds stays."""
    try:
        fd = os.open(lock, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except OSError:  # gone, or a link planted there: nothing of ours to remove
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if _same_file(fd, lock):
            os.unlink(lock)
    except OSError:
        pass
    finally:
        os.close(fd)
