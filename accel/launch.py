"""Multi-process start-up: run a command on N local ranks, and bring the failing rank's message home.

`launch(spec, module, args)` starts `python -m module args` once per local rank with torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, …), so `init_process_group()`
and `accel.apply` work unchanged, and then supervises them (`Supervisor`):

- the first rank to fail is named with its own cause (its one-line report, its exit code or the
  signal that killed it) and the others are stopped at once; their follow-on "connection reset"
  errors are not shown as the cause;
- a rank the others wait for in a collective for longer than `timeout_s` is named from the ranks'
  heartbeats (`accel.watchdog`);
- Ctrl-C / SIGTERM stop every rank (each runs in its own process group, so its helpers go too),
  print `interrupted`, exit 130 / 143 and leave no job folder and no half-written output;
- if the launcher itself is killed, each rank's watchdog sees its parent gone and exits;
- a rank that reported success (`report_finished`, from `accel.rank_exit`) but still runs
  `finish_grace_s` later is stopped and named with where it was: the job ends with its real outcome.

We do not run torchrun's elastic agent in-process any more: it could not order failures, hid exit
codes of ranks that left no report, and answered Ctrl-C with its own traceback.

`python -m accel.launch SCRIPT ARGS` is the rank side of `accel launch`: it runs a user's script.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from accel.errors import UserError
from accel.files.cleanup import remove_listed_temps
from accel.files.in_flight import JOB_DIR_ENV
from accel.preflight import cpu_cores
from accel.watchdog import LAUNCHER_PID_ENV

POLL_S = 0.05
STOP_GRACE_S = 2.0  # SIGTERM first; whatever still runs after this gets SIGKILL
# A server's requests still running when its drain ends are cancelled and stop at their next step:
# one step of a large model on one GPU can take this long.
CANCEL_GRACE_S = 30.0
REPORT_GRACE_S = 0.3  # after a first failure: let simultaneous reports land before judging
STALE_BEAT_S = 3.0  # a rank whose heartbeat is this old no longer runs Python (stopped, frozen)
FINISH_GRACE_S = 30.0  # longer than a finished rank's own bounded exit (rank_exit), which should end it first
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchSpec:
    """How many processes on this node, where the nodes meet, and how long a rank may keep the others waiting."""

    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    timeout_s: float = 600.0
    # A server's job: on SIGINT / SIGTERM only rank 0 is signalled, and the job gets this many seconds
    # to finish in-flight work and stop its ranks itself (exit 0) before they are stopped. None: stop at once.
    drain_s: float | None = None
    # A rank that reported success but is still running this long after is stopped, and counts as
    # succeeded: the job never hangs on a rank whose exit stuck.
    finish_grace_s: float = FINISH_GRACE_S

    @classmethod
    def for_world(
        cls,
        world: int,
        nnodes: int = 1,
        node_rank: int = 0,
        master_addr: str | None = None,
        master_port: int | None = None,
        timeout_s: float = 600.0,
    ) -> LaunchSpec:
        """Split `world` processes evenly over `nnodes` nodes; refuse what does not split."""
        if nnodes < 1 or not 0 <= node_rank < nnodes:
            raise UserError(f"--node-rank {node_rank} must be between 0 and --nnodes - 1 ({nnodes - 1})")
        if world % nnodes:
            raise UserError(
                f"{world} processes do not split evenly over --nnodes {nnodes}; use a multiple of {nnodes} GPUs"
            )
        if nnodes > 1 and master_addr is None:
            raise UserError("--nnodes > 1 needs --master-addr (the address of node 0) on every node")
        return cls(world // nnodes, nnodes, node_rank, master_addr, master_port, timeout_s)

    @property
    def world(self) -> int:
        return self.nproc * self.nnodes

    def rendezvous(self) -> tuple[str, int]:
        """(address, port) of rank 0's store: a free local port for a single node unless one was given."""
        address = self.master_addr or "127.0.0.1"
        if self.master_port is not None:
            return address, self.master_port
        return address, free_port() if self.nnodes == 1 and self.master_addr is None else DEFAULT_PORT

    def rank_environment(self, local: int, address: str, port: int) -> dict[str, str]:
        """What torchrun would give rank `local` of this node."""
        global_rank = self.node_rank * self.nproc + local
        return {
            "RANK": str(global_rank),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(self.world),
            "LOCAL_WORLD_SIZE": str(self.nproc),
            "GROUP_RANK": str(self.node_rank),
            "GROUP_WORLD_SIZE": str(self.nnodes),
            "ROLE_RANK": str(global_rank),
            "ROLE_WORLD_SIZE": str(self.world),
            "ROLE_NAME": "default",
            "MASTER_ADDR": address,
            "MASTER_PORT": str(port),
        }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(spec: LaunchSpec, module: str, args: list[str]) -> int:
    """Run `python -m module args` on `spec.nproc` local ranks; the job's exit code (0 when all succeed,
    2 when a rank hit a user error, 130 / 143 when interrupted, else 1)."""
    return Supervisor(spec, [sys.executable, "-m", module, *args]).run()


