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
candidates; verification (accel/parallel/verify.py) keeps the closest that is exact.
What the plan cannot express is refused here in one line (`AutomaticPlanRefused`).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from accel.models.base import BlockList
from accel.parallel.plan_format import FromDiffusers, LeadingCount, ParallelPlan, SequenceSplit
from accel.models.probe import named_arguments
from accel.parallel.outputs import map_tensors

STREAM = "hidden"  # the main stream: the first block list's hidden states
TEXT = "text"  # the text stream, whole on every rank


class AutomaticPlanRefused(ValueError):
    """The transformer does something the automatic plan cannot express (one line: what, where)."""


@dataclass(frozen=True)
class TransformerCall:
    """One call of a transformer's forward, kept to run it again (the verification's input)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def fresh(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments with every tensor copied, so a model that writes into its inputs changes no other run."""
        return map_tensors(self.args, torch.clone), map_tensors(self.kwargs, torch.clone)

    def to(self, device: torch.device | str) -> TransformerCall:
        return TransformerCall(
            map_tensors(self.args, lambda t: t.to(device)), map_tensors(self.kwargs, lambda t: t.to(device))
        )


@dataclass
class _Attention:
    """The attention calls one module pattern made: (query tokens, key tokens) pairs, and whether
    any came with a square boolean mask (one relating every token pair)."""

    shapes: set[tuple[int, int]] = field(default_factory=set)
    square_mask: bool = False


@dataclass
class Observation:
    """What one unsplit forward showed: first-block arguments per list, attention calls per module
    pattern, the modules outside the blocks called after the last block, in call order (name, first
    argument), the transformer's own arguments and its output."""

    first_arguments: dict[str, dict[str, Any]]
    attention: dict[str, _Attention]
    after_blocks: list[tuple[str, Any]]
    transformer_arguments: dict[str, Any]
    output: Any


class _ModuleStack:
    """The dotted name of the innermost module running, from hooks on every module."""

    def __init__(self, transformer: nn.Module) -> None:
        self.names: list[str] = []
        self._handles = []
        for name, module in transformer.named_modules():
            self._handles.append(module.register_forward_pre_hook(lambda *_, name=name: self._enter(name)))
            self._handles.append(module.register_forward_hook(lambda *_: self._leave(), always_call=True))

    def _enter(self, name: str) -> None:
        self.names.append(name)

    def _leave(self) -> None:
        self.names.pop()

    @property
    def innermost(self) -> str:
        return self.names[-1] if self.names else ""

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class _AttentionLog(TorchFunctionMode):
    def __init__(self, stack: _ModuleStack) -> None:
        super().__init__()
        self.stack = stack
        self.calls: list[tuple[str, int, int]] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query = args[0] if args else kwargs["query"]
            key = args[1] if len(args) > 1 else kwargs["key"]
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            square = (
                isinstance(mask, Tensor)
                and mask.dtype == torch.bool
                and mask.dim() == 4
                and mask.shape[-1] == mask.shape[-2] > 1
            )
            self.calls.append((self.stack.innermost, query.shape[-2], key.shape[-2], square))
        return func(*args, **kwargs)


