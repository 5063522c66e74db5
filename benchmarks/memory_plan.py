"""accel plan over every flagship: the layout chosen on 1 / 2 / 4 / 8 GPUs of 80 GB (H100), 48 GB (L40S)
and 24 GB (RTX 4090), from one measure per model on fake CUDA; prints a Markdown table. Group offload's
speed is the card's (accel/memory/speed.py CARDS).

    python benchmarks/memory_plan.py [--models flux2,wan] [--gpus 1,2,4,8]
"""

from __future__ import annotations

import argparse
import time

from accel.memory.candidates import RESERVED, GiB
from accel.memory.plan import make_plan
from accel.models.flagships import FLAGSHIPS

# What torch sees of each card (total_memory): H100 80GB 81559 MiB, L40S 46068 MiB, RTX 4090 24564 MiB.
CARDS = (("H100 80 GB", 81559 * 2**20), ("L40S 48 GB", 46068 * 2**20), ("RTX 4090 24 GB", 24564 * 2**20))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(FLAGSHIPS))
    parser.add_argument("--gpus", default="1,2,4,8")
    args = parser.parse_args()
    print("| model, size | GPUs | " + " | ".join(name for name, _ in CARDS) + " |")
    print("|---|---|" + "---|" * len(CARDS))
    for model in args.models.split(","):
        for gpus in (int(n) for n in args.gpus.split(",")):
            start = time.perf_counter()
            cells = []
            for _, limit in CARDS:  # one measure per model, shared by the plans of every card and GPU count
                plan = make_plan(model, gpus, limit / GiB)
                chosen = plan.chosen
                if chosen is None:
                    smallest = plan.smallest
                    cells.append(
                        f"no fit (smallest {(smallest.estimate.peak + RESERVED) / GiB:.1f} GiB: {smallest.describe()})"
                    )
                else:
                    cells.append(
                        f"{chosen.describe()}: {(chosen.estimate.peak + RESERVED) / GiB:.1f} GiB, "
                        f"~{chosen.speedup:.1f}×"
                    )
            title = f"{plan.flagship.title}, {plan.size.describe()}"
            print(
                f"| {title} | {gpus} | " + " | ".join(cells) + f" |  <!-- {time.perf_counter() - start:.0f} s -->",
                flush=True,
            )


if __name__ == "__main__":
    main()
