"""Text encoders on one rank ([memory] text_encoder = "rank0"): the layout's first rank encodes each
prompt once and sends the embeddings to the others, which hold no text encoder at all. With
text_encoder = "cpu" that rank (or the one process) also keeps them in host memory and encodes there.

Every family's pipeline encodes through `encode_prompt`, so that one method is wrapped: on the
first rank it runs and its result is broadcast over the layout's group (its structure as a
picklable skeleton, then each tensor on the device); on the others the same call returns the
received copy, built on the device and in the dtype the first rank's had. Dropping the encoders
stays when the rest of `accel.apply` is undone, like the TP split: the memory was given back.

With text_encoder = "sharded" every rank of the layout holds a slice of each text encoder that
transformers gives a tensor-parallel plan (its config's `base_model_tp_plan`, the model's `_tp_plan`:
Llama, Mistral, Qwen2.5-VL, Qwen3, Gemma 3), split by transformers' own `apply_tensor_parallelism`;
every rank runs `encode_prompt` together on the same prompt, and the plan's row-wise layers
all-reduce, so each gets the whole embeddings. Encoders without a plan (T5, UMT5, CLIP) stay whole
on every rank; a pipeline none of whose encoders has one is refused. The split also stays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from accel.errors import NotAvailableError, UserError
import inspect

from accel.hooks import ENCODE, ENCODE_ON_CPU, wrap

METHOD = "encode_prompt"


# Placements under which only the layout's first rank holds the text encoders.
ONE_RANK_PLACEMENTS = ("rank0", "cpu")
SHARDED = "sharded"


def loads_text_encoders(placement: str, layout_size: int) -> bool:
    """Whether this rank loads the text encoders under [memory] text_encoder = `placement` in a
    layout of `layout_size` ranks (replicas of it side by side: each one's first rank encodes)."""
    from accel.launch.environment import rank

    return placement not in ONE_RANK_PLACEMENTS or layout_size == 1 or rank() % layout_size == 0


def loads_into_host_memory(placement: str, layout_size: int) -> bool:
    """Whether `accel serve` loads the text encoders into host memory under `placement`: "cpu" encodes
    there; "sharded" on several ranks leaves them there for `accel.apply`, which moves each rank's slice
    to the GPU weight by weight (the GPU never holds a whole encoder; host memory holds one per rank
    meanwhile). `accel run` loads them split instead (load_pipeline's `text_encoders_tp`), which needs
    the layout to be the whole job, as a replica of `accel serve` is not."""
    return placement == "cpu" or (placement == SHARDED and layout_size > 1)


def text_encoder_names(pipe: Any) -> list[str]:
    """The pipeline's text encoder components that it holds (text_encoder, text_encoder_2, …)."""
    return [
        name
        for name in getattr(pipe, "components", {})
        if name.startswith("text_encoder") and getattr(pipe, name, None) is not None
    ]


@dataclass(frozen=True)
class _Slot:
    """Where a tensor of the result was: its index among the tensors sent, shape, dtype and device kind."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool


def _mapped(value: Any, leaf: type, fn: Any) -> Any:
    """`value` with every `leaf` inside its lists, tuples (named ones too) and dicts replaced by fn(leaf)."""
    if isinstance(value, leaf):
        return fn(value)
    if isinstance(value, (list, tuple)):
        items = [_mapped(item, leaf, fn) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {key: _mapped(item, leaf, fn) for key, item in value.items()}
    return value


def _skeleton(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with each tensor replaced by its _Slot, the tensors appended to `tensors` in order."""

    def slot(tensor: torch.Tensor) -> _Slot:
        tensors.append(tensor)
        return _Slot(len(tensors) - 1, tuple(tensor.shape), tensor.dtype, tensor.device.type == "cpu")

    return _mapped(value, torch.Tensor, slot)


class FirstRankEncodes:
    """`pipe.encode_prompt` run by the first rank of `group` only, its result shared with the rest."""

    def __init__(self, pipe: Any, group: Any, device: torch.device) -> None:
        if not callable(getattr(pipe, METHOD, None)):
            raise NotAvailableError(
                f'[memory] text_encoder = "rank0": {type(pipe).__name__} has no {METHOD}() to run on one rank; set '
                'text_encoder = "replicated"'
            )
        self.group, self.device = group, device
        self.source = dist.get_global_rank(group, 0) if group is not None and group != dist.group.WORLD else 0
        self.leads = dist.get_rank() == self.source
        if not self.leads:
            pipe.register_modules(**{name: None for name in text_encoder_names(pipe)})
        self.remove = self.also_on(pipe)

    def also_on(self, pipe: Any) -> Callable[[], None]:
        """The same for a pipeline on the same encoders (AccelHandle.attach); returns its undo."""
        return wrap(pipe, METHOD, "accel.encoders.first_rank", ENCODE, self._encode)

    def _encode(self, call_next: Any, *args: Any, **kwargs: Any) -> Any:
        if self.leads:
            result = call_next(*args, **kwargs)
            tensors: list[torch.Tensor] = []
            skeleton = _skeleton(result, tensors)
            dist.broadcast_object_list([skeleton], src=self.source, group=self.group)
            for tensor in tensors:
                dist.broadcast(tensor.to(self.device).contiguous(), src=self.source, group=self.group)
            return result
        received: list[Any] = [None]
        dist.broadcast_object_list(received, src=self.source, group=self.group)
        return _mapped(received[0], _Slot, self._receive)  # in the order the first rank sent them

    def _receive(self, slot: _Slot) -> torch.Tensor:
        tensor = torch.empty(slot.shape, dtype=slot.dtype, device=self.device)
        dist.broadcast(tensor, src=self.source, group=self.group)
        return tensor.cpu() if slot.on_cpu else tensor


def _moved(value: Any, device: torch.device) -> Any:
    return _mapped(value, torch.Tensor, lambda tensor: tensor.to(device))


class EncodesOnCpu:
    """The pipeline's text encoders kept in host memory: `encode_prompt` runs with device="cpu" and
    its tensors are moved to `device` (the transformer's). remove() puts the encoders back."""

    def __init__(self, pipe: Any, device: torch.device) -> None:
        method = getattr(pipe, METHOD, None)
        if not callable(method) or "device" not in inspect.signature(method).parameters:
            raise NotAvailableError(
                f'[memory] text_encoder = "cpu": {type(pipe).__name__} has no {METHOD}(device=...) to run on the CPU; '
                f'set text_encoder = "replicated" or "rank0"'
            )
        self.device = device
        self.encoders = {name: getattr(pipe, name) for name in text_encoder_names(pipe)}
        self.devices = {name: next(encoder.parameters()).device for name, encoder in self.encoders.items()}
        for encoder in self.encoders.values():
            encoder.to("cpu")
        self._unwrap = self.also_on(pipe)

    def also_on(self, pipe: Any) -> Callable[[], None]:
        """The same for a pipeline on the same encoders (AccelHandle.attach); returns its undo."""
        return wrap(pipe, METHOD, "accel.encoders.on_cpu", ENCODE_ON_CPU, self._encode)

    def _encode(self, call_next: Any, *args: Any, **kwargs: Any) -> Any:
        return _moved(call_next(*args, **{**kwargs, "device": torch.device("cpu")}), self.device)

    def remove(self) -> None:
        self._unwrap()
        for name, encoder in self.encoders.items():
            encoder.to(self.devices[name])


# -- text_encoder = "sharded" -----------------------------------------------------------------------


def class_has_tp_plan(cls: type) -> bool:
    """Whether transformers gives the encoder class `cls` a tensor-parallel plan, known from the class
    alone (before loading): its own `_tp_plan`, or its config's (or a sub-config's) `base_model_tp_plan`."""
    config = getattr(cls, "config_class", None)
    configs = [config, *getattr(config, "sub_configs", {}).values()] if config is not None else []
    return bool(getattr(cls, "_tp_plan", None)) or any(getattr(c, "base_model_tp_plan", None) for c in configs)


def refusal_before_start(ref: Any) -> str | None:
    """text_encoder = "sharded"'s refusal of a model none of whose text encoders has a plan, from the
    class names its model_index.json (a saved folder) or its flagship configs (a registry model) give,
    before anything loads; None where they say nothing (a tiny variant, a hub id: refused at apply)."""
    import transformers

    from accel.models.flagships import FLAGSHIPS
    from accel.models.folder_check import read_index

    folder = Path(ref.source) if ref.source else None
    if folder is not None and folder.is_dir():
        index = read_index(folder)
        pipeline = index["_class_name"]
        classes = [
            str(value[-1])
            for name, value in index.items()
            if name.startswith("text_encoder") and isinstance(value, list) and value and value[0] is not None
        ]
    else:
        flagship = next(
            (f for f in FLAGSHIPS.values() if ref.family is not None and not ref.tiny and f.repo == ref.source), None
        )
        if flagship is None:
            return None
        pipeline = ref.family.pipeline_class
        classes = [c.cls for c in flagship.of_kind("text_encoder")]
    known = [getattr(transformers, name, None) for name in classes]
    if not classes or any(cls is None or class_has_tp_plan(cls) for cls in known):
        return None
    return no_plan_message(pipeline, classes)


def tp_plan_of(encoder: Any) -> dict[str, str]:
    """The encoder's tensor-parallel plan as transformers resolves it for one model (empty: none)."""
    return dict(getattr(encoder, "tp_plan", None) or {})


def no_plan_message(pipeline: str, classes: list[str]) -> str:
    return (
        f'[memory] text_encoder = "sharded": the text encoders of {pipeline} ({", ".join(classes)}) have no '
        f'tensor-parallel plan in transformers; set text_encoder = "replicated", "rank0" or "cpu"'
    )


def sharded_refusal(pipe: Any, ranks: int) -> str | None:
    """Why [memory] text_encoder = "sharded" cannot split `pipe`'s encoders over `ranks` (None: it can):
    none of them has a plan, or one that has splits its attention heads unevenly, which transformers
    would do silently (each rank holding part of a head: wrong embeddings)."""
    encoders = {name: getattr(pipe, name) for name in text_encoder_names(pipe)}
    planned = {name: encoder for name, encoder in encoders.items() if tp_plan_of(encoder)}
    if not planned:
        return no_plan_message(type(pipe).__name__, [type(encoder).__name__ for encoder in encoders.values()])
    return next(
        (problem for encoder in planned.values() if (problem := heads_problem(encoder, ranks)) is not None), None
    )


def heads_problem(encoder: Any, ranks: int) -> str | None:
    """Why `ranks` cannot split the encoder's attention heads evenly (None: they can)."""
    config = encoder.config.get_text_config()
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if isinstance(heads, int) and isinstance(kv_heads, int) and (heads % ranks or kv_heads % ranks):
        return (
            f'[memory] text_encoder = "sharded": {type(encoder).__name__} has {heads} attention heads and {kv_heads} '
            f'key-value heads, which {ranks} ranks do not divide; set text_encoder = "replicated", "rank0" or "cpu"'
        )
    return None


def local_bytes(module: torch.nn.Module) -> int:
    """The bytes of `module`'s parameters this rank holds: a split one's local slice, a tied one once."""
    from torch.distributed.tensor import DTensor

    held = {id(p): (p.to_local() if isinstance(p, DTensor) else p) for p in module.parameters()}
    return sum(tensor.numel() * tensor.element_size() for tensor in held.values())


def split_encoder(encoder: Any, mesh: Any) -> None:
    """Split one encoder over `mesh` with transformers' own plan, in place (on meta too: the memory plan
    counts a rank's slice this way). A plan entry for a tied weight (an LM head sharing the embedding:
    Gemma 3) names no parameter of its own, and transformers' apply would fail on it; the tie, made again
    after the split, gives the head the embedding's slice."""
    from transformers.distributed import DistributedConfig
    from transformers.integrations.tensor_parallel import apply_tensor_parallelism

    plan = encoder._resolve_parallel_plans(DistributedConfig(tp_size=mesh.size()))[0]
    named = {*dict(encoder.named_parameters()), *dict(encoder.named_modules())}
    apply_tensor_parallelism(encoder, mesh, {name: style for name, style in plan.items() if name in named})
    encoder.tie_weights()  # a tied head split apart from its embedding would hold a second slice
    encoder._tp_size = mesh.size()


def shard_text_encoders(pipe: Any, group: Any, device: torch.device) -> list[str]:
    """Split each of `pipe`'s text encoders that has a tensor-parallel plan over `group`, in place, with
    transformers' own plan and `apply_tensor_parallelism`; the names split. Each rank keeps its slice on
    `device` (an encoder loaded into host memory reaches it one weight at a time, never whole) and the
    full weights are freed. The ranks must hold the same weights: each cuts its slice from its own copy."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = dist.get_world_size(group)
    refusal = sharded_refusal(pipe, ranks)
    if refusal is not None:
        raise NotAvailableError(refusal)
    mesh = DeviceMesh.from_group(group, device.type)
    split = []
    for name in text_encoder_names(pipe):
        encoder = getattr(pipe, name)
        done = getattr(encoder, "_tp_size", None)  # transformers' own mark: split at load or by an earlier apply
        if done is not None and done != ranks:
            raise UserError(
                f'[memory] text_encoder = "sharded": pipe.{name} is split over {done} ranks already; '
                f"load the pipeline again to split it over {ranks}"
            )
        if tp_plan_of(encoder) and done is None:
            split_encoder(encoder, mesh)
            split.append(name)
        encoder.to(device)  # what the plan leaves whole (norms, a vision tower, an encoder without a plan)
    return split
