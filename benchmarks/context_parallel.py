"""Context-parallel attention: bytes against the minimum, 2 CPU ranks against 1, per-rank time on N ranks.

Ratios measured side by side in one run (absolute times on a shared machine mean little):

1. Bytes each rank sends per self-attention call, Ulysses / Ring / USP on 4 gloo ranks, against
   the theoretical minimum for the same shapes (target: equal).
2. Attention alone at a long sequence: 2 gloo ranks x 1 thread against 1 process x 1 thread
   (target >= 1.7x on a 2-core machine).
3. Per-rank attention time with the "fake" process group (one process plays rank 0 of N;
   collectives move nothing) for N = 2, 4, 8, against one device running the whole sequence:
   the compute a rank of an N-GPU job does. FLUX-1024 shapes (4096 + 512 tokens, 24 heads, dim 128,
   bf16) on a GPU; scaled down on the CPU.

    python benchmarks/context_parallel.py [--device cpu|cuda] [--tokens 8192] [--repeats 5]
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

MESHES = {"ulysses": (4, 1), "ring": (1, 4), "usp 2x2": (2, 2)}


def _groups(ulysses: int, ring: int, device: str) -> tuple[Any, Any]:
    from accel.parallel.mesh import Degrees, build_mesh

    mesh = build_mesh(Degrees(ulysses=ulysses, ring=ring), device)
    return (mesh.ulysses_group if ulysses > 1 else None), (mesh.ring_group if ring > 1 else None)


# --- 1. bytes ---------------------------------------------------------------------------------


def minimum_bytes(ulysses: int, ring: int, shard_bytes: int) -> int:
    """Per rank: Ulysses must move (U-1)/U of q, k, v and the output; Ring must bring in the K/V of
    the R-1 other ring ranks (a Ulysses head shard of U sequence shards is one shard's size)."""
    return 4 * shard_bytes * (ulysses - 1) // ulysses + 2 * shard_bytes * (ring - 1)


def _bytes_rank(rank: int, world: int, port: int, shape: tuple[int, int, int, int], results: Any) -> None:
    from accel.parallel.attention import usp_attention
    from accel.parallel.comm import TRAFFIC

    join_gloo(rank, world, port)
    batch, heads, tokens, dim = shape
    for name, (ulysses, ring) in MESHES.items():
        q, k, v = (torch.randn(batch, heads, tokens // world, dim, dtype=torch.bfloat16) for _ in range(3))
        TRAFFIC.reset()
        usp_attention(q, k, v, *_groups(ulysses, ring, "cpu"))
        if rank == 0:
            results[name] = (TRAFFIC.total_bytes, minimum_bytes(ulysses, ring, q.numel() * q.element_size()))


def bytes_section(shape: tuple[int, int, int, int]) -> None:
    results = mp.Manager().dict()
    mp.spawn(_bytes_rank, args=(4, free_port(), shape, results), nprocs=4)
    print(f"\n1. bytes sent per rank, one self-attention call, 4 ranks, shape {shape} bf16")
    print(f"   {'mode':<10}{'measured':>14}{'minimum':>14}{'ratio':>8}")
    for name in MESHES:
        sent, least = results[name]
        print(f"   {name:<10}{sent:>14,}{least:>14,}{sent / least:>8.3f}")


# --- 2. two CPU ranks against one ---------------------------------------------------------------


def _speed_rank(rank: int, world: int, port: int, shape: tuple[int, int, int, int], repeats: int, results: Any) -> None:
    import torch.distributed as dist

    from accel.parallel.attention import ring_attention, ulysses_attention

    join_gloo(rank, world, port)
    batch, heads, tokens, dim = shape
    q, k, v = (torch.randn(batch, heads, tokens // world, dim) for _ in range(3))
    group = dist.group.WORLD
    for name, fn in (("ulysses", ulysses_attention), ("ring", ring_attention)):
        seconds = median_time(lambda: fn(q, k, v, group), repeats, sync=dist.barrier, warmup=1)
        if rank == 0:
            results[name] = seconds


def speed_section(shape: tuple[int, int, int, int], repeats: int) -> None:
    from accel.parallel.kernels import attention_with_lse

    torch.set_num_threads(1)
    q, k, v = (torch.randn(*shape) for _ in range(3))
    single = median_time(lambda: attention_with_lse(q, k, v), repeats, warmup=1)
    results = mp.Manager().dict()
    mp.spawn(_speed_rank, args=(2, free_port(), shape, repeats, results), nprocs=2)
    print(f"\n2. attention alone, shape {shape} float32, 1 thread per process")
    print(f"   1 process: {single:.3f} s")
    for name in ("ulysses", "ring"):
        print(f"   2 ranks, {name:<8}: {results[name]:.3f} s   speedup {single / results[name]:.2f}x (target >= 1.7x)")


# --- 3. per-rank time with the fake process group -------------------------------------------------


def _fake_ranks(_index: int, shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, repeats: int) -> None:
    """One process plays rank 0 of each N in turn (the fake group re-made per N), printing each line
    as soon as it is measured, so a run stopped at a time budget keeps what it measured."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from accel.parallel.attention import usp_attention
    from accel.parallel.kernels import attention_with_lse

    batch, heads, tokens, dim = shape
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    q, k, v = (torch.randn(*shape, dtype=dtype, device=device) for _ in range(3))
    single = median_time(lambda: attention_with_lse(q, k, v), repeats, sync, warmup=1)
    print(
        f"\n3. per-rank attention time, fake process group, shape {shape} {str(dtype).removeprefix('torch.')} on "
        f"{device}"
    )
    print(f"   one device, whole sequence: {single * 1000:.1f} ms", flush=True)
    for world in (2, 4, 8):
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
        shard = -(-tokens // world)
        q, k, v = (torch.randn(batch, heads, shard, dim, dtype=dtype, device=device) for _ in range(3))
        cells = []
        for name, (ulysses, ring) in (("ulysses", (world, 1)), ("ring", (1, world))):
            if heads % ulysses:
                continue
            groups = _groups(ulysses, ring, device)
            seconds = median_time(lambda: usp_attention(q, k, v, *groups), repeats, sync, warmup=1)
            cells.append(f"{name} {seconds * 1000:.1f} ms ({single / seconds:.2f}x, ideal {world}x)")
        dist.destroy_process_group()
        print(f"   N={world}: " + ";  ".join(cells), flush=True)


def fake_section(shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, repeats: int) -> None:
    mp.spawn(_fake_ranks, args=(shape, dtype, device, repeats), nprocs=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=8192, help="sequence length of section 2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--skip-cpu-ranks", action="store_true", help="only section 3 (gpu_check.py: sections 1-2 are CPU figures)"
    )
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, device {args.device}", flush=True)
    if not args.skip_cpu_ranks:
        bytes_section((1, 24, 4608, 128))
        speed_section((1, 8, args.tokens, 64), args.repeats)
    if args.device == "cuda":
        fake_section((1, 24, 4608, 128), torch.bfloat16, "cuda", args.repeats)
    else:
        fake_section((1, 24, 1152, 64), torch.float32, "cpu", args.repeats)


if __name__ == "__main__":
    main()
