"""What apply refuses: layouts and states that would give a silently wrong picture, a deadlock or
stacked changes, each in one line that names the fix, before anything is changed where it can be."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from accel.errors import NotAvailableError, UserError
from accel.models.parts import transformers_of

if TYPE_CHECKING:
    from accel.handle import AccelHandle
    from accel.parallel.mesh import Degrees


def refuse_bypassing_attention(transformers: dict[str, Any], degrees: Degrees) -> None:
    """Context parallelism routes torch's SDPA; a diffusers backend that bypasses it would leave each
    rank attending its own shard, a silently wrong image."""
    from accel.parallel.mode import bypassing_backend

    for attr, transformer in transformers.items():
        backend = bypassing_backend(transformer)
        if backend is not None:
            raise NotAvailableError(
                f"[parallel] ulysses {degrees.ulysses} × ring {degrees.ring}: pipe.{attr} uses the diffusers attention "
                f"backend {backend!r}, which bypasses the scaled_dot_product_attention that context parallelism "
                f'routes; call pipe.{attr}.set_attention_backend("native") before accel.apply, or run on one process'
            )


def refuse_another_ranks_gpu(device: Any) -> None:
    """Under a launcher each rank owns `cuda:LOCAL_RANK`; a pipeline left on another GPU would share
    it with that GPU's own rank (duplicate-GPU NCCL errors, or out of memory)."""
    import torch

    from accel.launch.environment import rank_device

    expected = torch.device(rank_device(device.type))
    if device.type != "cuda" or expected.index is None:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index != expected.index:
        raise UserError(
            f"accel.apply: the pipeline is on cuda:{index}, but this rank (LOCAL_RANK {expected.index}) runs on "
            f'{expected}; load it with accel.load_pipeline(..., device="cuda"), which picks the rank\'s GPU, '
            f'or call pipe.to("{expected}") before accel.apply'
        )


def refuse_two_caches(handle: AccelHandle) -> None:
    """diffusers' own cache hooks decide from each rank's shard (ranks then deadlock) and cannot
    share a forward with accel's cache; refused before anything is changed or any collective."""
    recipe = handle.recipe
    enabled = [
        attr for attr, t in transformers_of(handle.pipe, handle.family).items() if getattr(t, "is_cache_enabled", False)
    ]
    asked = [
        name for name, on in (("[cache]", recipe.cache.enabled), ("[parallel]", recipe.parallel.world_size > 1)) if on
    ]
    if enabled and asked:
        raise UserError(
            f"{' and '.join(asked)}: pipe.{enabled[0]} already has diffusers' own cache enabled (enable_cache), which "
            "cannot run beside accel's cache or across parallel ranks (each rank would decide alone); call "
            f"pipe.{enabled[0]}.disable_cache() before accel.apply and use accel's [cache] instead"
        )


def refuse_later_diffusers_cache(handle: AccelHandle) -> None:
    """The same refusal when diffusers' `enable_cache` comes after apply: checked as each transformer
    call starts (a forward pre-hook, before diffusers' own hooks, accel's engines and any block run),
    since its hooks would otherwise stack on accel's and miss the calls accel's cache skipped, or, on a
    transformer under context parallelism, decide per rank."""
    recipe = handle.recipe
    asked = [
        name for name, on in (("[cache]", recipe.cache.enabled), ("[parallel]", recipe.parallel.world_size > 1)) if on
    ]
    if not asked:
        return
    for attr, transformer in transformers_of(handle.pipe, handle.family).items():

        def check(module: Any, args: Any, attr: str = attr, split: bool = attr in handle.parallel) -> None:
            if not getattr(module, "is_cache_enabled", False):
                return
            if split:
                # diffusers' hooks would decide on each rank's shard alone, so ranks would part ways and
                # deadlock in the next collective: every rank refuses here alike, before the first one.
                raise NotAvailableError(
                    f"context parallelism: {type(module).__name__} has diffusers' own cache enabled (enable_cache), "
                    "which decides on each rank's shard alone; call disable_cache() on it and use accel's [cache] "
                    "instead, or run on one process"
                )
            raise UserError(
                f"{' and '.join(asked)}: pipe.{attr}.enable_cache() was called after accel.apply; diffusers' own "
                "cache cannot run beside accel's cache or across parallel ranks; call "
                f"pipe.{attr}.disable_cache(), or remove() accel's handle before enabling it"
            )

        handle._undo.append(transformer.register_forward_pre_hook(check, prepend=True).remove)


def refuse_shared_components(pipe: Any, applied: Mapping[Any, Any]) -> None:
    """A pipeline built from another one's modules (`Pipeline.from_pipe(pipe)`,
    `Pipeline(**pipe.components)`) shares the modules accel changed on the first: accel's changes
    already act for it, and a second set would stack on the same forwards. Refused in one line naming
    the first pipeline, before anything changes."""
    mine = {id(component): name for name, component in _components(pipe).items()}
    for other, handle in list(applied.items()):
        for name, component in _components(other).items():
            if id(component) in mine:
                raise UserError(
                    f"accel.apply: pipe.{mine[id(component)]} is the {name} of a {type(other).__name__} already "
                    f"accelerated by accel.apply (from_pipe and Pipeline(**pipe.components) share modules), so "
                    f"accel's changes already act here; call remove() on that {type(other).__name__}'s handle first, "
                    "or load the pipeline again for a separate one"
                )


def _components(pipe: Any) -> dict[str, Any]:
    """The modules and scheduler of `pipe` that accel may change (tokenizers and plain values aside)."""
    components = getattr(pipe, "components", None) or {}
    chosen = {name: c for name, c in components.items() if isinstance(c, torch.nn.Module) or name.endswith("scheduler")}
    return dict(
        sorted(chosen.items(), key=lambda item: not item[0].startswith("transformer"))
    )  # named first: where accel acts most
