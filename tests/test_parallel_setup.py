"""Degrees and launch settings: decided from numbers alone, before any rank starts."""

from __future__ import annotations

import pytest

from accel.errors import UserError
from accel.launch.environment import LaunchSpec
from accel.parallel.mesh import Degrees, resolve_degrees
from accel.recipe.sections import ParallelSection


@pytest.mark.parametrize(
    "gpus, heads, expected",
    [
        (8, 24, Degrees(ulysses=8)),  # FLUX: 24 heads take Ulysses 8
        (8, 12, Degrees(ulysses=8)),  # 12 heads pad to 16 slots: 4/16 = 25 % padding, still full Ulysses
        (16, 24, Degrees(ulysses=16)),  # FLUX on 16: 32 slots, 25 % padding
        (16, 40, Degrees(ulysses=16)),  # Wan 14B on 16: 48 slots, 8/48 = 17 %
        (32, 40, Degrees(ulysses=8, ring=4)),  # 64 slots, 24/64 = 38 %: 8 divides 32 and 40
        (10, 12, Degrees(ulysses=2, ring=5)),  # 20 slots, 8/20 = 40 %: 2 divides 10 and 12
        (2, 3, Degrees(ulysses=2)),  # 4 slots, 25 %
        (4, 5, Degrees(ring=4)),  # 8 slots, 3/8 = 38 %, and only 1 divides 4 and 5
        (6, 4, Degrees(ulysses=2, ring=3)),  # more ranks than heads: 2 divides 6 and 4
        (3, 4, Degrees(ring=3)),  # 6 slots, 2/6 = 33 %
        (4, 3, Degrees(ring=4)),  # more ranks than heads, and only 1 divides 4 and 3
        (4, None, Degrees(ulysses=4)),  # heads unknown before loading: the ranks check again
    ],
)
def test_only_gpus_chooses_degrees(gpus: int, heads: int | None, expected: Degrees) -> None:
    assert resolve_degrees(ParallelSection(gpus=gpus), heads) == expected


def test_cfg_halves_choose_their_sequence_degrees() -> None:
    # 8 GPUs in 2 CFG halves: 4 sequence ranks for 5 heads pad to 8 slots (38 %): Ring 4.
    assert resolve_degrees(ParallelSection(gpus=8, cfg=2), 5) == Degrees(ring=4, cfg=2)
    # 6 heads on 4: 8 slots, 25 %: Ulysses 4.
    assert resolve_degrees(ParallelSection(gpus=8, cfg=2), 6) == Degrees(ulysses=4, cfg=2)


def test_given_degrees_are_kept_and_checked() -> None:
    assert resolve_degrees(ParallelSection(ulysses=2, ring=2), 24) == Degrees(ulysses=2, ring=2)
    assert resolve_degrees(ParallelSection(gpus=4, ulysses=2, ring=2), 24) == Degrees(ulysses=2, ring=2)
    # Ulysses degrees that do not divide the heads are padded, not refused, whatever the padding.
    assert resolve_degrees(ParallelSection(ulysses=4), 6, "m") == Degrees(ulysses=4)
    assert resolve_degrees(ParallelSection(ulysses=16), 24) == Degrees(ulysses=16)
    assert resolve_degrees(ParallelSection(ulysses=32), 40) == Degrees(ulysses=32)
    assert resolve_degrees(ParallelSection(ulysses=6), 6) == Degrees(ulysses=6)
    with pytest.raises(
        UserError,
        match=r"^\[parallel\] ulysses = 8 is more than the 6 attention heads of m; use ulysses = 2, ring = 4 for 8 "
        r"sequence-parallel ranks$",
    ):
        resolve_degrees(ParallelSection(ulysses=8), 6, "m")
    with pytest.raises(
        UserError,
        match=r"^\[parallel\] ulysses = 7 is more than the 6 attention heads of m; use ulysses = 2, ring = 7 for 14 "
        r"sequence-parallel ranks$",
    ):
        resolve_degrees(ParallelSection(ulysses=7, ring=2), 6, "m")
    with pytest.raises(UserError, match=r"^\[parallel\] gpus = 3 does not split into cfg = 2 halves"):
        resolve_degrees(ParallelSection(gpus=3, cfg=2), 24)


def test_launch_spec_single_node_uses_a_free_port_and_multi_node_the_given_one() -> None:
    address, port = LaunchSpec.for_world(2).rendezvous()
    assert address == "127.0.0.1" and 1024 <= port < 65536
    assert LaunchSpec.for_world(2, master_port=29411).rendezvous() == (
        "127.0.0.1",
        29411,
    )  # --master-port alone is honoured
    spec = LaunchSpec.for_world(8, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29400)
    assert (spec.nproc, spec.world, spec.rendezvous()) == (4, 8, ("10.0.0.1", 29400))
    env = spec.rank_environment(3, "10.0.0.1", 29400)
    assert {
        k: env[k]
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    } == {
        "RANK": "7",
        "LOCAL_RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29400",
    }
    with pytest.raises(UserError, match=r"^--node-rank 2 must be between 0 and --nnodes - 1 \(1\)$"):
        LaunchSpec.for_world(4, nnodes=2, node_rank=2, master_addr="h")


def test_a_family_without_a_plan_is_refused_by_name() -> None:
    from accel.errors import NotAvailableError
    from accel.models.registry import FAMILIES
    from accel.parallel.plan import plan_of

    unplanned = FAMILIES["wan"].with_acceleration(parallel=None)
    with pytest.raises(
        NotAvailableError, match=r"^--gpus: Wan 2.1 / 2.2 has no context-parallel plan yet; run it on one process$"
    ):
        plan_of(unplanned, "--gpus")
    assert plan_of(FAMILIES["wan"], "--gpus") is FAMILIES["wan"].parallel
