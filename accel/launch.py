"""Multi-process start-up: relaunch a command under torchrun, and bring a failing rank's message home.

`launch(spec, module, args)` runs `python -m module args` on N local ranks through torchrun's
own launcher (in this process). A rank that fails calls `report_failure`, which leaves its one-line
message in a folder the launcher reads back, so the user sees that message once, not torchrun's
"To enable traceback" stub. torchrun stops the other ranks within its 0.1 s monitor interval.

`python -m accel.launch SCRIPT ARGS` is the rank side of `accel launch`: it runs a user's script.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import shutil
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from accel.errors import UserError

ERROR_DIR_ENV = "ACCEL_ERROR_DIR"


@dataclass(frozen=True)
class LaunchSpec:
    """How many processes on this node, and where the other nodes meet (multi-node only)."""

    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    @classmethod
    def for_world(cls, world: int, nnodes: int = 1, node_rank: int = 0, master_addr: str | None = None,
                  master_port: int | None = None) -> LaunchSpec:
        """Split `world` processes evenly over `nnodes` nodes; refuse what does not split."""
        if nnodes < 1 or not 0 <= node_rank < nnodes:
            raise UserError(f"--node-rank {node_rank} must be between 0 and --nnodes - 1 ({nnodes - 1})")
        if world % nnodes:
            raise UserError(f"{world} processes do not split evenly over --nnodes {nnodes}; use a multiple of {nnodes} GPUs")
        if nnodes > 1 and master_addr is None:
            raise UserError("--nnodes > 1 needs --master-addr (the address of node 0) on every node")
        return cls(world // nnodes, nnodes, node_rank, master_addr, master_port)

    def torchrun_args(self) -> list[str]:
        args = ["--nproc-per-node", str(self.nproc), "--monitor-interval", "0.1", "--max-restarts", "0"]
        if self.nnodes == 1 and self.master_addr is None:
            return [*args, "--standalone"]  # a free local port: concurrent jobs do not collide
        args += ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank)]
        args += ["--master-addr", self.master_addr or "127.0.0.1", "--master-port", str(self.master_port or 29500)]
        return args


def launch(spec: LaunchSpec, module: str, args: list[str]) -> int:
    """Run `python -m module args` on `spec.nproc` local ranks; the job's exit code (0 when all succeed)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    error_dir = tempfile.mkdtemp(prefix="accel-ranks-")
    threads = str(max(1, (os.cpu_count() or 1) // spec.nproc))
    try:
        with _environment({ERROR_DIR_ENV: error_dir, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}), _quiet_torchrun():
            try:
                run(parse_args([*spec.torchrun_args(), "--module", module, *args]))
                return 0
            except ChildFailedError as failure:
                return _report(Path(error_dir), {rank: f.exitcode for rank, f in failure.failures.items()})
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)


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


def report_failure(message: str, exit_code: int) -> bool:
    """From a rank `launch` started: leave the message for the launcher and return True (print nothing).
    Elsewhere return False: the caller prints it (prefixed by the rank when there are several)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder or not Path(folder).is_dir():
        return False
    document = {"rank": rank(), "message": message, "exit_code": exit_code}
    (Path(folder) / f"rank-{rank()}.json").write_text(json.dumps(document))
    return True


def _report(error_dir: Path, exit_codes: dict[int, int]) -> int:
    """Print each distinct rank message once; the job's exit code (2 if any rank hit a user error)."""
    reports = sorted((json.loads(p.read_text()) for p in error_dir.glob("rank-*.json")), key=lambda r: r["rank"])
    messages: dict[str, list[int]] = {}
    for report in reports:
        messages.setdefault(report["message"], []).append(report["rank"])
    for message, ranks in messages.items():
        where = "" if len(messages) == 1 and len(ranks) > 1 else f"rank {', '.join(map(str, ranks))}: "
        print(f"error: {where}{message}", file=sys.stderr)
    if not reports:
        for failed_rank, code in sorted(exit_codes.items()):
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            print(f"error: rank {failed_rank} {how}", file=sys.stderr)
    if any(report["exit_code"] == 2 for report in reports):
        return 2
    return next((code for code in exit_codes.values() if code > 0), 1)


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """torchrun hands its own environment to the ranks: set ours there for the job's duration."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def _quiet_torchrun() -> Iterator[None]:
    """torchrun logs its agent's life (rendezvous, SIGTERMs to the other ranks); the ranks' own
    messages are what the user needs."""
    logger = logging.getLogger("torch.distributed")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_script(argv: list[str]) -> int:
    """The rank side of `accel launch`: run a user's script as __main__, reporting its failure."""
    if not argv:
        print("usage: python -m accel.launch SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        if code:
            report_failure(f"{argv[0]} exited with code {code}", code)
        return code
    except BaseException as error:  # noqa: BLE001 - any failure of the user's script is reported
        traceback.print_exc()
        message = f"{type(error).__name__}: {error}"
        if not report_failure(message, 1):
            print(f"error: rank {rank()}: {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_script(sys.argv[1:]))
