"""Per-rank GPU memory of a layout, measured before any weight is read.

Every component is built from its config on the meta device to count its weights exactly (after the
TP split where the layout splits it); the transformer's forward and the VAE's decode run on fake
`cuda` at the requested size under the tracker (accel/memory/tracker.py) to measure the working
memory they add. The transformer is cut to one block of each kind for that: under no_grad a block's
activations are freed before the next block runs, so the working peak does not grow with depth.
Attention runs through accel's own kernels (flash-style: no L x L matrix), as on a real GPU.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from accel.errors import UserError
from accel.memory.tracker import tracked_peak
from accel.models.base import Family
from accel.parallel.plan_format import AutomaticPlan
from accel.models.flagships import Component, Flagship, Size
from accel.optimize.processors import install_processors
from accel.parallel.mesh import Degrees
from accel.recipe.sections import QuantSection
from accel.vae.masks import fill_masks_by_frame

DTYPE = torch.bfloat16
# Config keys that set a transformer's depth: one block of each kind measures its working peak.
DEPTH_KEYS = (
    "num_layers",
    "num_single_layers",
    "num_refiner_layers",
    "n_layers",
    "n_refiner_layers",
    "num_text_blocks",
    "num_visual_blocks",
)


@dataclass(frozen=True)
class RankEstimate:
    """What the busiest rank (rank 0) of a layout holds: weights per component, and the working memory
    of the largest phase on top of them."""

    weights: dict[str, int]
    working: dict[str, int] = field(default_factory=dict)  # phase ("transformer forward", "VAE decode") → bytes

    @property
    def peak(self) -> int:
        return sum(self.weights.values()) + max(self.working.values(), default=0)

    @property
    def largest_phase(self) -> str | None:
        return max(self.working, key=lambda phase: self.working[phase]) if self.working else None


@contextmanager
def _built_as(device: str) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build(component: Component, device: str = "meta", config: dict[str, Any] | None = None) -> nn.Module:
    """`component` from its config in bfloat16 on `device` ("meta": no memory; "cuda" inside a fake mode)."""
    config = dict(component.config if config is None else config)
    with _built_as(device):
        if component.library == "diffusers":
            import diffusers

            return getattr(diffusers, component.cls).from_config(config).eval()
        import transformers

        made = transformers.AutoConfig.for_model(component.model_type, **config)
        return getattr(transformers, component.cls)._from_config(made, dtype=DTYPE).eval()


def weight_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


# How torchao stores a quantized Linear weight of shape (rows, columns): bits per weight, bytes per
# row (scales, zero points), bytes per group of INT4_GROUP columns in a row (int4's scale and zero).
QUANT_STORAGE = {"int8wo": (8, 5, 0), "int8dq": (8, 5, 0), "fp8wo": (8, 4, 0), "fp8dq": (8, 4, 0), "int4wo": (4, 0, 4)}


def quantized_bytes(scheme: str, shape: tuple[int, ...] | list[int]) -> int:
    from accel.optimize.quantize import INT4_GROUP

    bits, per_row, per_group = QUANT_STORAGE[scheme]
    rows, columns = shape
    return rows * columns * bits // 8 + rows * per_row + rows * (columns // INT4_GROUP) * per_group


def parameter_bytes(family: Family, model: nn.Module, tp: int = 1, quant: QuantSection | None = None) -> dict[str, int]:
    """Each parameter's and buffer's bytes on one rank (`model` built on meta): each split parameter cut
    to its 1/tp slice (what the split loader reads of it, accel/models/split_load.py), and each Linear
    weight [quant] chooses stored as torchao stores it (the split comes first, then the shards quantize)."""
    slices: dict[str, tuple[int, tuple[int, ...]]] = {}
    if tp > 1:
        from accel.parallel.tensor import planned_layers, resolve_tensor_plan, slices_of

        assert family.tensor is not None
        plan = resolve_tensor_plan(family.tensor, model)
        slices = slices_of(model, plan, planned_layers(model, plan))
    quantized: set[str] = set()
    if quant is not None and quant.type != "none":
        from accel.optimize.quantize import chosen_layers

        quantized = set(chosen_layers(model, quant.type, family.blocks, quant.scope, quant.exclude)[0])
    sizes = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        shape = list(tensor.shape)
        if name in slices:
            shape[slices[name][0]] //= tp
        layer, _, leaf = name.rpartition(".")
        if leaf == "weight" and layer in quantized:
            sizes[name] = quantized_bytes(quant.type, shape)  # type: ignore[union-attr]
        else:
            sizes[name] = math.prod(shape) * tensor.element_size()
    return sizes


def transformer_weights(family: Family, model: nn.Module, tp: int, quant: QuantSection | None = None) -> int:
    """The transformer's bytes on one rank (parameter_bytes, summed)."""
    return sum(parameter_bytes(family, model, tp, quant).values())


