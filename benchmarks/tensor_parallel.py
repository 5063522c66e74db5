"""Tensor parallelism: bytes against the theoretical count, and TP × CP against CP alone, per step.

Ratios measured side by side in one run, on gloo CPU ranks (one thread each):

1. Bytes each rank sends in one transformer step (one forward) of a FLUX.1-shaped transformer
   under tp = 2 and tp = 4, against the count a ring all-reduce needs: every row-wise layer sums
   its output, tokens × width × dtype bytes, of which a rank sends 2 (n - 1) / n (target: equal).
2. Time per step on 4 ranks: Ulysses 4 against tp 2 × Ulysses 2 and tp 4, and on 2 ranks Ulysses 2
   against tp 2, each against one process (same run). On CPU, TP pays an all-reduce of the whole
   activation after every row-wise layer where Ulysses moves a quarter of Q, K, V and the output:
   the ratio says what TP costs in exchange for holding 1/tp of the block weights.
3. Host memory of loading: a pipeline with a FLUX.1-shaped transformer (1024 wide, 4 double and
   8 single blocks, float32, about 1.2 GB) saved to disk, loaded by 2 ranks whole and as tp = 2
   slices: each rank's peak resident memory and its transformer's parameter bytes.

    python benchmarks/tensor_parallel.py [--tokens 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.multiprocessing as mp
from ranks import join_gloo

from accel.launch.environment import free_port
from timing import median_time

TEXT_TOKENS = 128


def flux_shaped(seed: int = 0) -> Any:
    """A FLUX.1 transformer with 8 heads of 64 (512 wide), 2 double and 2 single blocks, seeded."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        in_channels=64,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=64,
        num_attention_heads=8,
        joint_attention_dim=256,
        pooled_projection_dim=128,
        axes_dims_rope=(16, 24, 24),
    ).eval()


def inputs(tokens: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(1)
    side = int(tokens**0.5)
    image_ids = torch.stack(
        torch.meshgrid(torch.zeros(1), torch.arange(side).float(), torch.arange(side).float(), indexing="ij"), -1
    ).reshape(-1, 3)
    return dict(
        hidden_states=torch.randn(1, side * side, 64, generator=generator),
        encoder_hidden_states=torch.randn(1, TEXT_TOKENS, 256, generator=generator),
        pooled_projections=torch.randn(1, 128, generator=generator),
        timestep=torch.tensor([0.5]),
        img_ids=image_ids,
        txt_ids=torch.zeros(TEXT_TOKENS, 3),
        return_dict=False,
    )


def theoretical_bytes(transformer: Any, tokens: int, tp: int) -> int:
    """Σ over row-wise layers of (tokens it sees × its output width × 4 bytes) × 2 (tp - 1) / tp."""
    from accel.models.registry import FAMILIES
    from accel.parallel.tensor import planned_layers, resolve_tensor_plan

    image, text = tokens, TEXT_TOKENS
    seen = {
        "to_out.0": image,
        "to_add_out": text,
        "ff.net.2": image,
        "ff_context.net.2": text,
        "proj_out": image + text,
    }
    total = 0
    for layer in planned_layers(transformer, resolve_tensor_plan(FAMILIES["flux"].tensor, transformer)):
        if layer.style == "rowwise":
            suffix = next(key for key in seen if layer.path.endswith(key))
            total += seen[suffix] * layer.module.weight.shape[0] * 4
    return total * 2 * (tp - 1) // tp


def _apply(transformer: Any, degrees: Any) -> None:
    from accel.models.registry import FAMILIES
    from accel.parallel.mesh import build_mesh
    from accel.parallel.engine import ContextParallel
    from accel.parallel.plan import resolve_plan
    from accel.parallel.tensor import TensorParallel, resolve_tensor_plan

    mesh = build_mesh(degrees, "cpu")
    if degrees.tp > 1:
        TensorParallel(transformer, resolve_tensor_plan(FAMILIES["flux"].tensor, transformer), mesh.tp_group)
    if degrees.sequence > 1:
        ContextParallel(transformer, resolve_plan(FAMILIES["flux"].parallel, transformer), mesh)


def _rank(
    rank: int, world: int, port: int, layouts: dict[str, dict[str, int]], tokens: int, repeats: int, results: Any
) -> None:
    import torch.distributed as dist

    from accel.parallel.comm import TRAFFIC
    from accel.parallel.mesh import Degrees

    join_gloo(rank, world, port)
    arguments = inputs(tokens)
    for name, degrees in layouts.items():
        transformer = flux_shaped()
        _apply(transformer, Degrees(**degrees))
        with torch.no_grad():
            TRAFFIC.reset()
            transformer(**arguments)
            sent = TRAFFIC.total_bytes
            seconds = median_time(lambda: transformer(**arguments), repeats, sync=dist.barrier, warmup=1)
        if rank == 0:
            results[name] = (sent, seconds)


def run_layouts(
    world: int, layouts: dict[str, dict[str, int]], tokens: int, repeats: int
) -> dict[str, tuple[int, float]]:
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(world, free_port(), layouts, tokens, repeats, results), nprocs=world)
    return dict(results)


