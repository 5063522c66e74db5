"""A context-parallel plan learned from one unsplit forward of a transformer no plan describes.

Where the peers need a hand-written `_cp_plan` or a forked forward, this watches the transformer run
once on a small real input (the pipeline's own first transformer call) and writes the plan the hand
plans of accel's families almost all are:

- the main stream (the first block list's hidden states) is cut where the blocks start, so the
  patch embedding, positions and modulation before them run whole and need no knowledge;
- every other block argument with a dimension that follows that stream's length (rotary tables,
  per-token modulation, token masks) is cut along it at every block, and one as long as the text and
  the stream together as those two streams;
- an integer block argument that changes with the stream's length and stays within it counts some
  of its tokens (Helios's chunk after its history tokens): each rank gets its shard's share, read
  as a count of the stream's leading tokens or of its trailing ones (both tried, then neither);
- where the first blocks carry the text as a stream of their own (FLUX's and SD 3.5's double
  blocks) it is cut there too; otherwise, or where that is not exact, it stays whole on every rank:
  cross-attention to it runs locally, joint attention over text and stream shares the text's work
  out (the engine's replicated stream);
- attention outside the blocks (refiners, before the cut) runs locally on the whole tokens;
- the output is gathered where the first module after the blocks starts, so everything after runs
  on the whole sequence (unpatchify included).

What the forward does not show (the order in which a joint attention concatenates text and stream,
whether a square mask is a per-token one, whether cutting the text is exact) gives several
candidates; accel/parallel/choose.py verifies them and keeps the closest that is exact. The forward is
watched by accel/parallel/observe.py; the class's own diffusers `_cp_plan`, where it has one, gives
more candidates (accel/parallel/diffusers_candidates.py).
What the plan cannot express is refused here in one line (`AutomaticPlanRefused`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor, nn

from accel.models.base import BlockList
from accel.models.probe import named_arguments
from accel.parallel.observe import AttentionCalls, Observation, TransformerCall
from accel.parallel.plan_format import LeadingCount, ParallelPlan, SequenceSplit

STREAM = "hidden"  # the main stream: the first block list's hidden states
TEXT = "text"  # the text stream, whole on every rank


class AutomaticPlanRefused(ValueError):
    """The transformer does something the automatic plan cannot express (one line: what, where)."""


def candidate_plans(
    transformer: nn.Module, observation: Observation, other: Observation, lists: Sequence[BlockList], primary: str
) -> list[ParallelPlan]:
    """The plans two observations allow (`other`: the same call at another size, which tells a dim
    that runs along the tokens from one that only happens to be as long), most likely first;
    AutomaticPlanRefused where none can be written."""
    name = type(transformer).__name__
    length, text = token_lengths(name, observation, lists, primary)
    more, _ = token_lengths(name, other, lists, primary)
    if more == length:
        raise AutomaticPlanRefused(f"{name}'s {lists[0].attr} took as many {primary} tokens at two probe sizes")
    tokens = _Tokens(length, more, text)
    joint_lists = [block_list.attr for block_list in lists if len(block_list.returns) > 1]
    orders = [(TEXT, STREAM), (STREAM, TEXT)]
    # One joint order per list of several streams (unknown: both tried); a joined list's is known.
    choices = list(itertools.product(orders, repeat=len(joint_lists))) if text is not None else [()]
    # A square boolean mask is either one per-token mask ANDed with itself (read off its diagonal)
    # or a real relation between token pairs (kept whole): both are tried.
    pairwise = (True, False) if any(entry.square_mask for entry in observation.attention.values()) else (False,)
    # Where the first blocks carry the text as a stream of their own (FLUX's, SD 3.5's double blocks),
    # cutting it too spares each rank the whole text's work; kept whole, it is the fallback.
    text_stream = _text_stream(observation, lists[0], primary, text)
    cuts = (text_stream, None) if text_stream is not None else (None,)
    counted = _token_counts(observation, other, lists, tokens)
    readings = (False, True, None) if counted else (None,)  # leading, trailing, not a count after all
    plans = []
    for cut, choice, pairs, trailing in itertools.product(cuts, choices, pairwise, readings):
        joint = dict(zip(joint_lists, choice))
        for block_list in lists:
            if block_list.joins:
                joint[block_list.attr] = tuple(STREAM if stream == primary else TEXT for stream in block_list.joins)
        plan = _plan(
            name, observation, other, lists, primary, replace(tokens, text_cut=cut is not None), joint, pairs, cut
        )
        if trailing is not None:
            plan = replace(
                plan,
                leading_counts=tuple(
                    LeadingCount(argument, STREAM, module=f"{attr}.*", trailing=trailing) for attr, argument in counted
                ),
            )
        plans.append(plan)
    return plans


def _token_counts(
    observation: Observation, other: Observation, lists: Sequence[BlockList], tokens: _Tokens
) -> list[tuple[str, str]]:
    """(list, argument) of every integer block argument that counts some of the stream's tokens: it
    changes from one probe size to the other and stays within the stream's length at both."""
    found = []
    for block_list in lists:
        there = other.first_arguments.get(block_list.attr, {})
        for argument, value in observation.first_arguments.get(block_list.attr, {}).items():
            other_value = there.get(argument)
            if (
                type(value) is int
                and type(other_value) is int
                and value != other_value
                and 0 < value <= tokens.length
                and 0 < other_value <= tokens.other
            ):
                found.append((block_list.attr, argument))
    return found


