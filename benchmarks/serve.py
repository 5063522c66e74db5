"""`accel serve` against `accel run` invocations: throughput (requests per minute) and p50 / p95
latency under a closed loop of 1, 4 and 16 concurrent clients, on one replica of 2 ranks and two
replicas of 1 rank (the same ranks), beside as many sequential `accel run --gpus 2` invocations as
requests (each loads and warms up the pipeline again). CPU gloo ranks; ratios, not absolute times.
With --batching: one replica of one process with and without `--max-batch` (waiting requests that
differ only in seed run as one pipeline call), at the same client counts.

    python benchmarks/serve.py [--models tiny-flux tiny-wan] [--requests 16] [--runs 3] [--clients 1 4 16]
    python benchmarks/serve.py --batching [--max-batch 4 16] [--requests 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_serve import Server, start  # noqa: E402  (the tests' server start-up: free port, wait for /health)

ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
ENDPOINT = {"tiny-flux": ("/v1/images/generations", {}), "tiny-wan": ("/v1/videos/generations", {})}


@dataclass
class Row:
    model: str
    setup: str
    clients: int
    requests: int
    seconds: float
    latencies: list[float]

    @property
    def per_minute(self) -> float:
        return 60.0 * self.requests / self.seconds

    def percentile(self, share: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))]


async def closed_loop(server: Server, model: str, clients: int, requests: int) -> tuple[float, list[float]]:
    """`clients` clients, each sending its next request when its last one is answered, `requests` in all."""
    path, extra = ENDPOINT[model]
    remaining = list(range(requests))
    latencies: list[float] = []

    async def client(http: httpx.AsyncClient) -> None:
        while remaining:
            seed = remaining.pop()
            sent = time.perf_counter()
            response = await http.post(
                f"{server.url}{path}", json={"prompt": "a red fox in the snow", "seed": seed, **extra}
            )
            response.raise_for_status()
            latencies.append(time.perf_counter() - sent)

    start_s = time.perf_counter()
    async with httpx.AsyncClient(timeout=900) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return time.perf_counter() - start_s, latencies


def served(
    model: str, replicas: int, clients_levels: list[int], requests: int, max_batch: int | None = None
) -> list[Row]:
    if max_batch is None:
        server = start(model, "--gpus", "2", "--replicas", str(replicas), "--max-queue", "64")
        plural = ("s", "") if replicas > 1 else ("", "s")
        setup = f"serve, {replicas} replica{plural[0]} × {2 // replicas} rank{plural[1]}"
    else:
        server = start(model, "--max-batch", str(max_batch), "--max-queue", "64")
        setup = f"serve, 1 process, --max-batch {max_batch}"
    rows = []
    try:
        asyncio.run(
            closed_loop(server, model, 1, 1)
        )  # one request first: the page cache and allocator are warm for all levels
        for clients in clients_levels:
            seconds, latencies = asyncio.run(closed_loop(server, model, clients, requests))
            rows.append(
                Row(
                    model,
                    setup,
                    clients,
                    requests,
                    seconds,
                    latencies,
                )
            )
    finally:
        server.stop()
    return rows


def runs(model: str, count: int) -> Row:
    """`count` sequential `accel run --gpus 2` invocations: start-up, load, warm-up and one generation each."""
    latencies = []
    for seed in range(count):
        sent = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "accel.cli",
                "run",
                model,
                "--gpus",
                "2",
                "--seed",
                str(seed),
                "--warmup",
                "1",
                "--out",
                f"/tmp/accel-bench-serve-{os.getpid()}-{seed}{'.png' if model == 'tiny-flux' else '.mp4'}",
            ],
            env=ENV,
            check=True,
            capture_output=True,
        )
        latencies.append(time.perf_counter() - sent)
    return Row(model, "accel run each time", 1, count, sum(latencies), latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-flux", "tiny-wan"])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3, help="sequential accel run invocations per model")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--batching", action="store_true", help="--max-batch 1 against --max-batch N instead")
    parser.add_argument("--max-batch", type=int, nargs="+", default=[4, 16])
    args = parser.parse_args()
    rows: list[Row] = []
    for model in args.models:
        if args.batching:
            for most in (1, *args.max_batch):
                rows += served(model, 1, args.clients, args.requests, max_batch=most)
            continue
        rows.append(runs(model, args.runs))
        for replicas in (1, 2):
            rows += served(model, replicas, args.clients, args.requests)
    baseline = "--max-batch 1" if args.batching else "accel run"
    print(f"| model | setup | clients | requests | requests/min | × {baseline} | p50 latency (s) | p95 latency (s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        base = next(
            r
            for r in rows
            if r.model == row.model
            and (
                r.clients == row.clients and r.setup.endswith(baseline)
                if args.batching
                else r.setup.startswith(baseline)
            )
        )
        print(
            f"| {row.model} | {row.setup} | {row.clients} | {row.requests} | {row.per_minute:.1f} | "
            f"{row.per_minute / base.per_minute:.1f}× | "
            f"{statistics.median(row.latencies):.2f} | {row.percentile(0.95):.2f} |"
        )


if __name__ == "__main__":
    main()
