"""Cutting a forward's planned tensors into this rank's sequence shard: each stream's layout (set by
the first tensor of it cut, any length padded), tuples, lists and mappings item by item, cuts
deferred to the module that starts a stream, and leading-token counts rebased to the shard."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from accel.parallel.layout import SequenceLayout
from accel.parallel.matching import PlanMismatch
from accel.parallel.plan_format import LeadingCount, ParallelPlan, SequenceSplit


class PerTensor:
    """Results computed once per tensor object within one forward. Each entry holds its tensor, so
    the id stays unique while cached, and its version, so an in-place change recomputes. `keep`:
    how many entries at most (the latest), for large tensors a model may make anew in every block."""

    def __init__(self, keep: int | None = None) -> None:
        self._entries: dict[int, tuple[Tensor, int, Tensor]] = {}
        self._keep = keep

    def get(self, tensor: Tensor, compute: Callable[[], Tensor]) -> Tensor:
        if torch.compiler.is_compiling():  # a graph would guard on the ids held and recompile each call
            return compute()
        entry = self._entries.get(id(tensor))
        if entry is not None and entry[0] is tensor and entry[1] == tensor._version:
            return entry[2]
        result = compute()
        if self._keep is not None and len(self._entries) >= self._keep:
            self._entries.pop(next(iter(self._entries)))
        self._entries[id(tensor)] = (tensor, tensor._version, result)
        return result

    def clear(self) -> None:
        self._entries.clear()


class Cuts:
    """This rank's cuts within the forward in progress; `clear()` after each forward."""

    def __init__(self, plan: ParallelPlan, world: int, rank: int) -> None:
        self.plan, self.world, self.rank = plan, world, rank
        self.layouts: dict[str, SequenceLayout] = {}
        # Blocks are often handed the same tensor (a joint mask): cut it once per forward, so every
        # block gets the same shard object.
        self._tensors = PerTensor()
        # Deferred cuts of this call: value -> (the argument passed, the copy the transformer holds).
        self._pending: dict[str, tuple[Any, Any]] = {}

    def clear(self) -> None:
        """The per-call state starts empty for the next call."""
        self.layouts = {}
        self._pending.clear()
        self._tensors.clear()

    def real_tokens(self, value: str) -> int | None:
        """During a forward: how many of this rank's tokens of the planned tensor `value` are real,
        the rest being padding at the shard's end (None: all are). Host arithmetic on the layout,
        so the cache can cut its residual on any device without a mask or a sync."""
        stream = next(
            (split.stream for split in self.plan.splits if split.value == value and isinstance(split.stream, str)), None
        )
        layout = self.layouts.get(stream) if stream is not None else None
        if layout is None or not layout.pad:
            return None
        return layout.real(self.rank)

    def arguments(self, arguments: dict[str, Any], splits: list[SequenceSplit]) -> None:
        for split in splits:
            if split.value in arguments:
                arguments[split.value] = self.cut(split, arguments[split.value])

    def rebase_counts(self, arguments: dict[str, Any], counts: list[LeadingCount]) -> None:
        """Each count of a stream's leading tokens becomes how many of them this rank's shard holds
        (a trailing count: how many of its slots come after them, its padding included)."""
        for count in counts:
            total = arguments.get(count.value)
            if total is None:
                continue
            layout = self.layouts.get(count.stream)
            if layout is None:
                raise PlanMismatch(
                    f"context parallelism: {count.value} counts {count.stream} tokens, which nothing has cut yet"
                )
            if isinstance(total, bool) or not isinstance(total, (int, torch.SymInt)):
                raise PlanMismatch(
                    f"context parallelism: {count.value} counts {count.stream} tokens, so it must be an int, not "
                    f"{type(total).__name__}"
                )
            if count.trailing:
                leading = max(0, min(layout.length - total - self.rank * layout.shard, layout.shard))
                arguments[count.value] = layout.shard - leading
            else:
                arguments[count.value] = max(0, min(total - self.rank * layout.shard, layout.real(self.rank)))

    def defer(self, split: SequenceSplit, value: Any) -> Any:
        """The copy of a list or mapping argument that the transformer gets, filled with the cut
        items when `split.at` starts (from `value`, which an outer layer may change until then)."""
        if isinstance(value, Mapping):
            own: Any = dict(value)
        elif isinstance(value, (list, tuple)):
            own = list(value)
        else:
            raise PlanMismatch(
                f"context parallelism: {split.value} is cut where {split.at} starts, so it must be a list or mapping, "
                f"not {type(value).__name__}"
            )
        self._pending[split.value] = (value, own)
        return own

    def cut_deferred(self, split: SequenceSplit) -> None:
        pending = self._pending.pop(split.value, None)
        if pending is None:  # not passed, or cut at an earlier module of the pattern
            return
        source, own = pending
        now = replace(split, at="")
        for key, item in source.items() if isinstance(source, Mapping) else enumerate(source):
            own[key] = self.cut(now, item)

    def cut(self, split: SequenceSplit, value: Any) -> Any:
        if split.element is not None:  # one item of a tuple whose items are different streams
            if not isinstance(value, (tuple, list)) or len(value) <= split.element:
                raise PlanMismatch(
                    f"context parallelism: {split.module or 'the transformer'}'s {split.value} has no item "
                    f"{split.element} to cut"
                )
            items = list(value)
            items[split.element] = self.cut(replace(split, element=None), items[split.element])
            return type(value)(items)
        if isinstance(value, (tuple, list)):
            return type(value)(self.cut(split, item) for item in value)
        if isinstance(value, Mapping):  # {block index: residual} (Z-Image's ControlNet)
            return {key: self.cut(split, item) for key, item in value.items()}
        if not isinstance(value, Tensor) or (split.ndim is not None and value.dim() != split.ndim):
            return value
        if split.broadcast and value.shape[split.dim] == 1:  # one value for every token: every rank keeps it
            return value
        return self._tensors.get(value, lambda: self._cut_tensor(split, value))

    def _cut_tensor(self, split: SequenceSplit, value: Tensor) -> Tensor:
        if len(split.streams) == 1:
            return self._layout(split.streams[0], value.shape[split.dim], split.value).split(
                value, split.dim, self.rank
            )
        whole = [name for name in split.streams if name in self.plan.whole_streams]
        missing = [name for name in split.streams if name not in self.layouts and name not in whole]
        if missing or len(whole) > 1:
            name = missing[0] if missing else whole[1]
            raise PlanMismatch(f"context parallelism: {split.value} spans the {name} stream, which nothing has cut yet")
        cut = sum(self.layouts[name].length for name in split.streams if name not in whole)
        lengths = [
            value.shape[split.dim] - cut if name in whole else self.layouts[name].length for name in split.streams
        ]
        parts = value.split(lengths, dim=split.dim)
        return torch.cat(
            [
                part if name in whole else self.layouts[name].split(part, split.dim, self.rank)
                for name, part in zip(split.streams, parts)
            ],
            dim=split.dim,
        )

    def _layout(self, stream: str, length: int, value: str) -> SequenceLayout:
        layout = self.layouts.setdefault(stream, SequenceLayout(length, self.world))
        if layout.length != length:
            raise ValueError(
                f"context parallelism: {value} has {length} {stream} tokens, other {stream} tensors {layout.length}"
            )
        return layout