def _text_stream(observation: Observation, first: BlockList, primary: str, text: int | None) -> str | None:
    """The first list's argument that is the text as a stream of its own (returned beside the main one)."""
    arguments = observation.first_arguments.get(first.attr, {})
    return next(
        (
            stream
            for stream in first.returns
            if stream != primary
            and isinstance(arguments.get(stream), Tensor)
            and arguments[stream].dim() == 3
            and arguments[stream].shape[1] == text
        ),
        None,
    )


@dataclass(frozen=True)
class _Tokens:
    """The main stream's length in the observed call and in the other one, and the text's (None: no text)."""

    length: int
    other: int
    text: int | None
    text_cut: bool = False  # the plan cuts the text too: a dim as long as the text (at both sizes) is cut with it

    def along(self, size: int, other_size: int) -> tuple[bool, bool] | None:
        """(runs along the stream, spans the text too) for a dim of `size` here and `other_size` in the
        other call; None where the dim does not follow the stream's length."""
        if size == self.length and other_size == self.other:
            return True, False
        if self.text is not None and size == self.text + self.length and other_size == self.text + self.other:
            return True, True
        return None

    def text_only(self, size: int, other_size: int) -> bool:
        return self.text_cut and self.text is not None and size == other_size == self.text


def token_lengths(
    name: str, observation: Observation, lists: Sequence[BlockList], primary: str
) -> tuple[int, int | None]:
    first = lists[0]
    hidden = observation.first_arguments.get(first.attr, {}).get(primary)
    if not isinstance(hidden, Tensor) or hidden.dim() != 3:
        raise AutomaticPlanRefused(f"{name}'s {first.attr} take {primary} that is not (batch, tokens, width)")
    return hidden.shape[1], _text_length(observation, lists, primary)


def _text_length(observation: Observation, lists: Sequence[BlockList], primary: str) -> int | None:
    """How many text tokens the blocks see: a second stream the blocks return, else a 3-D encoder_hidden_states."""
    for block_list in lists:
        arguments = observation.first_arguments.get(block_list.attr, {})
        for stream in block_list.returns:
            if stream != primary and isinstance(arguments.get(stream), Tensor) and arguments[stream].dim() == 3:
                return arguments[stream].shape[1]
    for arguments in observation.first_arguments.values():
        value = arguments.get("encoder_hidden_states")
        if isinstance(value, Tensor) and value.dim() == 3:
            return value.shape[1]
    return None


