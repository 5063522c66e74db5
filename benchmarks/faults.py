"""Faults: time from a rank's failure to the end of the whole job, under `accel launch`.

For each fault (a rank raises, calls os._exit(3), is killed with SIGKILL, or hangs while the others
wait in a collective) on 2 and 4 gloo ranks, the last rank fails (tests/fault_rank.py) and we
measure from the moment of the fault, written by the failing rank, to the moment the launcher has
exited (every rank stopped, the failing rank named). The hang is ended by `--timeout`; its row also
shows the time beyond that bound. Median of `--repeats` runs each; the start-up of the ranks is
not counted.

    python benchmarks/faults.py [--repeats 5] [--ranks 2 4] [--timeout 2] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RANK_SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "fault_rank.py"
KINDS = ("raise", "exit", "kill", "hang")


def one_run(kind: str, ranks: int, timeout_s: float) -> tuple[float, str]:
    """(seconds from the fault to the launcher's exit, the first error line it printed)."""
    with tempfile.TemporaryDirectory(prefix="accel-faults-") as folder:
        command = [
            sys.executable,
            "-m",
            "accel.cli",
            "launch",
            "--gpus",
            str(ranks),
            "--oversubscribe",
            "--timeout",
            str(timeout_s),
            str(RANK_SCRIPT),
            folder,
            kind,
            str(ranks - 1),
        ]
        result = subprocess.run(
            command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300
        )
        ended = time.time()
        failed_at = float((Path(folder) / "failed-at").read_text())
    first = next((line for line in result.stderr.splitlines() if line.startswith("error: ")), "(no error line)")
    return ended - failed_at, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--timeout", type=float, default=2.0, help="--timeout for the hang (seconds)")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()

    rows = [
        "| fault | ranks | fault → job exit, median (min–max) | beyond --timeout | rank named as |",
        "|---|---|---|---|---|",
    ]
    for ranks in args.ranks:
        for kind in KINDS:
            runs = [one_run(kind, ranks, args.timeout) for _ in range(args.repeats)]
            times = [seconds for seconds, _ in runs]
            median = statistics.median(times)
            beyond = f"{median - args.timeout:.2f} s" if kind == "hang" else "–"
            named = runs[0][1].removeprefix("error: ")
            rows.append(
                f"| {kind} | {ranks} | {median:.2f} s ({min(times):.2f}–{max(times):.2f}) | {beyond} | `{named}` |"
            )
            print(rows[-1], flush=True)
    table = "\n".join(rows)
    print(f"\n{table}")
    if args.markdown:
        args.markdown.write_text(table + "\n")


if __name__ == "__main__":
    main()
