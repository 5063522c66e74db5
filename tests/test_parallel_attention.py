"""Context-parallel attention against SDPA on the full tensors, on 2-4 gloo ranks."""

from __future__ import annotations

import pytest
import torch

import parallel_cases as cases
from accel.parallel.attention import merge_partial
from accel.parallel.kernels import attention_with_lse, reference_attention_with_lse
from accel.parallel.layout import SequenceLayout

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}

# (ulysses, ring): Ulysses only, Ring only, and the 2x2 USP mesh, over world sizes 2, 3 and 4.
MESHES = [(2, 1), (1, 2), (1, 3), (3, 1), (4, 1), (1, 4), (2, 2)]


def _heads(ulysses: int) -> int:
    return 12 if ulysses == 3 else 4


@pytest.mark.parametrize("ulysses,ring", MESHES, ids=lambda v: str(v))
@pytest.mark.parametrize("tokens", [64, 1241])
def test_self_attention_equals_sdpa(rank_pools, ulysses: int, ring: int, tokens: int) -> None:
    errors = rank_pools(ulysses * ring).run(
        cases.attention_error, ulysses, ring, "float32", 1, _heads(ulysses), tokens, tokens, 16, False
    )
    assert max(errors) <= TOLERANCE["float32"]


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 3), (2, 2)], ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision(rank_pools, ulysses: int, ring: int, dtype: str) -> None:
    errors = rank_pools(ulysses * ring).run(
        cases.attention_error, ulysses, ring, dtype, 2, _heads(ulysses), 301, 301, 64, False
    )
    assert max(errors) <= TOLERANCE[dtype]


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2), (1, 3), (2, 2), (1, 4)], ids=lambda v: str(v))
def test_cross_attention_with_key_padding_mask(rank_pools, ulysses: int, ring: int) -> None:
    """Query and key lengths differ and neither divides the world; batch rows mask different keys."""
    errors = rank_pools(ulysses * ring).run(
        cases.attention_error, ulysses, ring, "float32", 3, _heads(ulysses), 97, 41, 16, True, 3
    )
    assert max(errors) <= TOLERANCE["float32"]


@pytest.mark.parametrize("ulysses,ring,dim", [(2, 1, 128), (1, 2, 128), (2, 2, 64)])
def test_realistic_head_dims(rank_pools, ulysses: int, ring: int, dim: int) -> None:
    errors = rank_pools(ulysses * ring).run(
        cases.attention_error, ulysses, ring, "float32", 1, 4, 203, 203, dim, True, 1
    )
    assert max(errors) <= TOLERANCE["float32"]


def test_fully_padded_shard(rank_pools) -> None:
    """5 tokens on 4 ranks: the last shard is all padding, so one ring block has no real key."""
    errors = rank_pools(4).run(cases.attention_error, 1, 4, "float32", 2, 4, 5, 5, 16, False)
    assert max(errors) <= TOLERANCE["float32"]


@pytest.mark.parametrize("ulysses,ring,tokens", [(2, 1, 301), (1, 3, 301), (2, 2, 5), (1, 4, 5), (4, 1, 7)], ids=str)
def test_padding_known_on_the_host_equals_sdpa(rank_pools, ulysses: int, ring: int, tokens: int) -> None:
    """With the layout's real-key counts, padded blocks are cut to their real keys (or skipped when
    all padding, as with 5 tokens on 4 ranks) instead of masked: still equal to SDPA."""
    errors = rank_pools(ulysses * ring).run(
        cases.attention_error, ulysses, ring, "float32", 1, 4, tokens, tokens, 16, False, 0, True
    )
    assert max(errors) <= TOLERANCE["float32"]


@pytest.mark.parametrize("ulysses,ring,tokens", [(2, 1, 37), (1, 3, 37), (2, 2, 37), (1, 4, 5)], ids=str)
def test_a_whole_sequence_pair_mask_equals_sdpa(rank_pools, ulysses: int, ring: int, tokens: int) -> None:
    """A block-causal (L, L) mask: each rank's rows, each key block's columns; ring blocks a query may
    not see at all (later frames) drop out of the merge; padding as usual (37 on 2, 3, 4; 5 on 4)."""
    errors = rank_pools(ulysses * ring).run(cases.pair_mask_error, ulysses, ring, tokens, 6 if tokens > 5 else 2)
    assert max(errors) <= TOLERANCE["float32"]


