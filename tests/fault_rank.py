"""A rank that fails on purpose, for the fault-injection tests and benchmarks/faults.py.

    python -m accel.launch tests/fault_rank.py FOLDER KIND FAILING_RANK

Every rank joins the job, passes a barrier, leaves `ready-<rank>` (its pid) in FOLDER, then the
failing rank does KIND while the others wait for it in a collective. `failed-at` holds the moment
of the fault (time.time()), so a caller can measure how long the job took to end.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

folder, kind, failing = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()
dist.barrier()
(folder / f"ready-{rank}").write_text(str(os.getpid()))


def fault_now() -> None:
    (folder / "failed-at").write_text(repr(time.time()))


if kind == "write" and rank == 0:  # stopped in the middle of writing an output
    from accel.files.publish import write_file

    def write_half(temp: Path) -> None:
        temp.write_bytes(b"x" * 1000)
        (folder / "writing").write_text("")
        time.sleep(600)

    write_file(folder / "out.bin", write_half, replace=False)
if kind == "late-output" and rank == 0:  # writes an output a few seconds in, unless stopped first
    time.sleep(3)
    (folder / "output.txt").write_text("written")
if kind == "wait":
    time.sleep(600)
if rank == failing:
    fault_now()
    if kind == "raise":
        raise ValueError(f"rank {rank} cannot go on")
    if kind == "exit":
        os._exit(3)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        time.sleep(600)
dist.barrier()
print(f"rank {rank} finished")
