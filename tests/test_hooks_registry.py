"""The per-instance registry of method wrappers (accel.hooks.wrap): nesting by layer whatever the
order of install and removal, exact restoration, hooks installed on top by others (accelerate,
diffusers group offloading, a user's own wrapper) surviving `remove()`, stable callables for
torch.compile, and the pipeline's execution device under offloading."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import FLUX_CALL, generate

import accel
import accel.apply_quant
import accel.models.parts
from accel.hooks import CACHE, CFG, COMPILE, LORA, NOISE, PARALLEL, STEPS, VAE, inner_of, wrap, wrappers
from accel.models.registry import FAMILIES


class Thing:
    def greet(self, name: str, *, punct: str = "!") -> str:
        return f"hi {name}{punct}"


def tag(label: str) -> Callable[..., str]:
    """A wrapper that shows where it ran: label(inner result)."""

    def wrapper(call_next: Callable[..., str], *args: Any, **kwargs: Any) -> str:
        return f"{label}({call_next(*args, **kwargs)})"

    return wrapper


def foreign(method: Callable[..., str]) -> Callable[..., str]:
    """How accelerate and diffusers hook a module: replace the attribute with a closure over it."""

    def hooked(*args: Any, **kwargs: Any) -> str:
        return f"F({method(*args, **kwargs)})"

    return hooked


def test_layers_nest_in_apply_order() -> None:
    # transformer: context parallel inside CFG inside a whole compile; block: compile inside cache.
    assert PARALLEL < CFG < COMPILE < CACHE
    assert len({PARALLEL, CFG, COMPILE, CACHE, VAE, NOISE, STEPS, LORA}) == 8


@pytest.mark.parametrize("install", [("a", "b"), ("b", "a")])
@pytest.mark.parametrize("removal", [("a", "b"), ("b", "a")])
def test_nesting_follows_layers_whatever_the_order(install: tuple[str, str], removal: tuple[str, str]) -> None:
    thing = Thing()
    layers = {"a": 1, "b": 2}
    undo = {name: wrap(thing, "greet", name, layers[name], tag(name.upper())) for name in install}
    assert thing.greet("x", punct="?") == "B(A(hi x?))"
    assert wrappers(thing, "greet") == ["b", "a"]
    first, second = removal
    undo[first]()
    assert thing.greet("x") == f"{second.upper()}(hi x!)"
    undo[second]()
    assert thing.greet("x") == "hi x!"
    assert vars(thing) == {}  # no dispatcher, no registry left behind: the class's method shows again


def test_an_earlier_instance_attribute_is_put_back() -> None:
    thing = Thing()
    own = lambda name, punct="!": f"own {name}"  # noqa: E731
    thing.greet = own  # type: ignore[method-assign]
    undo = wrap(thing, "greet", "a", 1, tag("A"))
    assert thing.greet("x") == "A(own x)"
    undo()
    assert vars(thing) == {"greet": own}


def test_same_layer_wraps_in_install_order_and_undo_is_idempotent() -> None:
    thing = Thing()
    undo_first = wrap(thing, "greet", "first", 1, tag("1"))
    wrap(thing, "greet", "second", 1, tag("2"))
    assert thing.greet("x") == "2(1(hi x!))"
    undo_first()
    undo_first()  # a second call must not take another entry with it
    assert thing.greet("x") == "2(hi x!)"


def test_a_foreign_wrapper_between_two_accelerators_survives_both_removals() -> None:
    thing = Thing()
    undo_outer = wrap(thing, "greet", "outer", 2, tag("O"))
    thing.greet = foreign(thing.greet)  # type: ignore[method-assign]  # e.g. add_hook_to_module
    hooked = thing.greet
    undo_inner = wrap(thing, "greet", "inner", 1, tag("I"))  # installed after: still nests by layer
    assert thing.greet("x") == "F(O(I(hi x!)))"
    undo_outer()
    undo_inner()
    assert thing.greet is hooked and thing.greet("x") == "F(hi x!)"  # the hook is kept and still runs
    # The dispatcher under the hook passes through, and a later wrap reuses it, inside the hook.
    undo_again = wrap(thing, "greet", "again", 3, tag("G"))
    assert thing.greet("x") == "F(G(hi x!))"
    undo_again()
    assert thing.greet("x") == "F(hi x!)"


def test_names_are_unique_per_method() -> None:
    thing = Thing()
    wrap(thing, "greet", "cache", CACHE, tag("C"))
    with pytest.raises(ValueError, match="'cache'"):
        wrap(thing, "greet", "cache", COMPILE, tag("D"))
    wrap(Thing(), "greet", "cache", CACHE, tag("C"))  # another instance: its own registry
    assert thing.greet("x") == "C(hi x!)"


def test_signature_and_name_stay_the_originals() -> None:
    thing = Thing()
    wrap(thing, "greet", "a", 1, tag("A"))
    assert inspect.signature(thing.greet) == inspect.signature(Thing().greet)
    assert thing.greet.__name__ == "greet"
    inspect.signature(thing.greet).bind("x", punct="?")  # what the engines do with it


def test_links_inside_a_changed_entry_keep_their_identity() -> None:
    """Adding or removing an outer entry must not rebuild the inner ones (compiled code keys on them)."""
    thing = Thing()
    wrap(thing, "greet", "inner", 1, tag("I"))
    wrap(thing, "greet", "middle", 2, tag("M"))
    inside_middle = inner_of(thing, "greet", "middle")
    undo_outer = wrap(thing, "greet", "outer", 3, tag("O"))
    assert inner_of(thing, "greet", "middle") is inside_middle
    undo_outer()
    assert inner_of(thing, "greet", "middle") is inside_middle
    undo_below = wrap(thing, "greet", "below", 0, tag("B"))  # a change inside it: a new link
    assert inner_of(thing, "greet", "middle") is not inside_middle
    undo_below()
    assert thing.greet("x") == "M(I(hi x!))"


def test_compiled_inner_callable_does_not_recompile_when_outer_entries_change() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    module = torch.nn.Linear(4, 4)
    compiled: dict[Any, Any] = {}

    def compile_inner(call_next: Callable[..., Any], *args: Any) -> Any:
        fn = compiled.setdefault(call_next, torch.compile(call_next, backend="eager"))
        return fn(*args)

    wrap(module, "forward", "compile", COMPILE, compile_inner)
    x = torch.randn(2, 4)
    expected = torch.nn.functional.linear(x, module.weight, module.bias)
    module(x)
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        undo = wrap(module, "forward", "cache", CACHE, lambda call_next, *a: call_next(*a) * 2)
        assert torch.equal(module(x), expected * 2)
        undo()
        assert torch.equal(module(x), expected)
    assert counters["stats"]["unique_graphs"] == graphs and len(compiled) == 1


def test_dispatcher_keeps_torch_hooks_and_module_call_working() -> None:
    module = torch.nn.Linear(4, 4)
    seen: list[str] = []
    module.register_forward_pre_hook(lambda *_: seen.append("pre"))
    undo = wrap(module, "forward", "double", CACHE, lambda call_next, x: call_next(x) * 2)
    x = torch.randn(1, 4)
    assert torch.equal(module(x), 2 * torch.nn.functional.linear(x, module.weight, module.bias))
    undo()
    assert seen == ["pre"] and "forward" not in vars(module)


# -- real pipelines: other libraries' hooks installed after accel.apply ------------------------------------


def _fresh_flux() -> Any:
    pipe = accel.load_pipeline("tiny-flux")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _blocks(pipe: Any) -> list[torch.nn.Module]:
    return [block for spec in FAMILIES["flux"].blocks for block in getattr(pipe.transformer, spec.attr)]


CACHE_EVERYTHING = {"cache": {"threshold": 1e9, "warmup_steps": 2}}


def _offload_to_disk(pipe: Any, folder: Path) -> None:
    pipe.transformer.enable_group_offload(
        onload_device=torch.device("cpu"),
        offload_device=torch.device("cpu"),
        offload_type="block_level",
        num_blocks_per_group=1,
        offload_to_disk_path=str(folder),
    )


def test_group_offloading_installed_after_apply_survives_remove(tmp_path: Path) -> None:
    """diffusers' block-level group offloading to disk replaces every block's weights with empty
    tensors and loads them back in the block's hook; a remove() that dropped the hooks would leave
    the blocks computing with garbage. (Weights reloaded from disk round the last bit differently
    from the fixture's, so the reference is a plain pipeline offloaded alike.)"""
    plain = _fresh_flux()
    _offload_to_disk(plain, tmp_path / "plain")
    reference = generate(plain, FLUX_CALL)
    pipe = _fresh_flux()
    handle = accel.apply(pipe, CACHE_EVERYTHING)
    _offload_to_disk(pipe, tmp_path / "accel")
    generate(pipe, FLUX_CALL)
    stats = handle.cache_stats
    assert stats is not None and stats.cached > 0  # accel's cache ran inside the offload hooks
    handle.remove()
    for block in _blocks(pipe):
        assert block._diffusers_hook.get_hook("group_offloading") is not None
        assert wrappers(block, "forward") == []
    np.testing.assert_array_equal(generate(pipe, FLUX_CALL), reference)


def test_accelerate_offload_hooks_installed_after_apply_survive_remove(flux_reference: np.ndarray) -> None:
    """accelerate's `cpu_offload`, its blocks preloaded whole: each block's weights move to the meta
    device and its `add_hook_to_module` hook loads them per call. (diffusers' enable_model_cpu_offload
    hooks the transformer as a whole, which the cache leaves alone; this hooks the very blocks the
    cache wraps.)"""
    from accelerate import cpu_offload

    pipe = _fresh_flux()
    handle = accel.apply(pipe, CACHE_EVERYTHING)
    classes = sorted({type(block).__name__ for block in _blocks(pipe)})
    cpu_offload(pipe.transformer, execution_device=torch.device("cpu"), preload_module_classes=classes)
    assert all(next(block.parameters()).device.type == "meta" for block in _blocks(pipe))
    cached = generate(pipe, FLUX_CALL)
    assert handle.cache_stats is not None and handle.cache_stats.cached > 0
    handle.remove()
    assert all(hasattr(block, "_hf_hook") and "forward" in vars(block) for block in _blocks(pipe))
    output = generate(pipe, FLUX_CALL)
    np.testing.assert_array_equal(output, flux_reference)
    assert not np.array_equal(cached, output)


def test_apply_uses_the_execution_device_under_model_cpu_offload(monkeypatch: pytest.MonkeyPatch) -> None:
    """enable_model_cpu_offload(device="cpu") works without an accelerator: the hooks' execution
    device is cpu:0 while the weights report cpu, which tells the two sources apart."""
    pipe = _fresh_flux()
    pipe.enable_model_cpu_offload(device="cpu")
    assert pipe._execution_device == torch.device("cpu", 0) != next(pipe.transformer.parameters()).device
    assert accel.models.parts.execution_device(pipe, pipe.transformer) == torch.device("cpu", 0)
    checked: list[torch.device] = []
    monkeypatch.setattr(accel.apply_quant, "check_hardware", lambda _type, device, _dtype: checked.append(device))
    handle = accel.apply(pipe, {"quant": {"type": "int8wo"}, "cache": {"threshold": 1e9, "warmup_steps": 2}})
    assert checked == [torch.device("cpu", 0)]
    generate(pipe, FLUX_CALL)
    handle.remove()
    assert hasattr(pipe.transformer, "_hf_hook") and pipe._execution_device == torch.device("cpu", 0)


def test_execution_device_falls_back_to_the_first_parameter() -> None:
    module = torch.nn.Linear(2, 2)
    assert accel.models.parts.execution_device(object(), module) == torch.device("cpu")


def test_a_deep_copy_is_unwrapped_unless_an_entry_wraps_it_again() -> None:
    """Diffusion-forcing pipelines deep-copy their scheduler per latent frame: a copy must call its
    own method (not the original's through the copied dispatcher) and carry none of the wrappers'
    state; an entry's `on_copy` may wrap the copy again. After the last undo nothing is left."""
    import copy

    thing, copies = Thing(), []
    before = dict(vars(thing))
    undo_a = wrap(thing, "greet", "a", CACHE, tag("a"))
    undo_b = wrap(thing, "greet", "b", STEPS, tag("b"), on_copy=lambda duplicate: copies.append(duplicate))
    duplicate = copy.deepcopy(thing)
    assert thing.greet("x") == "b(a(hi x!))"
    assert duplicate.greet("x") == "hi x!" and wrappers(duplicate, "greet") == []
    assert copies == [duplicate]
    undo_a()
    undo_b()
    assert vars(thing) == before
    assert copy.deepcopy(thing).greet("y") == "hi y!"