@pytest.mark.parametrize(
    "ulysses,ring,tokens,heads", [(2, 1, 37, 4), (1, 3, 37, 4), (2, 2, 37, 4), (2, 1, 37, 3)], ids=str
)
def test_an_additive_pair_mask_per_head_equals_sdpa(
    rank_pools, ulysses: int, ring: int, tokens: int, heads: int
) -> None:
    """A float (1, H, L, L) bias (LTX-2 IC-LoRA's reference strength): each rank's rows, its Ulysses
    heads (3 heads on 2 ranks: padded as q's), each key block's columns; -inf blocks drop out of the
    merge without NaN, -10000 counts as on one process; padded keys stay excluded (37 on 2, 3, 4)."""
    errors = rank_pools(ulysses * ring).run(cases.pair_mask_error, ulysses, ring, tokens, 6, True, heads)
    assert max(errors) <= TOLERANCE["float32"]


# (ulysses, ring, heads): head counts the Ulysses degree does not divide, Ulysses alone and USP.
UNEVEN_HEADS = [(2, 1, 3), (3, 1, 4), (4, 1, 5), (4, 1, 7), (2, 2, 3), (2, 2, 5)]


@pytest.mark.parametrize("ulysses,ring,heads", UNEVEN_HEADS, ids=str)
@pytest.mark.parametrize("tokens", [64, 301])
def test_heads_the_ulysses_degree_does_not_divide(rank_pools, ulysses: int, ring: int, heads: int, tokens: int) -> None:
    """Zero heads pad the all-to-all and are dropped after it; token counts that divide and do not."""
    errors = rank_pools(ulysses * ring).run(
        cases.attention_error, ulysses, ring, "float32", 2, heads, tokens, tokens, 16, False
    )
    assert max(errors) <= TOLERANCE["float32"]


@pytest.mark.parametrize("ulysses,ring,heads", UNEVEN_HEADS, ids=str)
def test_uneven_heads_with_a_key_padding_mask(rank_pools, ulysses: int, ring: int, heads: int) -> None:
    """Cross-attention, lengths no rank count divides, batch rows masking different keys: padded
    heads meet masked and empty key blocks (and the ring's merge) without NaN."""
    errors = rank_pools(ulysses * ring).run(
        cases.attention_error, ulysses, ring, "float32", 3, heads, 97, 41, 16, True, 3
    )
    assert max(errors) <= TOLERANCE["float32"]


@pytest.mark.parametrize("ulysses,ring,heads,tokens", [(2, 2, 3, 5), (4, 1, 5, 7), (2, 1, 3, 301)], ids=str)
def test_uneven_heads_with_padding_known_on_the_host(
    rank_pools, ulysses: int, ring: int, heads: int, tokens: int
) -> None:
    """Padded heads with cut and skipped (all-padding) key blocks: 5 tokens on 4 ranks leave one empty."""
    errors = rank_pools(ulysses * ring).run(
        cases.attention_error, ulysses, ring, "float32", 1, heads, tokens, tokens, 16, False, 0, True
    )
    assert max(errors) <= TOLERANCE["float32"]


@pytest.mark.parametrize(
    "heads,world,real",
    [
        (3, 2, [2, 1]),  # 4 slots: rank 1 holds head 2 and one zero head
        (5, 4, [2, 1, 1, 1]),
        (24, 16, [2] * 8 + [1] * 8),  # FLUX at Ulysses 16: 32 slots, no rank with padding only
        (40, 16, [3] * 8 + [2] * 8),  # Wan 14B at Ulysses 16: 48 slots
        (40, 32, [2] * 8 + [1] * 24),
    ],
)
def test_head_padding_spreads_the_real_heads(heads: int, world: int, real: list[int]) -> None:
    from accel.parallel.attention import _pad_heads, _unpad_heads

    x = torch.arange(1.0, heads + 1).view(1, heads, 1, 1)  # head i holds i + 1, padding holds 0
    padded = _pad_heads(x, world)
    slots = -(-heads // world)
    assert padded.shape == (1, slots * world, 1, 1)
    per_rank = padded.view(world, slots)
    assert (per_rank != 0).sum(1).tolist() == real
    assert padded[padded != 0].tolist() == x.flatten().tolist()  # the real heads keep their order
    assert torch.equal(_unpad_heads(padded, heads, world), x)


def test_mesh_groups(rank_pools) -> None:
    """(cfg, ring, ulysses) = (1, 2, 2): Ulysses pairs neighbours, Ring pairs across, sequence is all."""
    for fallback in (False, True):
        groups = rank_pools(4).run(cases.group_ranks, 2, 2, fallback)
        assert [g["ulysses"] for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]]
        assert [g["ring"] for g in groups] == [[0, 2], [1, 3], [0, 2], [1, 3]]
        assert all(g["sequence"] == [0, 1, 2, 3] for g in groups)


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2), (4, 1), (1, 4), (2, 2)], ids=lambda v: str(v))
def test_bytes_sent_equal_the_minimum(rank_pools, ulysses: int, ring: int) -> None:
    """Ulysses moves (P-1)/P of q, k, v and out; Ring moves the other ranks' K/V once; USP both."""
    batch, heads, tokens, dim, size = 1, 4, 64, 16, 4
    shard = batch * heads * tokens // (ulysses * ring) * dim * size
    expected = 4 * shard * (ulysses - 1) // ulysses  # q, k, v there and the output back
    expected += 2 * shard * (ring - 1)  # k and v (H/U heads of U shards: same size) over ring-1 hops
    sent = rank_pools(ulysses * ring).run(cases.traffic_bytes, ulysses, ring, batch, heads, tokens, dim)
    assert sent == [expected] * (ulysses * ring)


