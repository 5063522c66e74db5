"""One ordered, named registry of changes to a single object's methods, never its class.

Every accelerator wraps a method on the instance it was given (`forward`, `prepare_latents`,
`step`). Wrapping by replacing the attribute and restoring the saved one LIFO breaks two ways:
a hook someone installs afterwards (accelerate's `add_hook_to_module`, diffusers' group
offloading) is silently thrown away by the restore, and undoing out of order resurrects stale
wrappers. So, as diffusers' HookRegistry does, each (instance, method) gets ONE dispatcher,
installed once, that calls an ordered chain of named entries; removing an entry only re-links the
chain, and the dispatcher itself leaves only when it is still the outermost attribute.

The chain is composed once per change and cached, so compiled code sees the same callables on
every call (no guard failures, no recompiles).

A deep copy of a wrapped instance (diffusers' diffusion-forcing pipelines copy their scheduler
once per latent frame) is a plain copy: without the dispatchers, which would still call the
original, and without the wrappers' state (caches, process groups); an entry that wants the copy
wrapped too says how with `on_copy`.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import Any

# Layers, innermost first, in the order `accel.apply` installs them (a higher layer wraps a lower
# one on the same method). On a transformer: context parallelism inside the CFG split inside a
# whole-transformer compile; on a block: the compiled forward inside the cache.
PARALLEL = 100  # transformer.forward: context-parallel split / gather
CFG = 200  # transformer.forward: the CFG branches over the mesh's halves
COMPILE = 300  # block or transformer forward: torch.compile of what lies inside
CACHE = 400  # block.forward: First Block Cache
VAE = 500  # vae.decoder.forward: patch-parallel decode
NOISE = 600  # pipe.prepare_latents: every rank the same noise
ENCODE_ON_CPU = 640  # pipe.encode_prompt: the text encoders run in host memory, their outputs moved to the GPU
ENCODE = 650  # pipe.encode_prompt: the layout's first rank encodes, the others receive the embeddings
STEPS = 700  # scheduler.set_timesteps / step: denoising-step events
LORA = 800  # fuse_lora / unfuse_lora, safetensors save_pretrained, fuse_qkv_projections: refused while quantized
CACHE_CALL = 850  # pipe.check_inputs: a call starts; the cache's statistics span it (Wan Animate's segments)
VAE_PLACEMENT = 880  # pipe(...): a rank that does not decode ([memory] vae = "rank0") asks for latents
CALL = 900  # pipe(...): every rank called with the same arguments (outermost: before any collective)

Wrapper = Callable[..., Any]  # wrapper(call_next, *args, **kwargs)

_REGISTRY = "_accel_wrapped"  # instance attribute: {method name: _Chain}
_MISSING = object()
_order = count()


@dataclass(eq=False)
class _Entry:
    name: str
    layer: int
    wrapper: Wrapper
    order: int
    on_copy: Callable[[Any], None] | None = None
    # The callable this entry last wrapped and the link built around it, reused while unchanged.
    inner: Callable[..., Any] | None = None
    link: Callable[..., Any] | None = None


@dataclass(eq=False)
class _Chain:
    """The entries on one (instance, method), and the dispatcher that calls them."""

    saved: Any  # the instance attribute that was there (or _MISSING: the class's shows again)
    innermost: Callable[..., Any]
    entries: list[_Entry] = field(default_factory=list)
    call: Callable[..., Any] = field(init=False)
    dispatch: Callable[..., Any] = field(init=False)

    def __post_init__(self) -> None:
        self.call = self.innermost

    def relink(self) -> None:
        """Compose inner to outer, keeping every link whose inside did not change (stable identities)."""
        current = self.innermost
        for entry in sorted(self.entries, key=lambda e: (e.layer, e.order)):
            if entry.inner is not current or entry.link is None:
                entry.inner, entry.link = current, _link(entry.wrapper, current)
            current = entry.link
        self.call = current


def _link(wrapper: Wrapper, call_next: Callable[..., Any]) -> Callable[..., Any]:
    def linked(*args: Any, **kwargs: Any) -> Any:
        return wrapper(call_next, *args, **kwargs)

    return linked


def wrap(
    obj: Any, method: str, name: str, layer: int, wrapper: Wrapper, on_copy: Callable[[Any], None] | None = None
) -> Callable[[], None]:
    """Run `wrapper(call_next, *args, **kwargs)` around `obj.<method>` at `layer`; returns the undo.

    Undoing in any order leaves the other entries nested by layer. A wrapper someone put on top
    of ours since (`obj.forward = hook(obj.forward)`) keeps working: the dispatcher then stays,
    passing straight through once it has no entries. `on_copy(copy)` runs on each deep copy of
    `obj`, which is otherwise unwrapped."""
    chain = _chain(obj, method)
    if any(entry.name == name for entry in chain.entries):
        raise ValueError(f"{type(obj).__name__}.{method} already has a wrapper named {name!r}")
    entry = _Entry(name, layer, wrapper, next(_order), on_copy)
    chain.entries.append(entry)
    chain.relink()

    def undo() -> None:
        if entry in chain.entries:
            chain.entries.remove(entry)
            chain.relink()
            if not chain.entries:
                _release(obj, method, chain)

    return undo


def wrappers(obj: Any, method: str) -> list[str]:
    """The names of the entries on `obj.<method>`, outermost first."""
    chain = _chains(obj).get(method)
    if chain is None:
        return []
    return [e.name for e in sorted(chain.entries, key=lambda e: (e.layer, e.order), reverse=True)]


def inner_of(obj: Any, method: str, name: str) -> Callable[..., Any]:
    """What the entry `name` on `obj.<method>` wraps now (e.g. to compile it ahead of the first call)."""
    chain = _chains(obj).get(method)
    entry = next((e for e in chain.entries if e.name == name), None) if chain is not None else None
    if entry is None or entry.inner is None:
        raise KeyError(f"{type(obj).__name__}.{method} has no wrapper named {name!r}")
    return entry.inner


def _chains(obj: Any) -> dict[str, _Chain]:
    return vars(obj).get(_REGISTRY, {})


def _chain(obj: Any, method: str) -> _Chain:
    """This method's chain, installing the dispatcher the first time."""
    if _REGISTRY not in vars(obj) and "__deepcopy__" not in vars(obj):
        # copy.deepcopy looks `__deepcopy__` up on the instance: this one alone copies unwrapped.
        vars(obj)["__deepcopy__"] = functools.partial(_unwrapped_copy, obj)
    chains = vars(obj).setdefault(_REGISTRY, {})
    if method in chains:
        return chains[method]
    innermost = getattr(obj, method)
    chain = _Chain(vars(obj).get(method, _MISSING), innermost)

    @functools.wraps(innermost)  # inspect.signature(obj.forward) stays the original's
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        return chain.call(*args, **kwargs)

    chain.dispatch = dispatch
    chains[method] = chain
    setattr(obj, method, dispatch)
    return chain


