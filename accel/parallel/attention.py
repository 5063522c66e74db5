"""Context-parallel attention as pure functions of sequence shards and process groups.

Inputs are this rank's shards in SDPA layout (batch, heads, tokens, head_dim), every rank's
shard the same length (see `layout.SequenceLayout`). `key_valid`, when given, is a bool tensor
(P, batch or 1, shard_k): for each of the P shards of the sequence-parallel group, which keys are
real. Every rank passes the same tensor; it is position knowledge, so no collective is spent on it.
`real_keys`, when given, says the same on the host: shard p's real keys are its first
`real_keys[p]` (None for a shard whose real keys are not a prefix, e.g. two padded streams side by
side). A block of keys that is real up to a known point is cut there and runs the unmasked
(flash) kernel; only the others pay for a mask. Nothing here reads tensor data on the host.
For `usp_attention` shard p belongs to ring rank p // U, Ulysses rank p % U.

Any head count splits over any Ulysses degree U: when U does not divide the H heads, the
all-to-all carries ceil(H / U) head slots per rank and the spare slots hold zero heads (a zero
query against zero keys and values gives zeros and a finite log-sum-exp, never NaN), dropped
again on the way back. Real heads are spread so no rank holds two padding slots: with
H = q·U + m, Ulysses ranks 0 … m-1 get q + 1 real heads and the others q real heads and one
zero head (so with H >= U no rank computes padding alone). The padding is decided from shapes
on the host; a head count U divides takes the unpadded path unchanged.

The result equals plain softmax attention over the gathered sequence, for this rank's queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from collections.abc import Sequence

from accel.parallel.comm import Group, RingShift, all_gather, all_to_all, group_rank, group_size
from accel.parallel.kernels import attention_with_lse

RealKeys = Sequence[int | None]


def ulysses_attention(
    q: Tensor, k: Tensor, v: Tensor, group: Group, key_valid: Tensor | None = None, scale: float | None = None
) -> Tensor:
    """All-to-all from sequence shards to head shards, local attention, all-to-all back."""
    return usp_attention(q, k, v, group, None, key_valid, scale)


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, group: Group, key_valid: Tensor | None = None, scale: float | None = None
) -> Tensor:
    """K/V travel round the ring (next block in flight while this one computes); outputs merge by LSE."""
    return usp_attention(q, k, v, None, group, key_valid, scale)


def usp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ulysses_group: Group | None,
    ring_group: Group | None,
    key_valid: Tensor | None = None,
    scale: float | None = None,
    real_keys: RealKeys | None = None,
    pair_mask: Tensor | None = None,
    shared: tuple[Tensor, Tensor, Tensor | None] | None = None,
) -> Tensor:
    """Ulysses inside (all-to-all over heads), Ring across; either group may be None (degree 1).

    `shared`, when given, is (key, value, valid): (B, H, S, D) keys and values every rank holds whole,
    besides the cut ones, with which keys are real ((B|1, S) bool, or None: all). Every query attends
    to them too: each rank on its own (its Ulysses heads of them), merged with the cut keys' result by
    log-sum-exp, so they are never exchanged.

    `pair_mask`, when given, is a (B|1, H|1, N, N) mask over the whole padded sequence in shard
    order (shard p's tokens at [p * shard, (p + 1) * shard)) relating every query to every key: a
    bool (True: may attend; SkyReels-V2's block-causal frames) or an additive float bias (LTX-2
    IC-LoRA's reference strength); every rank passes the same tensor and takes its own rows, its
    Ulysses heads (when per head) and each key block's columns from it. Padded keys stay excluded."""
    ulysses = group_size(ulysses_group) if ulysses_group is not None else 1
    ring = group_size(ring_group) if ring_group is not None else 1
    _check(q, k, v, ulysses, ring, key_valid, real_keys, pair_mask)
    shard, heads = k.shape[2], q.shape[1]
    if ulysses > 1:
        q, k, v = _sequence_to_heads(q, k, v, ulysses_group, ulysses)
    # Shard p = (ring rank p // U, Ulysses rank p % U): after the all-to-all a ring rank holds
    # its U shards back to back, so its keys' validity is theirs concatenated.
    blocks = [_BlockKeys(None, None) for _ in range(ring)]
    if key_valid is not None:
        batch = key_valid.shape[1]
        masks = key_valid.view(ring, ulysses, batch, shard).permute(0, 2, 1, 3).reshape(ring, batch, ulysses * shard)
        blocks = [
            _BlockKeys(
                masks[r],
                leading_real(real_keys[r * ulysses : (r + 1) * ulysses], [shard] * ulysses)
                if real_keys is not None
                else None,
            )
            for r in range(ring)
        ]
    if pair_mask is not None:
        # After the all-to-all, ring rank r's queries (and keys) are shards r*U .. r*U + U - 1: one stretch.
        width = ulysses * shard
        if ulysses > 1 and pair_mask.shape[1] > 1:  # a mask per head: this rank's head slots, padded as q's
            pair_mask = _own_heads(pair_mask, ulysses_group, ulysses)
        rows = pair_mask.narrow(2, group_rank(ring_group) * width, width) if ring > 1 else pair_mask
        blocks = [
            _BlockKeys(block.valid, block.prefix, rows.narrow(3, r * width, width)) for r, block in enumerate(blocks)
        ]
    start = None
    if shared is not None:
        shared_key, shared_value, shared_valid = shared
        if ulysses > 1:
            shared_key, shared_value = (_own_heads(x, ulysses_group, ulysses) for x in (shared_key, shared_value))
        start = _block(q, shared_key, shared_value, _BlockKeys(shared_valid, None), scale)
    if ring > 1:
        out = _ring(q, k, v, ring_group, ring, blocks, scale, start)
    else:
        out, lse = _block(q, k, v, blocks[0], scale)
        if start is not None:
            out = merge_partial(*start, out, lse)[0].to(q.dtype)
    if ulysses > 1:
        out = _heads_to_sequence(out, ulysses_group, ulysses, heads)
    return out


def _check(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ulysses: int,
    ring: int,
    key_valid: Tensor | None,
    real_keys: RealKeys | None,
    pair_mask: Tensor | None,
) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("context-parallel attention takes (batch, heads, tokens, head_dim) tensors")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"query {tuple(q.shape)}, key {tuple(k.shape)} and value {tuple(v.shape)} do not match in batch / heads"
        )
    if key_valid is not None and (
        key_valid.dim() != 3 or key_valid.shape[0] != ulysses * ring or key_valid.shape[2] != k.shape[2]
    ):
        raise ValueError(
            f"key_valid must be ({ulysses * ring}, batch or 1, {k.shape[2]}) for this group, got "
            f"{tuple(key_valid.shape)}"
        )
    if real_keys is not None and (key_valid is None or len(real_keys) != ulysses * ring):
        raise ValueError(f"real_keys needs key_valid and one entry per shard ({ulysses * ring}), got {len(real_keys)}")
    tokens = ulysses * ring * k.shape[2]
    if pair_mask is not None and (
        pair_mask.dim() != 4 or pair_mask.shape[1] not in (1, q.shape[1]) or pair_mask.shape[2:] != (tokens, tokens)
    ):
        raise ValueError(
            f"pair_mask must be (batch or 1, {q.shape[1]} or 1, {tokens}, {tokens}) for this group, got "
            f"{tuple(pair_mask.shape)}"
        )


@dataclass(frozen=True)
class _BlockKeys:
    """One block of keys: which are real (None: all), and, when known on the host, how many of
    its first keys are real with the rest padding (a prefix)."""

    valid: Tensor | None
    prefix: int | None
    pair: Tensor | None = None  # (B|1, H|1, queries, keys): bool or additive bias, beside `valid`


def leading_real(counts: Sequence[int | None], sizes: Sequence[int]) -> int | None:
    """Stretches of keys laid side by side, stretch i real for its first `counts[i]` of `sizes[i]`
    keys: how many leading keys are real, when those are all the real ones (None: they are not a
    prefix, or a count is unknown)."""
    short = False
    for count, size in zip(counts, sizes, strict=True):
        if count is None or (short and count):
            return None
        short = short or count < size
    return sum(count or 0 for count in counts)


def _sequence_to_heads(q: Tensor, k: Tensor, v: Tensor, group: Group, world: int) -> tuple[Tensor, Tensor, Tensor]:
    """(B, H, s, D) sequence shards -> (B, ceil(H/P), P*s, D) head shards; one all-to-all when q and k align."""
    if q.shape == k.shape:
        stacked = _to_heads(torch.stack([q, k, v]).flatten(0, 1), group, world)
        q, k, v = stacked.unflatten(0, (3, q.shape[0])).unbind(0)
        return q, k, v
    kv = _to_heads(torch.stack([k, v]).flatten(0, 1), group, world).unflatten(0, (2, k.shape[0]))
    return _to_heads(q, group, world), kv[0], kv[1]


def _pad_heads(x: Tensor, world: int) -> Tensor:
    """(B, H, ...) -> (B, P*ceil(H/P), ...) with the real heads spread as the module docstring says:
    the first m = H % P ranks' slots all real, then per rank q = H // P real heads and one zero head."""
    heads = x.shape[1]
    q, m = heads // world, heads % world  # not divmod: dynamo does not trace it
    full = x[:, : m * (q + 1)]
    rest = x[:, m * (q + 1) :].unflatten(1, (world - m, q))
    rest = torch.cat([rest, rest.new_zeros(rest.shape[:2] + (1,) + rest.shape[3:])], dim=2).flatten(1, 2)
    return torch.cat([full, rest], dim=1)


def _unpad_heads(x: Tensor, heads: int, world: int) -> Tensor:
    """The inverse of `_pad_heads`: (B, P*ceil(H/P), ...) -> the H real heads in order."""
    q, m = heads // world, heads % world  # not divmod: dynamo does not trace it
    full = x[:, : m * (q + 1)]
    rest = x[:, m * (q + 1) :].unflatten(1, (world - m, q + 1))[:, :, :q].flatten(1, 2)
    return torch.cat([full, rest], dim=1)


def _own_heads(mask: Tensor, group: Group, world: int) -> Tensor:
    """This Ulysses rank's head slots of a per-head (B|1, H, ...) mask: padded and chunked as `_to_heads`
    lays out q (a padding slot's mask is zeros, and its output is dropped)."""
    if mask.shape[1] % world:
        mask = _pad_heads(mask, world)
    per = mask.shape[1] // world
    return mask.narrow(1, group_rank(group) * per, per)


def _to_heads(x: Tensor, group: Group, world: int) -> Tensor:
    if x.shape[1] % world:
        x = _pad_heads(x, world)
    batch, heads, tokens, dim = x.shape
    chunks = x.view(batch, world, heads // world, tokens, dim).transpose(0, 1)
    received = all_to_all(chunks, group)  # received[p]: head chunk of mine, tokens of rank p
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // world, world * tokens, dim)


def _heads_to_sequence(x: Tensor, group: Group, world: int, real_heads: int | None = None) -> Tensor:
    """Head shards back to sequence shards; `real_heads` (when the heads were padded) drops the padding."""
    batch, heads, tokens, dim = x.shape
    chunks = x.view(batch, heads, world, tokens // world, dim).permute(2, 0, 1, 3, 4)
    received = all_to_all(chunks, group)  # received[p]: my tokens, head chunk p
    out = received.transpose(0, 1).reshape(batch, world * heads, tokens // world, dim)
    if real_heads is not None and real_heads != world * heads:
        out = _unpad_heads(out, real_heads, world)
    return out


def _ring(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Group,
    world: int,
    blocks: list[_BlockKeys],
    scale: float | None,
    start: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Attention over every rank's key block in turn, merged; `start`: a partial result (out, lse) to merge into."""
    rank = group_rank(group)
    kv = torch.stack([k, v])
    out, lse = (start[0].float(), start[1]) if start is not None else (None, None)
    for step in range(world):
        shift = RingShift(kv, group) if step < world - 1 else None  # in flight during this block
        source = (rank - step) % world
        block_out, block_lse = _block(q, kv[0], kv[1], blocks[source], scale)
        out, lse = merge_partial(out, lse, block_out, block_lse)
        if shift is not None:
            kv = shift.wait()
    assert out is not None
    return out.to(q.dtype)


def _block(q: Tensor, k: Tensor, v: Tensor, keys: _BlockKeys, scale: float | None) -> tuple[Tensor, Tensor]:
    """Local attention over one key block; a batch row with no real key gets lse -inf and out 0.

    Which path runs is decided on the host (no sync, and the same graph under compile): all keys
    real, or real up to a known point (cut there, unmasked kernel), or a mask."""
    if keys.prefix == 0:  # only padding here: contributes nothing to the merge
        return q.new_zeros(q.shape), q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
    if keys.pair is not None:
        return _masked(q, k, v, keys.pair, keys.valid, scale)
    if keys.valid is None or keys.prefix == k.shape[-2]:
        return attention_with_lse(q, k, v, None, scale)
    if keys.prefix is not None:
        return attention_with_lse(q, k[..., : keys.prefix, :], v[..., : keys.prefix, :], None, scale)
    return _masked(q, k, v, keys.valid[:, None, None, :], None, scale)


def _masked(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, valid: Tensor | None, scale: float | None
) -> tuple[Tensor, Tensor]:
    """Attention under `mask` (broadcastable to (B, H, queries, keys)): bool, which keys each query
    sees, or an additive float bias; `valid` (B|1, keys), when given, excludes padded keys besides.
    A query that sees no key (all False or -inf) gets lse -inf and out 0, so the merge ignores it
    (and no NaN); a finite large negative bias is ordinary attention, as on one process."""
    padded = valid[:, None, None, :] if valid is not None else None
    if mask.dtype == torch.bool:
        allowed = mask if padded is None else mask & padded
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    else:
        bias = mask.to(q.dtype)
        if padded is not None:
            bias = torch.where(padded, bias, float("-inf"))
        allowed = bias != float("-inf")
    out, lse = attention_with_lse(q, k, v, bias, scale)
    has_key = allowed.any(-1)
    lse = torch.where(has_key, lse, float("-inf"))
    out = torch.where(has_key.unsqueeze(-1), out, 0.0)
    return out, lse


def whole_query_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Group,
    key_valid: Tensor | None = None,
    scale: float | None = None,
    real_keys: RealKeys | None = None,
) -> Tensor:
    """Queries every rank holds whole against this rank's shard of the keys (LTX-2's audio attending
    to the cut video): local attention with its log-sum-exp, then every rank's partial result merged
    in rank order, so all ranks return the same full output. Sends one query-sized result per rank."""
    rank = group_rank(group)
    keys = _BlockKeys(
        key_valid[rank] if key_valid is not None else None,
        real_keys[rank] if real_keys is not None else None,
    )
    out, lse = _block(q, k, v, keys, scale)
    outs, lses = all_gather(out.float(), group), all_gather(lse, group)
    merged = merged_lse = None
    for part, part_lse in zip(outs, lses):
        merged, merged_lse = merge_partial(merged, merged_lse, part, part_lse)
    assert merged is not None
    return merged.to(q.dtype)


def merge_partial(
    out: Tensor | None, lse: Tensor | None, block_out: Tensor, block_lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Combine two softmax-normalised partial results by their log-sum-exp, in float32."""
    if out is None or lse is None:
        return block_out.float(), block_lse
    merged = torch.logaddexp(lse, block_lse)
    finite = torch.where(torch.isinf(merged), 0.0, merged)  # both blocks empty: keep zeros, no NaN
    out = out * torch.exp(lse - finite).unsqueeze(-1) + block_out.float() * torch.exp(block_lse - finite).unsqueeze(-1)
    return out, merged
