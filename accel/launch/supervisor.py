"""The launcher's side of a job: start the ranks in their own process groups, watch them, and end
the job the moment one fails, stalls or is interrupted, with the job's real exit code.

What it prints when a job fails is `accel.launch.diagnosis`'s; what it reads, `accel.launch.reports`'.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from accel.files.cleanup import remove_listed_temps
from accel.files.in_flight import JOB_DIR_ENV
from accel.launch.diagnosis import failure_report, lingering, stall
from accel.launch.environment import LaunchSpec
from accel.launch.forked import ForkedRank, can_fork_now, fork_rank
from accel.launch.reports import read_beats, read_finished, read_reports, read_verdicts
from accel.preflight import cpu_cores
from accel.watchdog import LAUNCHER_PID_ENV

POLL_S = 0.05
STOP_GRACE_S = 2.0  # SIGTERM first; whatever still runs after this gets SIGKILL
# A server's requests still running when its drain ends are cancelled and stop at their next step:
# one step of a large model on one GPU can take this long.
CANCEL_GRACE_S = 30.0
REPORT_GRACE_S = 0.3  # after a first failure: let simultaneous reports land before judging


def launch(spec: LaunchSpec, module: str, args: list[str], fork: bool = False) -> int:
    """Run `python -m module args` on `spec.nproc` local ranks; the job's exit code (0 when all succeed,
    2 when a rank hit a user error, 130 / 143 when interrupted, else 1). With `fork`, each rank is a
    fork of this process where that is safe (`accel.launch.forked`), else a new interpreter."""
    return Supervisor(spec, [sys.executable, "-m", module, *args], (module, args) if fork else None).run()


@dataclass
class _Rank:
    rank: int
    process: subprocess.Popen[bytes] | ForkedRank
    exit_code: int | None = None


@dataclass
class Supervisor:
    """Starts the ranks, watches them, and ends the job the moment one of them fails or stalls."""

    spec: LaunchSpec
    command: list[str]
    forked: tuple[str, list[str]] | None = None  # (module, args) to run in forks of this process
    ranks: list[_Rank] = field(default_factory=list)
    signal_received: int | None = None

    def run(self) -> int:
        folder = Path(tempfile.mkdtemp(prefix="accel-job-"))
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._start(folder)
            return self._watch(folder)
        finally:
            self._stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            remove_listed_temps(folder)  # outputs the stopped ranks were writing: never half a file
            shutil.rmtree(folder, ignore_errors=True)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signal_received = signum

    def _start(self, folder: Path) -> None:
        address, port = self.spec.rendezvous()
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, cpu_cores() // self.spec.nproc))
        shared = {JOB_DIR_ENV: str(folder), LAUNCHER_PID_ENV: str(os.getpid()), "OMP_NUM_THREADS": threads}
        forked = self.forked if can_fork_now() else None
        for local in range(self.spec.nproc):
            env = {**os.environ, **shared, **self.spec.rank_environment(local, address, port)}
            # Its own session: Ctrl-C reaches only the launcher, which stops each rank's whole group.
            process = (
                fork_rank(*forked, env)
                if forked is not None
                else subprocess.Popen(self.command, env=env, start_new_session=True)
            )
            self.ranks.append(_Rank(self.spec.node_rank * self.spec.nproc + local, process))

    def _watch(self, folder: Path) -> int:
        next_look = time.monotonic()
        draining_until: float | None = None
        while True:
            if self.signal_received is not None and self.spec.drain_s is not None and draining_until is None:
                draining_until = time.monotonic() + self.spec.drain_s + CANCEL_GRACE_S + STOP_GRACE_S
                _signal_group(self.ranks[0].process.pid, self.signal_received)  # rank 0 drains and stops the others
            elif self.signal_received is not None and (draining_until is None or time.monotonic() >= draining_until):
                self._stop()
                print("interrupted", file=sys.stderr)
                return 128 + self.signal_received
            self._poll()
            verdicts = self._verdicts(folder)
            failed = any(r.exit_code not in (None, 0, verdicts.get(r.rank)) for r in self.ranks)
            if not failed and all(r.exit_code is not None for r in self.ranks):
                return max(r.exit_code or 0 for r in self.ranks)  # 0, or the work's own verdict
            if not failed and time.monotonic() >= next_look:  # the job folder is read twice a second, not every poll
                next_look = time.monotonic() + 0.5
                failed = self._reported_but_running(folder)
                self._stop_lingering(folder)
                stalled = (
                    None if failed else stall(read_beats(folder), self._running(), self.spec.timeout_s, time.time())
                )
                if stalled is not None:
                    return self._fail(folder, stalled=stalled)
            if failed:
                time.sleep(REPORT_GRACE_S)  # ranks failing together (a user error on every rank) report together
                self._poll()
                return self._fail(folder, stalled=None)
            time.sleep(POLL_S)

    def _verdicts(self, folder: Path) -> dict[int, int]:
        """The exit codes ranks that ended by design announced (read only once one exited non-zero)."""
        if all(r.exit_code in (None, 0) for r in self.ranks):
            return {}
        return read_verdicts(folder)

    def _poll(self) -> None:
        for rank in self.ranks:
            if rank.exit_code is None and (code := rank.process.poll()) is not None:
                rank.exit_code = code

    def _running(self) -> set[int]:
        return {r.rank for r in self.ranks if r.exit_code is None}

    def _reported_but_running(self, folder: Path) -> bool:
        """A rank that reported its failure exits right after; one that lingers is failed all the same."""
        reported = {report["rank"] for report in read_reports(folder)}
        return any(r.rank in reported and r.exit_code is None for r in self.ranks)

    def _stop_lingering(self, folder: Path) -> None:
        """End each rank that reported success `finish_grace_s` ago and still runs: it succeeded, so
        the job goes on to its real outcome; the line says where its exit stuck."""
        now, beats, finished_at = time.time(), read_beats(folder), read_finished(folder)
        for rank in self.ranks:
            finished = finished_at.get(rank.rank)
            if rank.exit_code is not None or finished is None or now - finished < self.spec.finish_grace_s:
                continue
            print(
                f"warning: {lingering(rank.rank, beats.get(rank.rank), self.spec.finish_grace_s, now)}; stopped it",
                file=sys.stderr,
            )
            _signal_group(rank.process.pid, signal.SIGKILL)
            rank.process.wait()
            rank.exit_code = 0

    def _fail(self, folder: Path, stalled: str | None) -> int:
        self._poll()
        exits = {r.rank: r.exit_code for r in self.ranks if r.exit_code not in (None, 0)}
        beats = read_beats(folder)
        self._stop()
        lines, code = failure_report(read_reports(folder), exits, beats, stalled)
        for line in lines:
            print(f"error: {line}", file=sys.stderr)
        return code

    def _stop(self) -> None:
        """SIGTERM every rank's process group, SIGKILL what is left after a grace period; reap all."""
        live = [r for r in self.ranks if r.exit_code is None]
        for rank in live:
            _signal_group(rank.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while any(r.process.poll() is None for r in live) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        for rank in self.ranks:  # also helpers a finished rank left behind (compile workers)
            _signal_group(rank.process.pid, signal.SIGKILL)
            rank.process.wait()
            if rank.exit_code is None:
                rank.exit_code = rank.process.returncode


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
