"""What crosses the seam between two block lists in the probe call (accel/models/pipeline_probe.py),
read by the generic path (accel/models/generic.py): the order the lists ran in, whether they take
turns, which list's stream is the next one's (unchanged or concatenated), and so which lists feed the
transformer's output.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from accel.models.base import BlockList
from accel.models.discover import Discovery
from accel.models.probe import named_arguments


class Seams:
    """What crosses the seam between two block lists in the probe call: the last block's outputs of
    each list and the first block's arguments. A transformer that concatenates streams there (FLUX.2
    and Chroma run their single blocks on text then image in one tensor) shows it as a next-list
    stream equal to the previous list's streams concatenated on the token dim: `joins` in the record."""

    def __init__(self, transformer: nn.Module, discovery: Discovery) -> None:
        self.outputs: dict[str, Any] = {}
        self.inputs: dict[str, dict[str, Any]] = {}
        self.runs: list[str] = []  # the lists in the order their blocks ran, a run of one list's blocks once
        self._handles = []
        for found in discovery.lists:
            blocks = transformer.get_submodule(found.attr)
            if not len(blocks):
                continue

            def ran(module: nn.Module, args: Any, attr: str = found.attr) -> None:
                if not self.runs or self.runs[-1] != attr:
                    self.runs.append(attr)

            self._handles += [block.register_forward_pre_hook(ran) for block in blocks]

            def keep_output(module: nn.Module, args: Any, kwargs: Any, output: Any, attr: str = found.attr) -> None:
                self.outputs[attr] = output

            def keep_inputs(module: nn.Module, args: Any, kwargs: Any, attr: str = found.attr) -> None:
                self.inputs.setdefault(attr, named_arguments(module, args, kwargs))

            self._handles.append(blocks[-1].register_forward_hook(keep_output, with_kwargs=True))
            self._handles.append(blocks[0].register_forward_pre_hook(keep_inputs, with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def interleaved(self, transformer_class: str) -> str | None:
        """Why the block cache cannot run where the probe saw lists take turns (Latte's spatial and
        temporal blocks run one of each in turn); None where each list ran through in one go."""
        if len(self.runs) == len(set(self.runs)):
            return None
        lists = " and ".join(dict.fromkeys(self.runs))
        return (
            f"{transformer_class} runs {lists} interleaved (one block of each in turn), and accel's step caches "
            "need lists that run one after another; quantization and compile apply"
        )

    def joined(self, lists: tuple[BlockList, ...]) -> tuple[BlockList, ...]:
        """`lists` with each one-stream list after a several-stream one given the `joins` the probe
        saw; a list whose stream is neither the previous list's nor their concatenation ends the lists."""
        kept = [lists[0]]
        for block_list in lists[1:]:
            before = kept[-1]
            outputs = self.outputs.get(before.attr)
            arguments = self.inputs.get(block_list.attr, {})
            if outputs is None or len(block_list.returns) != 1 or len(before.returns) == 1:
                kept.append(block_list)
                continue
            streams = dict(zip(before.returns, outputs if isinstance(outputs, tuple) else (outputs,)))
            mine = arguments.get(block_list.returns[0])
            same = streams.get(block_list.returns[0])
            if isinstance(mine, torch.Tensor) and isinstance(same, torch.Tensor) and mine.shape == same.shape:
                kept.append(block_list)
                continue
            order = next(
                (
                    order
                    for order in itertools.permutations(before.returns)
                    if isinstance(mine, torch.Tensor) and _concatenation_of(mine, [streams[name] for name in order])
                ),
                None,
            )
            if order is None:
                break
            kept.append(BlockList(block_list.attr, returns=block_list.returns, joins=tuple(order)))
        return tuple(kept)

    def feeding_output(self, lists: tuple[BlockList, ...]) -> tuple[BlockList, ...]:
        """The lists whose stream becomes the transformer's output: the last list to run, and before it
        each list whose last block's output the next list's first block takes (unchanged, or joined).
        A list that prepares another stream apart runs as it is, outside the cache (Z-Image's refiners
        of the image and of the caption before they are joined per sample, Kandinsky 5's text blocks)."""
        kept = [lists[-1]]
        for before in reversed(lists[:-1]):
            if not (kept[0].joins or self._takes_output_of(kept[0].attr, before.attr)):
                break
            kept.insert(0, before)
        return tuple(kept)

    def _takes_output_of(self, after: str, before: str) -> bool:
        outputs = self.outputs.get(before)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        arguments = self.inputs.get(after, {}).values()
        return any(
            isinstance(argument, torch.Tensor)
            and isinstance(output, torch.Tensor)
            and argument.shape == output.shape
            and torch.equal(argument, output)
            for argument in arguments
            for output in outputs
        )


def _concatenation_of(joined: torch.Tensor, parts: list[Any]) -> bool:
    if not all(isinstance(part, torch.Tensor) and part.dim() == joined.dim() for part in parts):
        return False
    if sum(part.shape[1] for part in parts) != joined.shape[1]:
        return False
    return torch.equal(torch.cat(parts, dim=1), joined)
