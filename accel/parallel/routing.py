"""Attention routed under context parallelism: which keys an attention call sees on this rank (each
stream's stretch: cut, or replicated and shared out), and how the ranks attend them: Ulysses / Ring
with pad keys and the model's masks, shared keys merged by log-sum-exp, pair masks, whole queries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from accel.errors import NotAvailableError
from accel.parallel.attention import leading_real, usp_attention, whole_query_attention
from accel.parallel.comm import all_gather
from accel.parallel.cuts import Cuts, PerTensor
from accel.parallel.layout import SequenceLayout
from accel.parallel.matching import PlanMismatch
from accel.parallel.mesh import ParallelMesh
from accel.parallel.mode import is_whole_pairwise, key_mask
from accel.parallel.plan_format import ParallelPlan


@dataclass(frozen=True)
class Segment:
    """One stream's stretch of an attention call's keys on this rank (layout None: replicated)."""

    stream: str
    tokens: int
    layout: SequenceLayout | None


class AttentionRoute:
    """The attention side of one engine: the state of the forward in progress that routed attention
    reads (local and whole-query modules entered, the key streams of module_keys, masks exchanged
    once), and the routed call itself; `clear()` after each forward."""

    def __init__(self, plan: ParallelPlan, mesh: ParallelMesh, cuts: Cuts) -> None:
        self.plan, self.mesh = plan, mesh
        self.world, self.rank = mesh.degrees.sequence, mesh.sequence_rank
        self._cuts = cuts  # the streams' layouts of the forward in progress
        self.local_depth = 0
        self.whole_query_depth = 0
        # Key streams of the attention calls in progress, innermost last (module_keys); empty: the plan's.
        self.keys: list[tuple[str, ...]] = []
        # Blocks are often handed the same tensor (a joint mask): gather its mask once per forward, so
        # no block repeats the exchange.
        self._gathered_masks = PerTensor()
        # A whole-sequence pair mask is (B, H|1, N, N): one shared by every block (SkyReels-V2's) is
        # padded once; one made anew per block (diffusers repeats LTX-2's per head) is not held past it.
        self._pair_masks = PerTensor(keep=1)
        # Whether the forward in progress sent any attention through `attend`: a flag that compiled
        # blocks may set but never read (a counter would be a guarded value, recompiling each call).
        self.routed = False

    def clear(self) -> None:
        """The per-call state starts empty for the next call."""
        self.local_depth, self.whole_query_depth = 0, 0
        self.keys.clear()
        self._gathered_masks.clear()
        self._pair_masks.clear()

    def enter_local(self) -> None:
        self.local_depth += 1

    def leave_local(self) -> None:
        self.local_depth = max(0, self.local_depth - 1)

    def enter_whole_queries(self) -> None:
        self.whole_query_depth += 1

    def leave_whole_queries(self) -> None:
        self.whole_query_depth = max(0, self.whole_query_depth - 1)

    def leave_keys(self) -> None:
        if self.keys:
            self.keys.pop()

    def attend(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scale: float | None) -> Tensor:
        self.routed = True
        segments = self._segments(key.shape[-2])
        if mask is not None and is_whole_pairwise(mask, query.shape[-2]):
            return self._attend_pairs(query, key, value, mask, scale, segments)
        if self.whole_query_depth > 0:
            return self._attend_whole_queries(query, key, value, mask, scale, segments)
        replicated = next((i for i, segment in enumerate(segments) if segment.layout is None), None)
        if replicated is not None and 0 < segments[replicated].tokens == key.shape[-2] - query.shape[-2]:
            return self._attend_shared_keys(query, key, value, mask, scale, segments, replicated)
        share = None
        if replicated is not None:
            if query.shape[-2] != key.shape[-2]:
                raise PlanMismatch("context parallelism: a replicated stream is only supported in joint self-attention")
            share = self._own_share(segments, replicated)
            query, key, value = (share.take(x, -2) for x in (query, key, value))
            segments = share.segments
        key_valid = self._pad_valid(segments, key.device)
        # Padding alone is known on the host; a model mask is data, so every block then applies it.
        real_keys = self._real_keys(segments) if key_valid is not None and mask is None else None
        if mask is not None:
            masks = self._every_rank_mask(mask, share)
            key_valid = masks if key_valid is None else key_valid & masks
        out = usp_attention(query, key, value, *self._usp_groups(), key_valid, scale, real_keys)
        return share.restore(out, self.mesh.sequence_group) if share is not None else out

    def _attend_shared_keys(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None,
        scale: float | None,
        segments: list[Segment],
        replicated: int,
    ) -> Tensor:
        """Queries of the cut streams alone against their keys and a replicated stretch every rank
        holds whole (Qwen-Image 2.1's cached prompt keys): the cut keys are attended as usual, the
        whole stretch by each rank's queries on their own, the two merged by log-sum-exp."""
        start, length = sum(segment.tokens for segment in segments[:replicated]), segments[replicated].tokens
        cut = [segment for index, segment in enumerate(segments) if index != replicated]

        def without(x: Tensor, dim: int) -> Tensor:
            return torch.cat(
                [x.narrow(dim, 0, start), x.narrow(dim, start + length, x.shape[dim] - start - length)], dim
            )

        shared_key, shared_value = key.narrow(-2, start, length), value.narrow(-2, start, length)
        key, value = without(key, -2), without(value, -2)
        key_valid = self._pad_valid(cut, key.device)
        real_keys = self._real_keys(cut) if key_valid is not None and mask is None else None
        shared_valid = None
        if mask is not None:
            local = key_mask(mask)
            shared_valid = local.narrow(-1, start, length)
            masks = self._gathered_masks.get(
                mask,
                lambda: torch.stack(all_gather(without(local, -1).to(torch.uint8), self.mesh.sequence_group)).bool(),
            )
            key_valid = masks if key_valid is None else key_valid & masks
        return usp_attention(
            query,
            key,
            value,
            *self._usp_groups(),
            key_valid,
            scale,
            real_keys,
            shared=(shared_key, shared_value, shared_valid),
        )

    def _attend_pairs(
        self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float | None, segments: list[Segment]
    ) -> Tensor:
        """Self-attention of one cut stream under a mask the model built for every token pair of the
        whole stream: padded in shard order once per mask tensor and forward, then sliced per block."""
        layout = segments[0].layout if len(segments) == 1 else None
        if (
            layout is None
            or self.whole_query_depth > 0
            or query.shape[-2] != key.shape[-2]
            or mask.shape[-1] != layout.length
        ):
            raise NotAvailableError(
                "context parallelism: this transformer's attention mask relates every token pair (shape "
                f"{tuple(mask.shape)}), "
                "which the engine handles for the self-attention of one cut stream only; run it without [parallel]"
            )

        def pad() -> Tensor:
            if not layout.pad:
                return mask
            # Padding queries see every key (True, or bias 0): finite, and dropped with the padding;
            # padding keys are excluded by key_valid.
            padded = torch.nn.functional.pad(mask, (0, layout.pad, 0, layout.pad), value=0)
            if mask.dtype == torch.bool:
                padded[..., layout.length :, :] = True
            return padded

        pairs = self._pair_masks.get(mask, pad)
        key_valid = self._pad_valid(segments, key.device)
        return usp_attention(query, key, value, *self._usp_groups(), key_valid, scale, pair_mask=pairs)

    def _usp_groups(self) -> tuple[Any, Any]:
        """The Ulysses and Ring groups usp_attention takes (None where the degree is 1)."""
        degrees = self.mesh.degrees
        return (
            self.mesh.ulysses_group if degrees.ulysses > 1 else None,
            self.mesh.ring_group if degrees.ring > 1 else None,
        )

    def _attend_whole_queries(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None,
        scale: float | None,
        segments: list[Segment],
    ) -> Tensor:
        """Queries of a replicated stream against cut keys: partial attention merged over the ranks."""
        if any(segment.layout is None for segment in segments):
            raise PlanMismatch("context parallelism: whole queries need keys the plan cuts, not a replicated stream")
        key_valid = self._pad_valid(segments, key.device)
        real_keys = self._real_keys(segments) if key_valid is not None and mask is None else None
        if mask is not None:
            masks = self._every_rank_mask(mask, None)
            key_valid = masks if key_valid is None else key_valid & masks
        return whole_query_attention(query, key, value, self.mesh.sequence_group, key_valid, scale, real_keys)

    def _segments(self, keys: int) -> list[Segment]:
        streams = self.keys[-1] if self.keys else self.plan.attention_keys
        segments = [self._segment(name) for name in streams]
        unknown = [segment for segment in segments if segment.layout is None]
        known = sum(segment.tokens for segment in segments)
        if len(unknown) > 1 or known > keys or (not unknown and known != keys):
            raise PlanMismatch(
                f"context parallelism: an attention call has {keys} keys per rank, which the plan's "
                f"{' + '.join(streams)} shards ({known} cut tokens) do not make up; "
                "the family's parallel plan does not fit this transformer"
            )
        return [Segment(s.stream, keys - known, None) if s.layout is None else s for s in segments]

    def _segment(self, stream: str) -> Segment:
        # No walrus in a comprehension here: its cell variable breaks a compiled block's graph.
        layout = self._cuts.layouts.get(stream)
        return Segment(stream, layout.shard, layout) if layout is not None else Segment(stream, 0, None)

    def _pad_valid(self, segments: list[Segment], device: torch.device) -> Tensor | None:
        """(P, 1, keys per rank) bool: which key slots of every rank hold real tokens; None: all do."""
        if not any(segment.layout is not None and segment.layout.pad for segment in segments):
            return None
        return torch.cat([segment.layout.valid(device) for segment in segments if segment.layout], dim=1)[:, None, :]

    def _real_keys(self, segments: list[Segment]) -> list[int | None]:
        """For each rank's shard of keys, how many leading keys are real when those are all its real
        ones (None where padding sits between two streams): known from the layouts alone."""
        shards = [segment for segment in segments if segment.layout is not None]
        sizes = [segment.tokens for segment in shards]
        return [leading_real([segment.layout.real(rank) for segment in shards], sizes) for rank in range(self.world)]

    def _every_rank_mask(self, mask: Tensor, share: Share | None) -> Tensor:
        """(P, B|1, keys per rank): every rank's key mask, exchanged once per mask tensor and forward."""

        def gather() -> Tensor:
            local = key_mask(mask)
            if share is not None:
                local = share.take(local, -1)
            return torch.stack(all_gather(local.to(torch.uint8), self.mesh.sequence_group)).bool()

        return self._gathered_masks.get(mask, gather)

    def _own_share(self, segments: list[Segment], replicated: int) -> Share:
        layout = SequenceLayout(segments[replicated].tokens, self.world)
        start = sum(segment.tokens for segment in segments[:replicated])
        shared = Segment(segments[replicated].stream, layout.shard, layout)
        return Share(start, layout, self.rank, [*segments[:replicated], shared, *segments[replicated + 1 :]])


@dataclass
class Share:
    """This rank's share of a replicated stretch of tokens: taken before attention, gathered after."""

    start: int
    layout: SequenceLayout
    rank: int
    segments: list[Segment]

    def take(self, x: Tensor, dim: int) -> Tensor:
        before, stretch, after = x.split(
            [self.start, self.layout.length, x.shape[dim] - self.start - self.layout.length], dim
        )
        return torch.cat([before, self.layout.split(stretch, dim, self.rank), after], dim)

    def restore(self, out: Tensor, group: Any) -> Tensor:
        before, share, after = out.split(
            [self.start, self.layout.shard, out.shape[-2] - self.start - self.layout.shard], -2
        )
        return torch.cat([before, self.layout.join(all_gather(share, group), -2), after], -2)