@dataclass
class _Rank:
    rank: int
    process: subprocess.Popen[bytes]
    exit_code: int | None = None


@dataclass
class Supervisor:
    """Starts the ranks, watches them, and ends the job the moment one of them fails or stalls."""

    spec: LaunchSpec
    command: list[str]
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
        for local in range(self.spec.nproc):
            env = {**os.environ, **shared, **self.spec.rank_environment(local, address, port)}
            # Its own session: Ctrl-C reaches only the launcher, which stops each rank's whole group.
            process = subprocess.Popen(self.command, env=env, start_new_session=True)
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
            failed = any(r.exit_code not in (None, 0) for r in self.ranks)
            if not failed and all(r.exit_code == 0 for r in self.ranks):
                return 0
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


def lingering(rank: int, beat: dict | None, grace_s: float, now: float) -> str:
    """The line for a rank that finished its work but did not exit: where its heartbeat last saw it."""
    if beat is None:
        where = "no heartbeat"
    elif now - beat["time"] < STALE_BEAT_S:
        where = f"waiting at {beat['where']}"
    else:
        where = f"last seen at {beat['where']} {now - beat['time']:.0f} s ago"
    return f"rank {rank} finished its work but had not exited {grace_s:.0f} s later ({where})"


def stall(beats: dict[int, dict], running: set[int], timeout_s: float, now: float) -> str | None:
    """The one line naming who the others wait for, once a rank has waited in a collective for
    `timeout_s`; None while nobody has waited that long."""
    waited = {
        r: now - b["since"]
        for r, b in beats.items()
        if r in running and b["waiting"] and now - b["time"] < STALE_BEAT_S
    }
    if not waited or max(waited.values()) < timeout_s:
        return None
    return _culprits(beats, running, now, waited)


def _culprits(beats: dict[int, dict], running: set[int], now: float, waited: dict[int, float]) -> str:
    waiters = sorted(waited)
    how_long = f"{max(waited.values()):.0f} s"
    silent = sorted(r for r in running if r not in beats or now - beats[r]["time"] >= STALE_BEAT_S)
    elsewhere = sorted(r for r in running if r not in waited and r not in silent)
    waiting_ranks = f"rank{'s' if len(waiters) > 1 else ''} {_list(waiters)}"
    if elsewhere:
        where = "; ".join(f"rank {r} was at {beats[r]['where']}" for r in elsewhere)
        return (
            f"rank{'s' if len(elsewhere) > 1 else ''} {_list(elsewhere)} stopped making progress: {waiting_ranks} "
            f"waited {how_long} for it in a collective ({where})"
        )
    if silent:
        return (
            f"rank{'s' if len(silent) > 1 else ''} {_list(silent)} stopped responding (no heartbeat); "
            f"{waiting_ranks} waited {how_long} for it in a collective"
        )
    where = "; ".join(f"rank {r} at {beats[r]['where']}" for r in waiters)
    return f"every rank waited {how_long} in a collective the others never joined ({where})"


