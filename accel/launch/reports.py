"""The job folder between ranks and launcher: what a rank leaves there when it ends (its failure,
`rank-<rank>.json`; its success, `done-<rank>.json`), and the launcher reading those and the
heartbeats (`beat-<rank>.json`, `accel.watchdog`) back.

Each document is written to a temporary name and renamed, so the launcher never reads half of one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from accel.files.in_flight import JOB_DIR_ENV
from accel.launch.environment import rank


def report_failure(message: str, exit_code: int, *, lost: bool = False) -> bool:
    """From a rank `launch` started: leave the message for the launcher and return True (print nothing).
    Elsewhere return False: the caller prints it (prefixed by the rank when there are several).
    `lost`: the failure only follows another rank's (a collective whose peer died or never came)."""
    document = {"rank": rank(), "message": message, "exit_code": exit_code, "lost": lost, "time": time.time()}
    return _write_for_launcher(f"rank-{rank()}.json", document)


def report_finished(verdict: int = 0) -> bool:
    """From a rank `launch` started: tell the launcher this rank's work succeeded and it is leaving, so
    a rank that then never exits is ended after `LaunchSpec.finish_grace_s` as a success, not waited for.
    `verdict`: the exit code the work ended with by design (`accel batch` with failed items: 1), which
    the launcher passes on as the job's, not as a failure to diagnose."""
    return _write_for_launcher(f"done-{rank()}.json", {"rank": rank(), "time": time.time(), "verdict": verdict})


def _write_for_launcher(name: str, document: dict) -> bool:
    from accel import watchdog

    folder = os.environ.get(JOB_DIR_ENV)
    if not watchdog.active() or not folder or not Path(folder).is_dir():
        return False
    path = Path(folder) / name
    temp = path.with_suffix(".tmp")
    temp.write_text(json.dumps(document))
    os.replace(temp, path)  # the launcher never reads half a file
    return True


def is_peer_loss(error: BaseException) -> bool:
    """A collective failed because another rank died, hung or left: a consequence, not a cause."""
    distributed = sys.modules.get("torch.distributed")
    dist_error = getattr(distributed, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    text = str(error)
    return any(
        sign in text
        for sign in (
            "Connection reset by peer",
            "Connection closed by peer",
            "Broken pipe",
            "Socket Timeout",
            "timed out",
            "Timed out",
        )
    )


def exit_code(exit: SystemExit) -> int:
    """The process exit code a SystemExit stands for (None is 0; a message is 1, as Python does)."""
    return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)


def _rank_documents(folder: Path, kind: str) -> dict[int, dict]:
    """The ranks' `KIND-<rank>.json` files in the job folder, by rank; one being written is skipped
    (the next look finds it whole)."""
    documents = {}
    for path in folder.glob(f"{kind}-*.json"):
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        documents[document["rank"]] = document
    return documents


def read_reports(folder: Path) -> list[dict]:
    """The failures ranks reported (`report_failure`), in rank order."""
    return [report for _rank, report in sorted(_rank_documents(folder, "rank").items())]


def read_beats(folder: Path) -> dict[int, dict]:
    return _rank_documents(folder, "beat")


def read_finished(folder: Path) -> dict[int, float]:
    """When each rank that reported success did so (`report_finished`)."""
    return {rank: document["time"] for rank, document in _rank_documents(folder, "done").items()}


def read_verdicts(folder: Path) -> dict[int, int]:
    """The exit code each rank that reported success said it would leave with (`report_finished`)."""
    return {rank: document.get("verdict", 0) for rank, document in _rank_documents(folder, "done").items()}