def _anonymous_bytes() -> int:
    """This process's private resident memory (RssAnon): what it allocated itself. Pages of a
    memory-mapped checkpoint are the page cache's, shared by every rank of the node, so the whole
    resident size (VmRSS) would count them once per rank."""
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _load_rank(rank: int, world: int, port: int, folder: str, sliced: bool, results: Any) -> None:
    import threading
    import time

    import accel

    join_gloo(rank, world, port)
    peak, done = [_anonymous_bytes()], threading.Event()
    before = peak[0]

    def sample() -> None:  # the peak while loading, every 5 ms
        while not done.is_set():
            peak[0] = max(peak[0], _anonymous_bytes())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    pipe = accel.load_pipeline(folder, "float32", tp_slice=(world, rank) if sliced else None)
    done.set()
    sampler.join()
    held = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
    results[(sliced, rank)] = (max(peak[0], _anonymous_bytes()) - before, held)


def memory_section() -> None:
    import tempfile

    import accel
    from diffusers import FluxTransformer2DModel

    with tempfile.TemporaryDirectory() as folder:
        pipe = accel.load_pipeline("tiny-flux")
        torch.manual_seed(0)
        tiny = pipe.transformer.config
        pipe.transformer = FluxTransformer2DModel(
            in_channels=tiny.in_channels,
            num_layers=4,
            num_single_layers=8,
            attention_head_dim=128,
            num_attention_heads=8,
            joint_attention_dim=tiny.joint_attention_dim,
            pooled_projection_dim=tiny.pooled_projection_dim,
            axes_dims_rope=(16, 56, 56),
        )
        whole = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
        pipe.save_pretrained(folder)
        del pipe
        results = mp.Manager().dict()
        for sliced in (False, True):
            mp.spawn(_load_rank, args=(2, free_port(), folder, sliced, results), nprocs=2)
    print(
        f"\n3. host memory of loading, 2 ranks, transformer {whole / 2**30:.2f} GiB float32: each rank's peak private "
        "memory"
    )
    print("   (RssAnon, sampled every 5 ms) while loading, and its transformer's parameters")
    print(f"   {'load':<14}{'rank':>5}{'loading peak':>14}{'transformer':>14}{'both ranks':>12}")
    for sliced in (False, True):
        node = sum(results[(sliced, rank)][0] for rank in range(2))
        for rank in range(2):
            peak, held = results[(sliced, rank)]
            label = "tp 2 slices" if sliced else "whole"
            print(f"   {label:<14}{rank:>5}{peak / 2**30:>13.2f}G{held / 2**30:>13.2f}G{node / 2**30:>11.2f}G")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024, help="image tokens (a square number)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--skip-memory", action="store_true", help="leave out section 3 (writes about 1.2 GB to a temporary folder)"
    )
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPU cores; FLUX.1-shaped transformer, 8 heads x 64, "
        f"{args.tokens} image + {TEXT_TOKENS} text tokens, float32, 1 thread per rank"
    )
    torch.set_num_threads(1)
    transformer, arguments = flux_shaped(), inputs(args.tokens)
    with torch.no_grad():
        single = median_time(lambda: transformer(**arguments), args.repeats, warmup=1)
    two = run_layouts(2, {"ulysses 2": {"ulysses": 2}, "tp 2": {"tp": 2}}, args.tokens, args.repeats)
    four = run_layouts(
        4,
        {"ulysses 4": {"ulysses": 4}, "tp 2 x ulysses 2": {"tp": 2, "ulysses": 2}, "tp 4": {"tp": 4}},
        args.tokens,
        args.repeats,
    )
    print("\n1. bytes sent per rank in one transformer step")
    print(f"   {'layout':<18}{'measured':>14}{'theoretical':>14}{'ratio':>8}")
    for name, results, tp in (("tp 2", two, 2), ("tp 4", four, 4)):
        sent, expected = results[name][0], theoretical_bytes(flux_shaped(), args.tokens, tp)
        print(f"   {name:<18}{sent:>14,}{expected:>14,}{sent / expected:>8.3f}")
    print(f"\n2. time per step (one process: {single * 1000:.0f} ms)")
    print(f"   {'layout':<18}{'ms':>8}{'vs 1 process':>14}{'vs Ulysses alone':>18}{'bytes/rank':>14}")
    for results, baseline in ((two, "ulysses 2"), (four, "ulysses 4")):
        for name, (sent, seconds) in results.items():
            versus_one, versus_ulysses = single / seconds, results[baseline][1] / seconds
            print(f"   {name:<18}{seconds * 1000:>8.0f}{versus_one:>13.2f}x{versus_ulysses:>17.2f}x{sent:>14,}")
    if not args.skip_memory:
        memory_section()


if __name__ == "__main__":
    main()
