"""Output files appear whole or not at all, and never under a name another run is writing.

Every file accel writes (images, videos, JSON, bench reports and figures) is written to a hidden
temporary name in the same folder and renamed into place only when complete, so a kill mid-write
leaves no 0-byte PNG or truncated MP4 at the final name. Publishing without replacing uses
`os.link`, which fails when the name exists: of two runs aiming at one path, one is refused rather
than both "succeeding" and one result silently lost. `claim` refuses the second of two runs at
start-up, before it spends minutes generating; `write_fresh` and `fresh_folder` pick default names
without the check-then-create race.

No name accel creates is followed where it is a symbolic link: the lock is opened with O_NOFOLLOW
and a temporary is created with O_EXCL, so a link planted by anyone who can write the folder is
refused in one line, and its target left untouched. Writers that take a file object write through
the descriptor that created the temporary (`open_created`), so a link swapped in after the
creation is not written through either. A write that fails (ENOSPC, EIO, a read-only
mount) after the long work is not lost silently: the result is written to the system's temporary
folder instead and the one-line error says where.

Temporary names are remembered, so whatever stops a job can remove them: `discard_temps` in this
process (the rank watchdog, when the launcher has died), and `remove_listed_temps` in the launcher
after it killed the ranks (each rank lists its temporaries in the job's folder, `ACCEL_JOB_DIR`).

Stdlib only: the rank watchdog imports it before torch.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from accel import interrupts
from accel.errors import UserError

JOB_DIR_ENV = "ACCEL_JOB_DIR"
OVERWRITE_HINT = "choose another name or pass --overwrite to replace it"
LOCK_SUFFIX = ".accel-lock"

Write = Callable[[Path], None]

_registry = threading.Lock()
_temps: set[Path] = set()
_claims: set[Claim] = set()
_descriptors: dict[Path, int] = {}  # names `created` holds open, for `open_created`
_serial = itertools.count()
_closing = threading.Event()  # discard_temps ran: the process is going away, nothing to rescue


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
            _check_unswapped(temp)
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
            _check_unswapped(temp)
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
    if _closing.is_set():
        return error
    reason = _reason(error)
    try:
        folder = Path(tempfile.mkdtemp(prefix="accel-rescued-", dir=rescue))
        copy = folder / path.name
        write(copy)
    except OSError as second:
        return UserError(
            f"cannot write {path} ({reason}), nor a copy in {rescue or tempfile.gettempdir()} "
            f"({_reason(second)}); the result is lost: free space or choose another folder"
        )
    return UserError(f"cannot write {path} ({reason}); the result was saved to {copy} instead")


def _reason(error: OSError) -> str:
    """ "no space left on device": the OS's words, else the exception's own."""
    return error.strerror.lower() if error.strerror else (str(error) or type(error).__name__)


@contextmanager
def created(path: Path) -> Iterator[Path]:
    """Create `path` empty, only if no name (a link included) is there (a UserError naming what is
    in the way otherwise), and keep its descriptor open inside the block, so that
    `open_created(path)` writes through the very file created, whatever is at the name by then.
    The name itself is left for the caller to remove."""
    fd = _create(path)
    with _registry:
        _descriptors[path] = fd
    try:
        yield path
    finally:
        with _registry:
            _descriptors.pop(path, None)
        os.close(fd)


def open_created(path: Path) -> BinaryIO:
    """`path` open for writing (binary), through the descriptor `created` holds for it: a link or
    another file swapped in at the name since is never written. A name `created` does not hold (a
    rescue copy in its own new folder, a caller's own path) is created here, as exclusively."""
    fd = _held(path)
    return os.fdopen(_create(path) if fd is None else os.dup(fd), "wb")


def _held(path: Path) -> int | None:
    """The descriptor `created` holds open for `path` (None: it holds none)."""
    with _registry:
        return _descriptors.get(path)


def by_descriptor(save: Callable[[BinaryIO], object]) -> Write:
    """The `Write` of a saver that takes a file object (PIL's save, numpy's save, matplotlib's
    print_png): it gets `open_created(path)`, never the name, so what it writes lands in the file
    `write_file` created, whatever is at the name by then."""

    def write(path: Path) -> None:
        with open_created(path) as file:
            save(file)

    return write


def _check_unswapped(path: Path) -> None:
    """Refuse to publish a name `created` holds that is no longer the file created: the writer
    wrote through the descriptor, so the link or file swapped in is untouched, but publishing the
    name would give the output's name to it."""
    fd = _held(path)
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


def fresh_folder(parent: Path, stem: str) -> Path:
    """Create and return the first free of parent/stem, stem-1, …; mkdir is exclusive, so two runs
    started at once never share a folder."""
    make_folder(parent)
    for index in itertools.count():
        folder = parent / (stem if index == 0 else f"{stem}-{index}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        except OSError as error:
            raise UserError(_folder_refusal(folder, error)) from None
        return folder
    raise AssertionError("unreachable")


def make_folder(folder: Path) -> Path:
    """Create `folder` and its parents unless they are there. ENOSPC, EACCES, a read-only mount or a
    file in the way is a UserError in one line naming the folder, before the work, so nothing is lost."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(_folder_refusal(folder, error)) from None
    return folder


def _folder_refusal(folder: Path, error: OSError) -> str:
    """What to do depends on why: space can be freed, a permission is the folder's choice."""
    denied = error.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
    fix = "pass --out with a folder you may write" if denied else "free space or pass --out"
    return f"cannot create the folder {folder} ({_reason(error)}); {fix}"


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
        with _registry:
            fd, self._fd = self._fd, None
            _claims.discard(self)
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
        raise UserError(f"cannot create the folder of {path} ({_reason(error)}); choose another name") from None
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
                        f"cannot write the lock {lock} ({_reason(error)}); free space or choose another name"
                    ) from None
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    held = Claim(path, lock, fd)
    with _registry:
        _claims.add(held)
    _list_in_job(lock)
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
        raise UserError(f"cannot create the lock {lock} ({_reason(error)}); choose another name than {path}") from None


def _unlink_if_same(fd: int, path: Path) -> None:
    try:
        if _same_file(fd, path):
            os.unlink(path)
    except OSError:
        pass


def discard_temps() -> None:
    """Remove this process' unfinished temporaries and give up its claims: what a rank does when its
    launcher has died and it is about to exit."""
    _closing.set()
    with _registry:
        temps, claims = list(_temps), list(_claims)
    for temp in temps:
        try:
            temp.unlink(missing_ok=True)
        except OSError:
            pass
    for held in claims:
        held.release()


def remove_listed_temps(job_dir: Path) -> None:
    """For the launcher, after killing its ranks: remove every temporary they listed that still
    exists, and their locks nobody holds any more. Errors are ignored: this is cleanup."""
    for listing in sorted(job_dir.glob("temps-*.txt")):
        try:
            names = listing.read_text().splitlines()
        except OSError:
            continue
        for name in filter(None, names):
            path = Path(name)
            try:
                if path.name.endswith(LOCK_SUFFIX) and path.name.startswith("."):
                    _remove_unheld_lock(path)
                else:
                    path.unlink(missing_ok=True)
            except OSError:
                pass


# --- helpers -------------------------------------------------------------------------------------


@contextmanager
def _temporary(path: Path) -> Iterator[Path]:
    """A hidden name next to `path`, unique to this process, keeping its suffix (PIL and ffmpeg
    choose the format from it); removed on the way out, whatever happens."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.parent / f".{path.name[:120]}.accel-{os.getpid()}-{next(_serial)}.tmp{path.suffix}"
    with created(temp):  # a link planted at the name is refused, never written through
        with _registry:
            _temps.add(temp)
        try:
            _list_in_job(temp)
            yield temp
        finally:
            _forget(temp)


def _forget(temp: Path) -> None:
    """`temp` is done with: off the list `discard_temps` removes, and its name gone."""
    with _registry:
        _temps.discard(temp)
    try:
        temp.unlink(missing_ok=True)
    except OSError:
        pass


def _list_in_job(path: Path) -> None:
    """Note `path` in the job's folder before writing starts, for `remove_listed_temps`."""
    folder = os.environ.get(JOB_DIR_ENV)
    if not folder:
        return
    try:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        with os.fdopen(os.open(Path(folder) / f"temps-{os.getpid()}.txt", flags, 0o600), "a") as listing:
            listing.write(os.path.abspath(path) + "\n")
    except OSError:  # the job is ending and its folder gone: nothing to tell anyone
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
    held = _held(path)
    fd = os.dup(held) if held is not None else os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
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


def _remove_unheld_lock(lock: Path) -> None:
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