def pattern_of(name: str) -> str:
    """A module name with every list index made `*`: one pattern for the same module of every block."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name)


def observe(transformer: nn.Module, call: TransformerCall, lists: Sequence[BlockList]) -> Observation:
    """Run `transformer` once on `call`, unsplit, watching what the plan needs."""
    first_arguments: dict[str, dict[str, Any]] = {}
    order: list[tuple[str, Any]] = []  # direct children in call order, and "<blocks>" after each block
    handles = []
    attrs = {block_list.attr for block_list in lists}
    for block_list in lists:
        blocks = transformer.get_submodule(block_list.attr)

        def keep(module: nn.Module, args: Any, kwargs: Any, attr: str = block_list.attr) -> None:
            first_arguments.setdefault(attr, named_arguments(module, args, kwargs))

        handles.append(blocks[0].register_forward_pre_hook(keep, with_kwargs=True))
        for block in blocks:
            handles.append(block.register_forward_hook(lambda *_: order.append(("<blocks>", None))))
    # Every module outside the block lists: the outermost one running first after the blocks is
    # where the output is gathered (a ModuleDict's item, such as Z-Image's final layer, is called
    # where the dict itself never is).
    for name, child in transformer.named_modules():
        if not name or any(name == attr or name.startswith(attr + ".") for attr in attrs):
            continue

        def called(module: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
            first = next(iter(named_arguments(module, args, kwargs).values()), None)
            order.append((name, first))

        handles.append(child.register_forward_pre_hook(called, with_kwargs=True))
    stack = _ModuleStack(transformer)
    log = _AttentionLog(stack)
    try:
        args, kwargs = call.fresh()
        with torch.no_grad(), log:
            output = transformer(*args, **kwargs)
    finally:
        stack.remove()
        for handle in handles:
            handle.remove()
    attention: dict[str, _Attention] = {}
    for name, queries, keys, square in log.calls:
        entry = attention.setdefault(pattern_of(name), _Attention())
        entry.shapes.add((queries, keys))
        entry.square_mask = entry.square_mask or square
    last = max((i for i, (name, _) in enumerate(order) if name == "<blocks>"), default=-1)
    return Observation(
        first_arguments=first_arguments,
        attention=attention,
        after_blocks=[entry for entry in order[last + 1 :] if entry[0] != "<blocks>"],
        transformer_arguments=named_arguments(transformer, *call.fresh()),
        output=output,
    )


def candidate_plans(
    transformer: nn.Module, observation: Observation, other: Observation, lists: Sequence[BlockList], primary: str
) -> list[ParallelPlan]:
    """The plans two observations allow (`other`: the same call at another size, which tells a dim
    that runs along the tokens from one that only happens to be as long), most likely first;
    AutomaticPlanRefused where none can be written."""
    name = type(transformer).__name__
    length, text = _lengths(name, observation, lists, primary)
    more, _ = _lengths(name, other, lists, primary)
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


def _lengths(name: str, observation: Observation, lists: Sequence[BlockList], primary: str) -> tuple[int, int | None]:
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
        kind = _kind(name, pattern, calls.shapes, other.attention.get(pattern, _Attention()).shapes, tokens)
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


def diffusers_candidates(
    transformer: nn.Module,
    calls: tuple[TransformerCall, TransformerCall],
    observations: tuple[Observation, Observation],
    lists: Sequence[BlockList],
    primary: str,
    candidates: Sequence[ParallelPlan],
) -> list[ParallelPlan]:
    """The class's own diffusers `_cp_plan` as accel plans, one per reading of the attention among
    `candidates` (the automatic plan's, from the same two `calls` and their `observations`): its cuts
    and gather, each cut's stream learned from the two calls (accel/parallel/derive.py). Empty where
    the class has none, where a cut follows no stream, or where accel cannot express the plan
    (several gathers): the automatic plan is then the source."""
    from accel.parallel.derive import PlanDerivationError, cut_keys, cut_lengths, derive_plan, learned_streams

    cp_plan = getattr(type(transformer), "_cp_plan", None)
    if not cp_plan or not candidates:
        return []
    name = type(transformer).__name__
    (length, text), (more, _) = (_lengths(name, observation, lists, primary) for observation in observations)

    def lengths_in(call: TransformerCall) -> dict[str, int | None]:
        args, kwargs = call.fresh()
        with torch.no_grad():
            return cut_lengths(transformer, lambda: transformer(*args, **kwargs))

    streams = learned_streams(
        cut_keys(cp_plan),
        lengths_in(calls[0]),
        lengths_in(calls[1]),
        (STREAM, length, more),
        None if text is None else (TEXT, text),
    )
    if streams is None:
        return []
    derived: dict[str, ParallelPlan] = {}
    for plan in candidates:
        spec = FromDiffusers(
            streams=streams,
            attention_keys=plan.attention_keys,
            output_stream=plan.output_stream,
            local_attention=plan.local_attention,
            batch_args=plan.batch_args,
            module_keys=plan.module_keys,
            whole_queries=plan.whole_queries,
        )
        try:
            cut = derive_plan(cp_plan, spec)
        except PlanDerivationError:
            return []
        text_cut = any(split.stream == TEXT for split in cut.splits)
        cut = replace(
            cut,
            pairwise_mask=plan.pairwise_mask,
            leading_counts=plan.leading_counts,
            whole_streams=() if text_cut else plan.whole_streams,
        )
        derived.setdefault(repr(cut), cut)
    return list(derived.values())


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