def tp_problem(family: Family, model: nn.Module, tp: int) -> str | None:
    """Why `tp` cannot split this transformer (`model` built on meta; None: it can)."""
    if tp == 1:
        return None
    if family.tensor is None:
        return f"{family.title} has no tensor-parallel plan"
    from accel.parallel.tensor import resolve_tensor_plan, width_problem

    return width_problem(model, resolve_tensor_plan(family.tensor, model), tp, family.title)


def cut_config(component: Component) -> dict[str, Any]:
    import diffusers

    accepted = set(inspect.signature(getattr(diffusers, component.cls).__init__).parameters)
    return {**component.config, **{key: 1 for key in DEPTH_KEYS if key in accepted}}


def _on_device(inputs: Any, device: str) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs.to(device, DTYPE if inputs.is_floating_point() else inputs.dtype)
    if isinstance(inputs, dict):
        return {key: _on_device(value, device) for key, value in inputs.items()}
    if isinstance(inputs, (list, tuple)):  # Z-Image takes its latents and prompts as lists
        return type(inputs)(_on_device(value, device) for value in inputs)
    return inputs


_SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _FusedAttention(TorchFunctionMode):
    """torch's SDPA on fake `cuda` tensors, on a machine without a GPU, falls back to the math kernel
    and its full score matrix (Wan 14B's cross-attention at 720p: 10 GiB that no GPU allocates); a GPU
    runs a fused kernel. Under this mode SDPA calls go to accel's kernel choice, as on the GPU."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = dict(zip(_SDPA_ARGUMENTS, args)) | kwargs
        query, key, value, mask = call["query"], call["key"], call["value"], call.get("attn_mask")
        if call.get("is_causal") or call.get("enable_gqa") or query.dim() != 4 or key.shape[-3] != query.shape[-3]:
            return func(*args, **kwargs)
        from accel.parallel.kernels import attention_with_lse

        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))
        return attention_with_lse(query, key, value, mask, call.get("scale"))[0]


# Tensors up to this many elements carry their values under the fake mode (masks, flags, zero inputs).
KNOWN_NUMEL = 1 << 20
_INDEXING = ("aten::index.Tensor", "aten::index_put", "aten::index_put_")


def _tensors_in(values: tuple[Any, ...] | list[Any]) -> list[torch.Tensor]:
    """The tensors among an op's arguments or results, in lists at any depth (`cat`, `index`, c10d's)."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found += _tensors_in(value)
    return found


