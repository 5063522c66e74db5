"""A replica of two ranks whose rank 1 fails on one request, for tests/test_serve.py.

    python -m accel.launch tests/serve_fault.py

Both ranks run tiny-flux (no layout: each generates alone, as the ranks of a replica do before
their first collective); on the first job rank 1's transformer raises. Rank 0 prints each outcome.
"""

import torch.distributed as dist

import accel
from accel.recipe import Recipe
from accel.serve.replica import IDLE, Replica
from accel.serve.requests import Job

dist.init_process_group("gloo")
rank = dist.get_rank()
group = dist.new_group([0, 1], timeout=IDLE, backend="gloo")
pipe = accel.load_pipeline("tiny-flux")
pipe.set_progress_bar_config(disable=True)
recipe = Recipe.from_dict({"model": {"name": "tiny-flux"}, "generate": {"steps": 2, "height": 32, "width": 32}})
handle = accel.apply(pipe, recipe)
forward = pipe.transformer.forward


def out_of_memory_once(*args: object, **kwargs: object) -> object:
    pipe.transformer.forward = forward  # the next request finds the memory free again
    raise RuntimeError("CUDA out of memory (injected on rank 1)\nsecond line")


replica = Replica(pipe, handle, recipe, True, "image", group, 0)
if rank == 1:
    pipe.transformer.forward = out_of_memory_once
    replica.follow()
else:
    for job in (Job(1, "image", {"seed": 1}), Job(2, "image", {"seed": 1})):
        outcome = replica.lead(job)
        print(f"job {job.id}: ok={outcome.ok} files={len(outcome.files)} error={outcome.error}", flush=True)
    replica.lead(Job(-1, "image", {}, stop=True))
