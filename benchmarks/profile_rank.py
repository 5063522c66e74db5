"""Where one rank's forward time goes: torch.profiler over a real-size transformer as rank 0 of N.

BENCHMARKS.md's fake-group figures left FLUX.1-dev at 1024² scaling below the arithmetic on an H100
(Wan scales at the ideal). This prints, for one device and for rank 0 of N under Ulysses, the
wall time per forward, the GPU's busy time (sum of kernel times), the CPU time spent in CUDA launch
and synchronisation calls, and the top kernels and CPU ops: a rank whose GPU is idle most of the
forward is launch- or sync-bound, not compute-bound.

    python benchmarks/profile_rank.py [--family flux] [--worlds 1,4] [--repeats 2] [--compile]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_parallel import REAL, _inputs, _transformer  # noqa: E402
from timing import median_time  # noqa: E402


def _profile(run, repeats: int) -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    plain = median_time(run, repeats, torch.cuda.synchronize, warmup=1)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / repeats
    # Kernels only: key_averages() also gives each aten op the time of the kernels it launched.
    gpu = sum(e.self_device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA) / repeats / 1e3
    events = prof.key_averages()
    launches = {e.key: e for e in events if e.key.startswith("cuda") and e.key != "cudaDeviceSynchronize"}
    print(
        f"     {plain * 1e3:.1f} ms per forward unprofiled; profiled {wall * 1e3:.1f} ms, GPU kernels busy "
        f"{gpu:.1f} ms ({gpu / plain / 10:.0f} % of the unprofiled time)"
    )
    for key, e in sorted(launches.items(), key=lambda kv: -kv[1].self_cpu_time_total)[:6]:
        print(f"       {key:<34} {e.count // repeats:>6} calls  {e.self_cpu_time_total / repeats / 1e3:8.1f} ms CPU")
    print("     top GPU kernels / ops:")
    print(events.table(sort_by="self_device_time_total", row_limit=10, max_name_column_width=60))
    print("     top CPU ops:")
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


def main() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from accel.models.registry import FAMILIES
    from accel.parallel.mesh import Degrees, build_mesh
    from accel.parallel.engine import ContextParallel
    from accel.parallel.plan import resolve_plan

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="flux", choices=sorted(REAL))
    parser.add_argument("--worlds", default="1,4")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="regional compile of the blocks, as --compile does")
    args = parser.parse_args()
    spec = REAL[args.family]
    transformer = _transformer(args.family, spec, False, torch.bfloat16, "cuda")
    inputs = _inputs(args.family, spec, 1, torch.bfloat16, "cuda")
    if args.compile:
        from accel.optimize.compile import CompiledRegions

        CompiledRegions(transformer, FAMILIES[spec.get("family", args.family)].blocks, "blocks", "default")
    print(
        f"{args.family}, bf16{', compiled blocks' if args.compile else ''}, {torch.cuda.get_device_name(0)}, "
        f"torch {torch.__version__}",
        flush=True,
    )
    with torch.no_grad():
        for world in (int(w) for w in args.worlds.split(",")):
            print(
                f"\n   N={world}" + (" (one device)" if world == 1 else ", Ulysses, rank 0 of a fake group"), flush=True
            )
            if world == 1:
                _profile(lambda: transformer(**inputs), args.repeats)
                continue
            dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
            engine = ContextParallel(
                transformer,
                resolve_plan(FAMILIES[spec.get("family", args.family)].plan_for(transformer), transformer),
                build_mesh(Degrees(ulysses=world), "cuda"),
            )
            _profile(lambda: transformer(**inputs), args.repeats)
            engine.remove()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
