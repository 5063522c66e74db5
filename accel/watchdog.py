"""The rank side of a job `accel` launched: a heartbeat the launcher reads, and an exit when it dies.

One daemon thread per rank. Every `INTERVAL_S` it samples where the main thread is (and whether
it waits inside torch.distributed) into `beat-<rank>.json` in the job's folder, so the launcher can
name the rank the others are waiting for. If the launcher has gone (killed with SIGKILL, so it could
not stop us), the rank removes its half-written outputs and the job folder and exits at once: an
orphaned job must not go on to write files nobody asked for any more.

Stdlib only: it starts before torch is imported.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from accel.files.claims import process_alive
from accel.files.cleanup import discard_temps
from accel.files.in_flight import JOB_DIR_ENV

LAUNCHER_PID_ENV = "ACCEL_LAUNCHER_PID"
INTERVAL_S = 0.25
ORPHAN_EXIT_CODE = 1

_DISTRIBUTED = f"{os.sep}torch{os.sep}distributed{os.sep}"
_started = False
_idle = 0  # > 0 while the main thread waits for the others on purpose (see `idle`)


def start() -> bool:
    """Start the heartbeat of this rank if a launcher of ours started it (idempotent); True if running."""
    global _started
    folder, launcher = os.environ.get(JOB_DIR_ENV), os.environ.get(LAUNCHER_PID_ENV)
    if _started:
        return True
    if not folder or not launcher or not Path(folder).is_dir():
        return False
    rank = int(os.environ.get("RANK", "0"))
    main = threading.main_thread()
    if os.getppid() != int(launcher):
        if not process_alive(int(launcher)):  # the launcher died before we got here
            _orphaned(Path(folder))
        return False  # a process a rank started (a script running `accel run`): not one of the launcher's ranks
    beat = Heartbeat(Path(folder), rank, int(launcher), main.ident or 0)
    threading.Thread(target=beat.run, name="accel-heartbeat", daemon=True).start()
    _started = True
    return True


def active() -> bool:
    """This process is one of the launcher's ranks (not, say, a process one of them started)."""
    return _started


@contextmanager
def idle() -> Iterator[None]:
    """Waiting here is the plan, not a stall: `accel bench` parks the ranks a small variant does not
    use in a barrier for as long as that variant takes (a one-GPU baseline can take an hour)."""
    global _idle
    _idle += 1
    try:
        yield
    finally:
        _idle -= 1


class Heartbeat:
    def __init__(self, folder: Path, rank: int, launcher: int, main_thread: int) -> None:
        self.folder, self.rank, self.launcher, self.main_thread = folder, rank, launcher, main_thread
        self.state: tuple[bool, str] | None = None
        self.since = time.time()

    def run(self) -> None:
        while True:
            if os.getppid() != self.launcher:
                _orphaned(self.folder)
            try:
                self.write()
            except OSError:  # the launcher removed the folder: the job is ending
                pass
            time.sleep(INTERVAL_S)

    def write(self) -> None:
        frame = sys._current_frames().get(self.main_thread)
        waiting, where = describe(frame)
        waiting = waiting and _idle == 0
        now = time.time()
        if (waiting, where) != self.state:
            self.state, self.since = (waiting, where), now
        document = {
            "rank": self.rank,
            "pid": os.getpid(),
            "time": now,
            "waiting": waiting,
            "since": self.since,
            "where": where,
        }
        path = self.folder / f"beat-{self.rank}.json"
        temp = path.with_suffix(".tmp")
        temp.write_text(json.dumps(document))
        os.replace(temp, path)


def describe(frame: FrameType | None) -> tuple[bool, str]:
    """(waits inside torch.distributed, the innermost place outside torch): what a stuck rank is doing."""
    waiting, where = False, "unknown"
    while frame is not None:
        name = frame.f_code.co_filename
        if _DISTRIBUTED in name:
            waiting = True
        elif where == "unknown" and f"{os.sep}torch{os.sep}" not in name and name != __file__:
            where = f"{Path(name).name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return waiting, where


def _orphaned(folder: Path) -> None:
    """The launcher is gone: leave nothing half-written behind, and go."""
    try:
        discard_temps()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(ORPHAN_EXIT_CODE)
