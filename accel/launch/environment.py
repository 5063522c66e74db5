"""torchrun's environment, both sides: what the launcher gives each rank (`LaunchSpec`), and what a
rank reads back from it (`rank`, `local_rank`, `rank_device`, `world_size`).

Stdlib only: library code asks for its rank without loading the supervisor, and the CLI reads
`DEFAULT_PORT` at start-up.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from accel.errors import UserError

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