def _plan(
    name: str,
    observation: Observation,
    other: Observation,
    lists: Sequence[BlockList],
    primary: str,
    tokens: _Tokens,
    joint: dict[str, tuple[str, str]],
    pairwise: bool,
    text_stream: str | None = None,
) -> ParallelPlan:
    length, text = tokens.length, tokens.text
    splits = [SequenceSplit(primary, STREAM, dim=1, module=f"{lists[0].attr}.0")]
    if text_stream is not None:
        splits.append(SequenceSplit(text_stream, TEXT, dim=1, module=f"{lists[0].attr}.0"))
    for block_list in lists:
        arguments = observation.first_arguments.get(block_list.attr, {})
        other_arguments = other.first_arguments.get(block_list.attr, {})
        order = joint.get(block_list.attr)
        for argument, value in arguments.items():
            if argument in block_list.returns:
                continue
            for element, tensor_rank, dim, spans_text in _token_dims(value, other_arguments.get(argument), tokens):
                if spans_text and order is None:  # (None: the text alone, where the plan cuts it)
                    raise AutomaticPlanRefused(
                        f"{name}'s {block_list.attr} take {argument} over text and {primary} tokens together, "
                        "with no joint attention to tell their order"
                    )
                stream: str | tuple[str, ...] = TEXT if spans_text is None else order if spans_text else STREAM
                splits.append(
                    SequenceSplit(
                        argument, stream, dim=dim, module=f"{block_list.attr}.*", ndim=tensor_rank, element=element
                    )
                )
    local, module_keys, whole_queries = [], [], []
    inside = tuple(block_list.attr for block_list in lists)
    for pattern, calls in observation.attention.items():
        attr = next((a for a in inside if pattern == a or pattern.startswith(a + ".")), None)
        if attr is None:  # before the cut or after the gather: every rank holds the whole tokens
            if not pattern:
                raise AutomaticPlanRefused(f"{name} calls attention in its own forward, outside any module")
            local.append(pattern)
            continue
        kind = _kind(name, pattern, calls.shapes, other.attention.get(pattern, AttentionCalls()).shapes, tokens)
        if kind == "local":
            local.append(pattern)
        elif kind == "joint":
            order = joint.get(attr)
            if order is None:
                raise AutomaticPlanRefused(
                    f"{name}'s {pattern} attends over text and {primary} tokens together in a list of one stream"
                )
            module_keys.append((pattern, order))
        elif kind == "text-queries":
            whole_queries.append(pattern)
    gather = next(
        (
            (child, first)
            for child, first in observation.after_blocks
            if isinstance(first, Tensor) and length in tuple(first.shape)[1:]
        ),
        None,
    )
    if gather is not None:  # where the first module after the blocks starts: all after runs whole
        output_module, output_dim, before = gather[0], tuple(gather[1].shape).index(length, 1), True
    elif lists[-1].returns[0] == primary:
        # The tokens are reshaped right after (Kandinsky 5): the last block's output. Where it returns more
        # (Kandinsky 6's audio beside the video), only its first item is gathered; verification finds whether
        # what the transformer does with the others after the blocks is exact on every rank.
        output_module, output_dim, before = f"{lists[-1].attr}.-1", 1, False
    else:
        raise AutomaticPlanRefused(
            f"{name} runs no module on the {primary} tokens after its blocks, where the automatic plan gathers them"
        )
    return ParallelPlan(
        splits=tuple(_unique(splits)),
        attention_keys=(STREAM,),
        output_stream=STREAM,
        output_dim=output_dim,
        output_module=output_module,
        output_before=before,
        local_attention=tuple(local),
        module_keys=tuple(module_keys),
        whole_queries=tuple(whole_queries),
        batch_args=_batch_arguments(observation.transformer_arguments, primary),
        whole_streams=(TEXT,) if text is not None and text_stream is None else (),
        pairwise_mask=pairwise,
        origin="automatic",
    )