def _list(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def failure_report(
    reports: list[dict], exits: dict[int, int], beats: dict[int, dict], stalled: str | None
) -> tuple[list[str], int]:
    """The lines naming what went wrong first, and the job's exit code (2 if it was a user error).

    A rank's own report (a user error, its exception) or a rank that died without one is the cause;
    a rank that only lost its peers (a collective failing because another rank died or hung) is a
    consequence and is summarised in one line."""
    own = [r for r in reports if not r.get("lost")]
    lost = [r for r in reports if r.get("lost")]
    reported = {r["rank"] for r in reports}
    lines: list[str] = []
    if stalled is not None:
        lines.append(stalled)
    messages: dict[str, list[int]] = {}
    for report in own:
        messages.setdefault(report["message"], []).append(report["rank"])
    user_errors = {r["message"] for r in own if r.get("exit_code") == 2}
    for message, ranks in messages.items():
        # One message from every rank, or a user error (every rank would hit it; the job stops at the first)
        shared = len(messages) == 1 and (len(ranks) > 1 or message in user_errors)
        lines.append(f"{'' if shared else f'rank {_list(ranks)}: '}{message}")
    if stalled is None and not own:
        for failed_rank, code in sorted(exits.items()):
            if failed_rank not in reported:
                lines.append(f"rank {failed_rank} {_exit_cause(code)}")
    if not lines and lost:  # every report is a follow-on: the heartbeats tell whom they waited for
        gave_up = sorted(r["rank"] for r in lost)
        elsewhere = sorted(r for r, beat in beats.items() if not beat["waiting"] and r not in gave_up)
        if elsewhere:
            where = "; ".join(f"rank {r} was at {beats[r]['where']}" for r in elsewhere)
            lines.append(
                f"rank{'s' if len(elsewhere) > 1 else ''} {_list(elsewhere)} stopped making progress: "
                f"rank{'s' if len(gave_up) > 1 else ''} {_list(gave_up)} gave up waiting for it in a collective "
                f"({where})"
            )
    if lost:
        ranks = sorted(r["rank"] for r in lost)
        if lines:
            lines.append(
                f"rank{'s' if len(ranks) > 1 else ''} {_list(ranks)} stopped with it ({_short(lost[0]['message'])})"
            )
        else:
            lines.extend(f"rank {r['rank']}: {r['message']}" for r in lost)
    if not lines:
        lines.append("the job failed without a report from any rank")
    return lines, 2 if user_errors else 1


def _exit_cause(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {-code} ({name})"
    return f"exited with code {code} without a message"


def _short(message: str, limit: int = 100) -> str:
    """A follow-on error in brief: its first sentence, without the backend's source locations."""
    line = re.sub(r"\[[^\]]*\](?::\d+)?:?\s*", "", message.splitlines()[0] if message else "")
    line = line.split(". ", 1)[0].strip().rstrip(".")
    if len(line) <= limit:
        return line
    return line[:limit].rsplit(" ", 1)[0] + " …"


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int | None:
    """This process's index on its node under a launcher (None outside one)."""
    value = os.environ.get("LOCAL_RANK")
    return int(value) if value is not None else None


def rank_device(device_type: str) -> str:
    """The device this rank should compute on: under a launcher each rank has its own GPU,
    `cuda:LOCAL_RANK`; otherwise the device type as given (the current GPU for cuda)."""
    index = local_rank()
    return f"cuda:{index}" if device_type == "cuda" and index is not None else device_type


def world_size() -> int:
    """Processes in the job this one belongs to (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def report_failure(message: str, exit_code: int, *, lost: bool = False) -> bool:
    """From a rank `launch` started: leave the message for the launcher and return True (print nothing).
    Elsewhere return False: the caller prints it (prefixed by the rank when there are several).
    `lost`: the failure only follows another rank's (a collective whose peer died or never came)."""
    document = {"rank": rank(), "message": message, "exit_code": exit_code, "lost": lost, "time": time.time()}
    return _write_for_launcher(f"rank-{rank()}.json", document)


def report_finished() -> bool:
    """From a rank `launch` started: tell the launcher this rank's work succeeded and it is leaving, so
    a rank that then never exits is ended after `LaunchSpec.finish_grace_s` as a success, not waited for."""
    return _write_for_launcher(f"done-{rank()}.json", {"rank": rank(), "time": time.time()})


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
