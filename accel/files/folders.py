"""Output folders: created before the work, refused in one line naming the folder and the fix, and
a default name picked exclusively, so two runs started at once never share a folder."""

from __future__ import annotations

import errno
import itertools
from pathlib import Path

from accel.errors import UserError, os_reason


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
    return f"cannot create the folder {folder} ({os_reason(error)}); {fix}"