class KnownValues(TorchDispatchMode):
    """Fake tensors have shapes, not values, so an op whose output shape or Python result depends on
    values cannot run on them: HunyuanVideo 1.5's forward gathers its text tokens with boolean masks
    (`text[mask]`) and branches on `torch.all(image_embeds == 0)`. A shape environment would make the
    gathers' lengths symbols, but cannot take the branch, and leaves the tracker sums of unknowns.
    Instead every small tensor made from known values (factories like `ones`, and ops on known
    tensors) keeps a real CPU twin, and an op the fake mode cannot answer runs on the twins: its
    result is the one a GPU gets from the same inputs. Large or random tensors stay unknown; a value
    written from unknown data is forgotten, so a later data-dependent op fails rather than guesses."""

    def __init__(self) -> None:
        super().__init__()
        self.values: Any = WeakTensorKeyDictionary()
        self.storages: set[int] = set()  # of tensors with values (or once had): who may need forgetting

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        tensors = _tensors_in((*args, *kwargs.values()))
        # Real tensors are `torch.tensor`'s data; only torch's own ops run on twins (not collectives).
        known = func.namespace == "aten" and all(t in self.values or not isinstance(t, FakeTensor) for t in tensors)
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            if tensors and known:  # `nonzero`, `item`, `x[mask]` on known tensors: from the twins
                return tree_map(lambda value: self._fake_of(value, tensors[0].device), self._real(func, args, kwargs))
            if func.name() in _INDEXING and any(self._known_mask(index) for index in args[1]):
                # `x[mask]` with a known mask: gather at the mask's positions
                positions = [p for index in args[1] for p in self._positions(index)]
                return self.__torch_dispatch__(func, types, (args[0], positions, *args[2:]), kwargs)
            raise
        results = _tensors_in(out if isinstance(out, (tuple, list)) else (out,))
        if (
            known
            and torch.Tag.nondeterministic_seeded not in func.tags
            and not func.name().startswith("aten::empty")
            and all(t.numel() <= KNOWN_NUMEL for t in tensors + results)
        ):
            for fake, value in zip(tree_flatten(out)[0], tree_flatten(self._real(func, args, kwargs))[0]):
                if isinstance(fake, torch.Tensor) and isinstance(value, torch.Tensor):
                    self._remember(fake, value)
        elif func._schema.is_mutable:
            named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
            for argument in func._schema.arguments:
                written = named.get(argument.name)
                if (
                    argument.alias_info is not None
                    and argument.alias_info.is_write
                    and isinstance(written, torch.Tensor)
                ):
                    self._forget(written)
        return out

    def _real(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """`func` on the CPU twins of its tensors (devices mapped to the CPU), outside the fake mode."""

        def twin(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return self.values[x] if isinstance(x, FakeTensor) else x
            return torch.device("cpu") if isinstance(x, torch.device) else x

        real_args, real_kwargs = tree_map(twin, (args, kwargs))
        with unset_fake_temporarily():
            return func(*real_args, **real_kwargs)

    def _fake_of(self, value: Any, device: torch.device) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
        self._remember(fake, value)
        return fake

    def _remember(self, fake: torch.Tensor, value: torch.Tensor) -> None:
        self.values[fake] = value
        self.storages.add(fake.untyped_storage()._cdata)

    def _known_mask(self, index: Any) -> bool:
        return isinstance(index, FakeTensor) and index.dtype in (torch.bool, torch.uint8) and index in self.values

    def _positions(self, index: Any) -> list[Any]:
        """A known boolean index as the integer positions it selects (one tensor per dimension it covers)."""
        if not self._known_mask(index):
            return [index]
        with unset_fake_temporarily():
            positions = [p.contiguous() for p in self.values[index].nonzero().unbind(1)]
        return [self._fake_of(p, index.device) for p in positions]

    def _forget(self, written: torch.Tensor) -> None:
        """Drop the twins of `written` and of every view that shares its storage."""
        storage = written.untyped_storage()._cdata
        if storage not in self.storages:
            return
        for tensor in [t for t in self.values.keys() if t.untyped_storage()._cdata == storage]:
            del self.values[tensor]


@contextmanager
def _fake_or_real(device: str, fake: bool = True) -> Iterator[None]:
    """Fake tensors for "cuda" (no GPU needed, no memory used); real ones for "cpu", or for "cuda"
    with `fake` off (the checks against a real run). Small known tensors keep their values (KnownValues)."""
    if device != "cuda" or not fake:
        yield
        return
    if not torch.backends.cuda.is_built():  # a CPU-only build cannot index a tensor on `cuda`, fake or not
        raise UserError(
            f"accel's memory plan measures on fake CUDA, which needs torch's CUDA build (PyPI's default "
            f"wheel; no GPU needed): torch {torch.__version__} is CPU-only"
        )
    with FakeTensorMode(allow_non_fake_inputs=False), KnownValues(), _FusedAttention():
        yield


def _tracked_device(device: str) -> str:
    """The tracker's name for the device the work runs on (it names CUDA devices with their index)."""
    return "cuda:0" if device == "cuda" else device


def transformer_working(
    family: Family, flagship: Flagship, size: Size, degrees: Degrees, device: str = "cuda", fake: bool = True
) -> int:
    """Bytes the transformer's forward adds on rank 0 of `degrees` (its sequence and TP degrees; CFG
    ranks each run one half, which is the one-process call). `device` "cpu" runs it for real."""
    from accel.parallel.mesh import build_mesh
    from accel.parallel.engine import ContextParallel
    from accel.parallel.plan import resolve_plan
    from accel.parallel.tensor import TensorParallel, resolve_tensor_plan

    inner = Degrees(ulysses=degrees.ulysses, ring=degrees.ring, tp=degrees.tp)
    component = flagship.of_kind("transformer")[0]
    with _fake_world(inner.world_size):
        mesh = build_mesh(inner, device)
        assert mesh is not None
        with _fake_or_real(device, fake):
            model = build(component, device, cut_config(component))
            install_processors(model, family)  # as every apply does
            if inner.tp > 1:
                assert family.tensor is not None
                TensorParallel(model, resolve_tensor_plan(family.tensor, model), mesh.tp_group)
            assert family.parallel is not None
            if not isinstance(
                family.parallel, AutomaticPlan
            ):  # learned from a probe call, which a flagship has none of
                ContextParallel(
                    model, resolve_plan(family.parallel, model), mesh
                )  # accel's attention kernels, at any degree
            with torch.device(device):
                inputs = _on_device(flagship.inputs(size), device)
            peak = tracked_peak(lambda: model(**inputs), model, device=_tracked_device(device))
    return peak.working if peak is not None else 0


@contextmanager
def _fake_world(ranks: int) -> Iterator[None]:
    """A `fake` process group of `ranks` for this process as rank 0, unless one is already there."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    was_initialized = dist.is_initialized()
    excepthook = sys.excepthook  # init_process_group prefixes it with "[rank0]:" for good, once per group made
    if not was_initialized:
        dist.init_process_group("fake", rank=0, world_size=ranks, store=FakeStore())
    try:
        yield
    finally:
        if not was_initialized:
            dist.destroy_process_group()
            sys.excepthook = excepthook


def sharded_encoder_bytes(component: Component, ranks: int) -> int | None:
    """One rank's bytes of a text encoder that [memory] text_encoder = "sharded" splits over `ranks`
    with transformers' plan, split on meta by the same code as a run; None where it stays whole (no
    plan) or the split is refused (heads the ranks do not divide, accel/parallel/encoders.py)."""
    from torch.distributed.device_mesh import DeviceMesh

    from accel.parallel.encoders import heads_problem, local_bytes, split_encoder, tp_plan_of

    encoder = build(component)
    if not tp_plan_of(encoder) or heads_problem(encoder, ranks) is not None:
        return None
    with _fake_world(ranks):
        split_encoder(encoder, DeviceMesh("cpu", list(range(ranks))))
    return local_bytes(encoder) + sum(t.numel() * t.element_size() for t in encoder.buffers())


def vae_working(
    flagship: Flagship, size: Size, device: str = "cuda", fake: bool = True, tiling: bool = False, ranks: int = 1
) -> int:
    """Bytes the VAE's decode of one output adds on rank 0 (`tiling`: diffusers' tiled decode, [vae]
    tiling; `ranks` > 1: accel's row-split decode over that many ranks, [vae] parallel, on a `fake`
    process group); "cpu" runs it for real."""
    component = flagship.of_kind("vae")[0]
    with _fake_world(ranks) if ranks > 1 else nullcontext(), _fake_or_real(device, fake):
        vae = build(component, device)
        fill_masks_by_frame(vae)  # as every run decodes
        if tiling:
            vae.enable_tiling()
        if ranks > 1:
            from accel.vae.decode import ParallelDecode, plan_for

            ParallelDecode(vae, plan_for(vae))
        latents = torch.randn(*flagship.latents(size), device=device, dtype=DTYPE)
        # LTX-Video 0.9.5+ decoders are conditioned on the decode timestep, which the pipeline passes.
        conditioned = getattr(vae.config, "timestep_conditioning", False)
        timestep = {"temb": torch.full((latents.shape[0],), 0.05, device=device, dtype=DTYPE)} if conditioned else {}
        peak = tracked_peak(
            lambda: vae.decode(latents, return_dict=False, **timestep), vae, device=_tracked_device(device)
        )
    return peak.working if peak is not None else 0


def _block_lists(model: nn.Module) -> dict[str, nn.Module]:
    """The model's repeated blocks: its ModuleList / Sequential children (what group offload streams)."""
    return {name: child for name, child in model.named_children() if isinstance(child, (nn.ModuleList, nn.Sequential))}


