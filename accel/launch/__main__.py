"""`python -m accel.launch SCRIPT ARGS`: the rank side of `accel launch`, running a user's script as
__main__ and reporting its failure to the launcher."""

from __future__ import annotations

import runpy
import sys
import traceback
from pathlib import Path
from types import TracebackType

from accel.launch.environment import rank
from accel.launch.reports import exit_code, is_peer_loss, report_failure


def _from_script(trace: TracebackType | None, script: Path) -> TracebackType | None:
    """The traceback without our runpy frames above the user's script."""
    target, entry = script.resolve(), trace
    while entry is not None and Path(entry.tb_frame.f_code.co_filename).resolve() != target:
        entry = entry.tb_next
    return entry or trace


def run_script(argv: list[str]) -> int:
    """The rank side of `accel launch`: run a user's script as __main__, reporting its failure."""
    from accel import watchdog
    from accel.noise import quiet_known_warnings

    if not argv:
        print("usage: python -m accel.launch SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    watchdog.start()
    quiet_known_warnings()  # before the script imports torch
    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit:
        code = exit_code(exit)
        if code:
            report_failure(f"{argv[0]} exited with code {code}", code)
        return code
    except BaseException as error:  # noqa: BLE001 - any failure of the user's script is reported
        lost = is_peer_loss(error)
        if not lost:  # the cause's traceback helps (from the script down); a follow-on one from a collective is noise
            traceback.print_exception(type(error), error, _from_script(error.__traceback__, Path(argv[0])))
        message = f"{type(error).__name__}: {error}"
        if not report_failure(message, 1, lost=lost):
            print(f"error: rank {rank()}: {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    code = run_script(sys.argv[1:])
    from accel import watchdog
    from accel.rank_exit import end_process

    end_process(code, on_rank=watchdog.active())