def _kind(name: str, pattern: str, shapes: set[tuple[int, int]], other: set[tuple[int, int]], tokens: _Tokens) -> str:
    """How one module's attention sees the tokens: "self" over the stream, "joint" over text and
    stream, "local" (keys that do not follow the stream: cross-attention to text, or attention among
    fixed tokens), "text-queries" (fixed queries to the stream's keys)."""
    if len(shapes) != len(other):
        raise AutomaticPlanRefused(f"{name}'s {pattern} attends over tokens that change in number from call to call")
    kinds = set()
    for (queries, keys), (other_queries, other_keys) in zip(sorted(shapes), sorted(other)):
        query_side = tokens.along(queries, other_queries)
        key_side = tokens.along(keys, other_keys)
        if keys == other_keys:
            kinds.add("local")
        elif key_side == (True, False) and query_side == (True, False):
            kinds.add("self")
        elif queries == keys and other_queries == other_keys and keys - tokens.length == other_keys - tokens.other > 0:
            kinds.add("joint")  # the stream and other tokens of a fixed count: the text (Mochi's, only its real tokens)
        elif key_side == (True, False) and queries == other_queries:
            kinds.add("text-queries")
        else:
            raise AutomaticPlanRefused(
                f"{name}'s {pattern} attends {queries} queries to {keys} keys, which the automatic "
                f"plan cannot place among the {tokens.length} stream tokens"
                + (f" and the {tokens.text} text tokens" if tokens.text is not None else "")
            )
    if len(kinds) > 1:
        raise AutomaticPlanRefused(
            f"{name}'s {pattern} attends over different tokens in different calls ({', '.join(sorted(kinds))})"
        )
    return kinds.pop()


def _token_dims(value: Any, other: Any, tokens: _Tokens) -> Iterator[tuple[int | None, int, int, bool | None]]:
    """(tuple item or None, tensor rank, dim, spans text too) for the tensors of `value` that run along
    the stream's tokens: a dim that follows the stream's length from the observed call to the other
    one. The items of a tuple are cut alike where they all run along the stream (a rotary (cos, sin)
    pair), else each item that does is cut on its own (Qwen-Image's (image table, text table))."""
    if (
        isinstance(value, (tuple, list))
        and all(isinstance(item, Tensor) for item in value)
        and isinstance(other, (tuple, list))
    ):
        found = [_tensor_dim(item, item_there, tokens) for item, item_there in zip(value, other)]
        if found and all(
            f is not None and f == found[0] and item.dim() == value[0].dim() for f, item in zip(found, value)
        ):
            yield None, value[0].dim(), *found[0]
            return
        for index, (item, dims) in enumerate(zip(value, found)):
            if dims is not None:
                yield index, item.dim(), *dims
        return
    if isinstance(value, Tensor) and isinstance(other, Tensor):
        dims = _tensor_dim(value, other, tokens)
        if dims is not None:
            yield None, value.dim(), *dims


def _tensor_dim(tensor: Tensor, other: Tensor, tokens: _Tokens) -> tuple[int, bool | None] | None:
    """(dim, spans the text too) of the first dim along the stream, or (dim, None) of one along the
    text alone where the plan cuts the text."""
    if other.dim() != tensor.dim():
        return None
    for dim, (size, other_size) in enumerate(zip(tensor.shape, other.shape)):
        along = tokens.along(size, other_size)
        if along is not None:
            return dim, along[1]
        if tokens.text_only(size, other_size):
            return dim, None
    return None


def batch_arguments_of(transformer: nn.Module, call: TransformerCall, primary: str) -> ParallelPlan:
    """A plan that splits nothing and names the arguments carrying the batch: what CFG parallelism
    alone needs of a plan (no verification: halving the batch changes no token's result)."""
    arguments = named_arguments(transformer, *call.fresh())
    return ParallelPlan(
        splits=(), attention_keys=(STREAM,), output_stream=STREAM, batch_args=_batch_arguments(arguments, primary)
    )


def _batch_arguments(arguments: dict[str, Any], primary: str) -> tuple[str, ...]:
    """The transformer arguments that carry the batch (CFG parallelism halves them): tensors whose
    first dim is the main input's batch, where that batch holds more than one sample."""
    hidden = arguments.get(primary)
    if not isinstance(hidden, Tensor) or hidden.shape[0] < 2:
        return ()
    batch = hidden.shape[0]
    return tuple(
        name
        for name, value in arguments.items()
        if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == batch
    )


def _unique(splits: list[SequenceSplit]) -> list[SequenceSplit]:
    return list(dict.fromkeys(splits))