def _release(obj: Any, method: str, chain: _Chain) -> None:
    """Put back what was there, unless something wrapped the dispatcher since: then it stays,
    passing through, so that wrapper keeps working (and a later `wrap` reuses it)."""
    attributes = vars(obj)
    if attributes.get(method) is not chain.dispatch:
        return
    if chain.saved is _MISSING:
        attributes.pop(method, None)
    else:
        setattr(obj, method, chain.saved)
    chains = attributes.get(_REGISTRY, {})
    chains.pop(method, None)
    if not chains:
        attributes.pop(_REGISTRY, None)
        copier = attributes.get("__deepcopy__")
        if isinstance(copier, functools.partial) and copier.func is _unwrapped_copy:
            del attributes["__deepcopy__"]


def _unwrapped_copy(obj: Any, memo: dict[int, Any]) -> Any:
    """A deep copy of `obj` as it was before any wrapping, then each entry's `on_copy` on it."""
    chains: dict[str, _Chain] = vars(obj).get(_REGISTRY, {})
    state = {key: value for key, value in vars(obj).items() if key not in (_REGISTRY, "__deepcopy__")}
    for method, chain in chains.items():
        if state.get(method) is chain.dispatch:
            if chain.saved is _MISSING:
                del state[method]
            else:
                state[method] = chain.saved
    cls = type(obj)
    cls = next((base for base, routed in _routed.items() if routed is cls), cls)  # wrap_call's subclass: the real one
    duplicate = cls.__new__(cls)
    memo[id(obj)] = duplicate
    state = copy.deepcopy(state, memo)
    setstate = getattr(duplicate, "__setstate__", None)  # nn.Module's fills in what older pickles lack
    if setstate is not None:
        setstate(state)
    else:
        vars(duplicate).update(state)
    for chain in chains.values():
        for entry in sorted(chain.entries, key=lambda e: (e.layer, e.order)):
            if entry.on_copy is not None:
                entry.on_copy(duplicate)
    return duplicate


_routed: dict[type, type] = {}  # pipeline class -> its subclass that calls the instance's __call__


def wrap_call(pipe: Any, name: str, layer: int, wrapper: Callable[..., Any]) -> Callable[[], None]:
    """`accel.hooks.wrap` on `pipe.__call__`, made to run on `pipe(...)` too; returns the undo.

    Python looks `__call__` up on the type, never the instance, so an instance attribute alone is
    ignored by `pipe(...)`. This instance (and no other) gets a subclass of its class, with the same
    name, whose `__call__` calls the instance's own (the registry's dispatcher) when there is one;
    the original class comes back when the last entry on `__call__` leaves."""
    undo = wrap(pipe, "__call__", name, layer, wrapper)  # before the swap: the chain's innermost is the class's
    base = type(pipe)
    if base not in _routed.values():
        pipe.__class__ = _routed_class(base)

    def remove() -> None:
        undo()
        routed = type(pipe)
        if not wrappers(pipe, "__call__") and _routed.get(routed.__base__) is routed:
            pipe.__class__ = routed.__base__

    return remove


def _routed_class(base: type) -> type:
    if base not in _routed:
        call = base.__call__

        @functools.wraps(call)  # inspect.signature(pipe) stays the pipeline's
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            own = vars(self).get("__call__")
            return own(*args, **kwargs) if own is not None else call(self, *args, **kwargs)

        _routed[base] = type(
            base.__name__,
            (base,),
            {
                "__call__": __call__,
                "__module__": base.__module__,
                "__qualname__": base.__qualname__,
                "__doc__": base.__doc__,
            },
        )
    return _routed[base]
