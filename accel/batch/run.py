"""Rank 0's side of `accel batch`: the file's items for this shard, less those a manifest in the
output folder already has done, through every replica from one queue (a free replica takes the
next item), each outcome written to the folder as it comes.

A failed item is tried again at the end of the queue until it has failed 1 + `retries` times
counting earlier runs; then it stays recorded as failed and is not tried again. A line that is not
a request the pipeline takes is reported with its number and skipped (with `strict`, the batch is
refused before any generation). SIGINT / SIGTERM stops the running items at their next step and
records nothing for them: a rerun of the same command does them.
"""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accel.batch.items import BadLine, Item, digest, read_items, strict_refusal
from accel.batch.manifest import DONE, FAILED, WHOLE, Manifest, Record, Shard
from accel.errors import UserError
from accel.serve.requests import MAX_IMAGES, SEED_LIMIT, BadRequest, Job, to_job

if TYPE_CHECKING:
    from accel.recipe import Recipe
    from accel.serve.dispatch import Dispatcher
    from accel.serve.replica import Outcome
    from accel.serve.server import Started

INTERRUPTED = 130  # a shell's code for a run stopped by Ctrl-C


@dataclass(frozen=True)
class BatchOptions:
    requests: Path
    out: Path
    replicas: int = 1
    shard: Shard = WHOLE
    retries: int = 2  # a failed item is tried at most 1 + retries times, over all runs
    strict: bool = False  # a bad line refuses the batch instead of being skipped
    loras: dict[str, str] = field(default_factory=dict)  # LoRAs requests may choose, by name
    max_loras: int = 4
    max_batch: int = 1  # outputs one pipeline call may make for several items (accel/serve/batching.py)


@dataclass
class Tally:
    """What this run did, for the summary and the exit code."""

    total: int = 0  # this shard's items
    already: int = 0  # done by an earlier run
    done: int = 0
    failed: list[Item] = field(default_factory=list)  # out of tries, in this run or before
    bad: list[BadLine] = field(default_factory=list)
    interrupted: bool = False

    @property
    def exit_code(self) -> int:
        return INTERRUPTED if self.interrupted else 1 if self.failed else 0


def default_seed(base: int, item: Item) -> int:
    """A request without a seed gets one from its line, so a rerun makes the same output; each
    line's n images take seeds of their own."""
    return (base + (item.line - 1) * MAX_IMAGES) % (SEED_LIMIT - MAX_IMAGES)


def what_makes(recipe: Recipe, loras: dict[str, str]) -> str:
    """What besides a line's own fields decides its output: the model and the [generate] (its seed
    seeds lines without one), [cache], [quant] settings and VAE tiling, and the files the LoRA names
    stand for. A rerun with other ones makes other outputs, so its items are not the done ones; the
    layout ([parallel], [memory], [compile], the parallel decode) changes nothing beyond rounding, so
    a run resumed on more GPUs skips what fewer made."""
    settings = recipe.to_dict()
    made_by = {name: settings[name] for name in ("model", "generate", "cache", "quant")}
    made_by["vae_tiling"] = recipe.vae.tiling
    made_by["loras"] = dict(sorted(loras.items()))
    return json.dumps(made_by, sort_keys=True, default=str)


def plan(
    options: BatchOptions,
    served: Any,
    base_seed: int,
    manifest: Manifest,
    tally: Tally,
    made_by: str = "",
) -> list[tuple[Item, Job]]:
    """This shard's items still to do as jobs (a job's id is its item's line); bad lines and items
    out of tries noted. An item is known by its line's fields and `made_by` (`what_makes`)."""
    items, bad = read_items(options.requests)
    items = [replace(item, digest=digest(item.digest + made_by)) for item in items] if made_by else items
    ordinal = {line: position for position, line in enumerate(sorted([i.line for i in items] + [b.line for b in bad]))}
    jobs: list[tuple[Item, Job]] = []
    for item in items:
        if not options.shard.takes(ordinal[item.line]):
            continue
        try:
            job = _job(item, served, base_seed)
        except BadRequest as refused:
            bad.append(BadLine(item.line, refused.message))
            continue
        tally.total += 1
        if manifest.done(item):
            tally.already += 1
        elif manifest.failures(item) > options.retries:
            tally.failed.append(item)
        else:
            jobs.append((item, job))
    tally.bad = sorted((b for b in bad if options.shard.takes(ordinal[b.line])), key=lambda b: b.line)
    if options.strict and tally.bad:
        raise UserError(strict_refusal(options.requests, tally.bad))
    return jobs


def _job(item: Item, served: Any, base_seed: int) -> Job:
    try:
        request = item.request(served.output)
    except ValueError as problem:
        raise BadRequest(None, str(problem)) from None
    if request.seed is None:
        request = request.model_copy(update={"seed": default_seed(base_seed, item)})
    return to_job(request, served, item.line)