def test_merge_partial_equals_attention_over_both_blocks() -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=generator) for _ in range(3))
    full, full_lse = reference_attention_with_lse(q, k, v)
    first = attention_with_lse(q, k[:, :, :3], v[:, :, :3])
    second = attention_with_lse(q, k[:, :, 3:], v[:, :, 3:])
    out, lse = merge_partial(*merge_partial(None, None, *first), *second)
    assert torch.allclose(out, full, atol=1e-6) and torch.allclose(lse, full_lse, atol=1e-5)


def test_merge_of_two_empty_blocks_stays_finite() -> None:
    empty_out, empty_lse = torch.zeros(1, 1, 2, 4), torch.full((1, 1, 2), float("-inf"))
    out, lse = merge_partial(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.equal(out, empty_out) and torch.isinf(lse).all()


def test_cpu_kernel_lse_matches_reference() -> None:
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=generator) for _ in range(3))
    bias = torch.zeros(1, 1, 1, 9).masked_fill(torch.arange(9) >= 6, float("-inf"))
    out, lse = attention_with_lse(q, k, v, bias)
    ref_out, ref_lse = reference_attention_with_lse(q, k, v, bias)
    assert torch.allclose(out, ref_out, atol=1e-6) and torch.allclose(lse, ref_lse, atol=1e-5)


def test_layout_pads_and_joins() -> None:
    layout = SequenceLayout(length=1241, world=3)
    assert (layout.shard, layout.padded, layout.pad) == (414, 1242, 1)
    x = torch.arange(1241.0).view(1, 1241, 1)
    shards = [layout.split(x, 1, rank) for rank in range(3)]
    assert shards[2][0, -1, 0] == 0 and torch.equal(layout.join(shards, 1), x)
    assert layout.valid().sum() == 1241 and not layout.valid()[2, -1]
    with pytest.raises(ValueError, match="expected 1241 tokens along dim 1, got 5"):
        layout.split(torch.zeros(1, 5, 1), 1, 0)


@pytest.mark.parametrize(
    "world, q_len, k_len, masked, host_hint",
    [(2, 9, 20, False, False), (3, 9, 20, False, True), (3, 13, 7, True, False)],
    ids=["2 ranks", "3 ranks, padding on the host", "3 ranks, a key mask"],
)
def test_whole_queries_against_cut_keys_equal_sdpa(
    rank_pools, world: int, q_len: int, k_len: int, masked: bool, host_hint: bool
) -> None:
    """LTX-2's audio (every rank all of it) attending to the cut video: merged by log-sum-exp, every rank the whole
    result."""
    errors = rank_pools(world).run(cases.whole_query_error, world, q_len, k_len, masked, host_hint)
    assert max(errors) <= 1e-5


@pytest.mark.parametrize(
    "ulysses,ring,heads,tokens", [(2, 1, 4, 16), (1, 3, 4, 16), (2, 2, 4, 5), (2, 1, 3, 7)], ids=str
)
def test_queries_of_a_cut_stream_against_keys_every_rank_holds_whole_equal_sdpa(
    rank_pools, ulysses: int, ring: int, heads: int, tokens: int
) -> None:
    """Qwen-Image 2.1's cached calls: the target's queries attend to the cached prompt keys (whole on
    every rank, one row's last keys padding) and to the target's keys (cut, padded where the ranks do
    not divide them, with heads Ulysses does not divide): each rank's result equals SDPA's rows."""
    errors = rank_pools(ulysses * ring).run(cases.shared_keys_error, ulysses, ring, heads, tokens, 9)
    assert max(errors) <= TOLERANCE["float32"]
