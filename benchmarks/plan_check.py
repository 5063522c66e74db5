"""accel plan's estimate on fake CUDA against torch.cuda.max_memory_allocated on a real GPU.

For each case the same work runs twice: on fake tensors under the tracker (what `accel plan`
reports) and on the real GPU with the peak read from the caching allocator; the ratio is printed.
Cases: FLUX.1-dev's transformer forward at 1024² (one block of each kind, as the plan measures),
Wan 14B's at 1280x720x81, and both VAE decodes at those sizes.

    python benchmarks/plan_check.py            (needs an NVIDIA GPU; gpu_check.py runs it)
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from accel.memory.build import build, cut_config
from accel.memory.weights import weight_bytes
from accel.memory.working import transformer_working, vae_working
from accel.models.flagships import FLAGSHIPS
from accel.models.registry import FAMILIES
from accel.parallel.mesh import Degrees

GiB = 2**30


def real_working(work: Callable[[], int], weights: int) -> int:
    """Peak bytes the allocator held during `work` beyond what was there before and the weights it built."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    work()
    return torch.cuda.max_memory_allocated() - before - weights


def main() -> int:
    if not torch.cuda.is_available():
        print("plan_check needs an NVIDIA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; working memory in GiB (weights excluded)")
    print(f"   {'case':<44}{'estimate':>10}{'measured':>10}{'ratio':>8}")
    for name in ("flux", "wan"):
        family, flagship = FAMILIES[name], FLAGSHIPS[name]
        transformer = flagship.of_kind("transformer")[0]
        vae = flagship.of_kind("vae")[0]
        cases = [
            (
                f"{flagship.title} transformer forward, {flagship.size.describe()}",
                lambda fake: transformer_working(family, flagship, flagship.size, Degrees(), "cuda", fake),
                weight_bytes(build(transformer, "meta", cut_config(transformer))),
            ),
            (
                f"{flagship.title} VAE decode, {flagship.size.describe()}",
                lambda fake: vae_working(flagship, flagship.size, "cuda", fake),
                weight_bytes(build(vae)),
            ),
        ]
        for label, work, weights in cases:
            estimate = work(True)
            measured = real_working(lambda: work(False), weights)
            print(
                f"   {label:<44}{estimate / GiB:>10.2f}{measured / GiB:>10.2f}{estimate / measured:>8.3f}", flush=True
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