def run_batch(
    recipe: Recipe,
    options: BatchOptions,
    announce: Callable[[str], None],
    progress: Callable[[int], Any],
) -> int:
    """Load the pipeline on every rank, run the batch from rank 0; rank 0's exit code (0 elsewhere)."""
    from accel.recipe.limits import prompt_chars
    from accel.serve.limits import Limits
    from accel.serve.server import run_replicas

    tally = Tally()

    def lead(started: Started) -> None:
        from accel.serve.dispatch import Dispatcher

        started.ready()
        replicas = started.runners()
        # Each replica has its next items (a batch's worth) waiting when it finishes one.
        most = started.served.max_batch
        dispatcher = Dispatcher(replicas, (most + 1) * len(replicas), board=started.board, max_batch=most)
        try:  # whatever happens, the other replicas get their stop
            manifest = Manifest(options.out, options.shard)
            made_by = what_makes(recipe, options.loras)
            jobs = plan(options, started.served, recipe.generate.seed, manifest, tally, made_by)
            for line in tally.bad:
                announce(f"skipped {options.requests} {line}")
            suffix = ".png" if started.served.output == "image" else ".mp4"
            _drive(dispatcher, jobs, suffix, options, manifest, tally, progress)
        finally:
            dispatcher.stop()
        _summarize(options, tally, announce)

    # The file is the operator's own: no per-request work or prompt bound beyond what a recipe takes.
    limits = Limits(max_prompt=prompt_chars(), max_work=1 << 62)
    run_replicas(
        recipe,
        options.replicas,
        limits,
        lead,
        announce,
        "accel batch",
        warm_up=False,
        loras=options.loras,
        max_loras=options.max_loras,
        max_batch=options.max_batch,
    )
    return tally.exit_code


def _drive(
    dispatcher: Dispatcher,
    jobs: list[tuple[Item, Job]],
    suffix: str,
    options: BatchOptions,
    manifest: Manifest,
    tally: Tally,
    progress: Callable[[int], Any],
) -> None:
    from accel import watchdog

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda _s, _f: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with watchdog.idle(), progress(len(jobs)) as bar:
            asyncio.run(_feed(dispatcher, jobs, suffix, options, manifest, tally, bar, stop))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    tally.interrupted = stop.is_set()


async def _feed(
    dispatcher: Dispatcher,
    jobs: list[tuple[Item, Job]],
    suffix: str,
    options: BatchOptions,
    manifest: Manifest,
    tally: Tally,
    bar: Any,
    stop: threading.Event,
) -> None:
    waiting = collections.deque(jobs)
    running: dict[asyncio.Future[Outcome], tuple[Item, Job]] = {}
    while (waiting or running) and not stop.is_set():
        while waiting and len(running) < dispatcher.max_queue:
            item, job = waiting.popleft()
            running[dispatcher.enqueue(job)] = (item, job)
        dispatcher.start()  # after the first items are queued, so the first call can batch them
        finished, _ = await asyncio.wait(running, timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
        for future in finished:
            item, job = running.pop(future)
            outcome = future.result()
            if outcome.cancelled is not None:  # stopped by a signal: a rerun does it
                continue
            if outcome.ok:
                names = manifest.write_outputs(item, suffix, outcome.files)
                manifest.append(
                    Record.of(
                        item, DONE, files=names, seeds=outcome.seeds, seconds=outcome.seconds, batch=outcome.batch
                    )
                )
                tally.done += 1
                bar.advance(item.key, None)
                continue
            manifest.append(Record.of(item, FAILED, seconds=outcome.seconds, error=outcome.error))
            if manifest.failures(item) > options.retries:
                tally.failed.append(item)
                bar.advance(item.key, outcome.error)
            else:
                waiting.append((item, job))  # again, after the others
    if stop.is_set():
        dispatcher.cancel_all("shutdown")
        while not dispatcher.idle():
            await asyncio.sleep(0.05)


def _summarize(options: BatchOptions, tally: Tally, announce: Callable[[str], None]) -> None:
    parts = [f"{tally.done} done", f"{tally.already} done before"]
    if tally.failed:
        parts.append(
            f"{len(tally.failed)} failed ({', '.join(item.key for item in tally.failed[:5])}"
            + (", …" if len(tally.failed) > 5 else "")
            + "; the manifest has why)"
        )
    if tally.bad:
        parts.append(f"{len(tally.bad)} bad line{'s' if len(tally.bad) > 1 else ''} skipped")
    where = f"{options.out / options.shard.manifest}"
    shard = f" (shard {options.shard.index}/{options.shard.count})" if options.shard.count > 1 else ""
    announce(f"batch{shard}: {tally.total} items: {', '.join(parts)}; outputs in {options.out}, manifest {where}")
    if tally.interrupted:
        announce("interrupted: the items left are not recorded; rerun the same command to resume")
    elif tally.failed:
        announce("rerunning the same command does not try the failed items again: raise --retries to")
