"""A rank that records how it came to be: `python -m fork_probe FOLDER EXIT_CODE...` (one code per rank),
started by tests/test_forked_ranks.py's supervisors, forked or spawned."""

import sys

TORCH_LOADED = "torch" in sys.modules  # before this module imports anything: loaded by the launcher, or not

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402

if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    record = {
        "rank": rank,
        "torch_loaded": TORCH_LOADED,
        "own_session": os.getsid(0) == os.getpid(),
        "parent": os.getppid(),
        "argv": sys.argv[1:],
        "sigint": "default" if signal.getsignal(signal.SIGINT) is signal.default_int_handler else "other",
        "sigterm": "default" if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL else "other",
        "threads": __import__("torch").get_num_threads(),
        "omp": os.environ["OMP_NUM_THREADS"],
    }
    (Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(record))
    sys.exit(int(sys.argv[2 + rank]))
