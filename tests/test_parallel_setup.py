"""Degrees and launch settings: decided from numbers alone, before any rank starts."""

from __future__ import annotations

import pytest

from accel.errors import UserError
from accel.launch import LaunchSpec
from accel.parallel.mesh import Degrees, resolve_degrees
from accel.recipe import ParallelSection


@pytest.mark.parametrize(
    "gpus, heads, expected",
    [
        (8, 24, Degrees(ulysses=8)),  # FLUX: 24 heads take Ulysses 8
        (8, 12, Degrees(ulysses=4, ring=2)),
        (6, 4, Degrees(ulysses=2, ring=3)),
        (3, 4, Degrees(ring=3)),
        (4, None, Degrees(ulysses=4)),  # heads unknown before loading: the ranks check again
    ],
)
def test_only_gpus_chooses_degrees(gpus: int, heads: int | None, expected: Degrees) -> None:
    assert resolve_degrees(ParallelSection(gpus=gpus), heads) == expected


def test_given_degrees_are_kept_and_checked() -> None:
    assert resolve_degrees(ParallelSection(ulysses=2, ring=2), 24) == Degrees(ulysses=2, ring=2)
    assert resolve_degrees(ParallelSection(gpus=4, ulysses=2, ring=2), 24) == Degrees(ulysses=2, ring=2)
    with pytest.raises(UserError, match=r"^\[parallel\] ulysses = 4 does not divide the 6 attention heads of m; use ulysses = 2, ring = 2"):
        resolve_degrees(ParallelSection(ulysses=4), 6, "m")
    with pytest.raises(UserError, match=r"^\[parallel\] gpus = 3 does not split into cfg = 2 halves"):
        resolve_degrees(ParallelSection(gpus=3, cfg=2), 24)


def test_launch_spec_single_node_uses_a_free_port_and_multi_node_the_given_one() -> None:
    address, port = LaunchSpec.for_world(2).rendezvous()
    assert address == "127.0.0.1" and 1024 <= port < 65536
    assert LaunchSpec.for_world(2, master_port=29411).rendezvous() == ("127.0.0.1", 29411)  # --master-port alone is honoured
    spec = LaunchSpec.for_world(8, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29400)
    assert (spec.nproc, spec.world, spec.rendezvous()) == (4, 8, ("10.0.0.1", 29400))
    env = spec.rank_environment(3, "10.0.0.1", 29400)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "7", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    with pytest.raises(UserError, match=r"^--node-rank 2 must be between 0 and --nnodes - 1 \(1\)$"):
        LaunchSpec.for_world(4, nnodes=2, node_rank=2, master_addr="h")


def test_a_family_without_a_plan_is_refused_by_name() -> None:
    import dataclasses

    from accel.errors import NotAvailableError
    from accel.models.registry import FAMILIES
    from accel.parallel.plan import plan_of

    unplanned = dataclasses.replace(FAMILIES["wan"], parallel=None)
    with pytest.raises(NotAvailableError, match=r"^--gpus: Wan 2.1 / 2.2 has no context-parallel plan yet; run it on one process$"):
        plan_of(unplanned, "--gpus")
    assert plan_of(FAMILIES["wan"], "--gpus") is FAMILIES["wan"].parallel
