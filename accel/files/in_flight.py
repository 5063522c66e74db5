"""What this process is in the middle of writing (temporaries) and holding (claims), remembered so
that whatever stops the job can remove them (`accel.files.cleanup`); each name is also listed in the
job's folder, for the launcher once the rank is dead."""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accel.files.claims import Claim

JOB_DIR_ENV = "ACCEL_JOB_DIR"

registry = threading.Lock()  # guards `temps` and `held_claims`
temps: set[Path] = set()
held_claims: set[Claim] = set()
serial = itertools.count()
closing = threading.Event()  # discard_temps ran: the process is going away, nothing to rescue


def list_in_job(path: Path) -> None:
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
