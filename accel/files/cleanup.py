"""Removing what a stopped job left half-done: this process' own temporaries and claims (a rank whose
launcher has died), or those its ranks listed in the job's folder (the launcher, after killing them)."""

from __future__ import annotations

from pathlib import Path

from accel.files import in_flight
from accel.files.claims import LOCK_SUFFIX, remove_unheld_lock


def discard_temps() -> None:
    """Remove this process' unfinished temporaries and give up its claims: what a rank does when its
    launcher has died and it is about to exit."""
    in_flight.closing.set()
    with in_flight.registry:
        temps, claims = list(in_flight.temps), list(in_flight.held_claims)
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
                    remove_unheld_lock(path)
                else:
                    path.unlink(missing_ok=True)
            except OSError:
                pass