def offload_groups(model: nn.Module, sizes: dict[str, int] | None = None) -> tuple[int, int]:
    """(bytes outside the repeated blocks, bytes of the largest block) of `model` built on meta, each
    tensor counted as `sizes` says (default: as built): what diffusers' block-level group offload holds
    on the GPU besides one block being streamed in."""
    if sizes is None:
        sizes = {name: t.numel() * t.element_size() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    lists, blocks = _block_lists(model), {}
    for name, size in sizes.items():
        head, _, rest = name.partition(".")
        if head in lists:
            index = rest.partition(".")[0]
            blocks[f"{head}.{index}"] = blocks.get(f"{head}.{index}", 0) + size
    return sum(sizes.values()) - sum(blocks.values()), max(blocks.values(), default=0)


def transformer_flops(flagship: Flagship, size: Size) -> int:
    """Floating-point operations of one whole transformer call at `size` on one GPU. torch's
    FlopCounterMode counts the cut model's forward on fake `cuda` (attention through accel's kernels);
    each repeated block list's per-block count is then scaled to the list's full depth."""
    from torch.utils.flop_counter import FlopCounterMode

    component = flagship.of_kind("transformer")[0]
    full = _block_lists(build(component))
    with _fake_or_real("cuda"):
        model = build(component, "cuda", cut_config(component))
        with torch.device("cuda"):
            inputs = _on_device(flagship.inputs(size), "cuda")
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(**inputs)
    counts, root = counter.get_flop_counts(), type(model).__name__
    total = counter.get_total_flops()
    for name, cut in _block_lists(model).items():
        per_block = sum(sum(counts.get(f"{root}.{name}.{index}", {}).values()) for index in range(len(cut))) / max(
            len(cut), 1
        )
        total += (len(full[name]) - len(cut)) * per_block
    return int(total)
