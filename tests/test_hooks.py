"""The one mechanism every accelerator uses to change a pipeline: per-instance method wrappers.
(Ordering, foreign hooks and real pipelines: test_hooks_registry.py.)"""

from __future__ import annotations

from typing import Any

from accel.hooks import wrap, wrappers


class Thing:
    def greet(self) -> str:
        return "class"


def test_wrap_changes_only_this_instance_and_undo_shows_the_class_again() -> None:
    thing, other = Thing(), Thing()
    method = vars(Thing)["greet"]
    undo = wrap(thing, "greet", "loud", 1, lambda call_next: call_next().upper())
    assert thing.greet() == "CLASS" and other.greet() == "class"
    assert vars(Thing)["greet"] is method  # the class is never touched
    undo()
    assert thing.greet() == "class" and vars(thing) == {}


def test_lifo_undo_steps_back_through_the_layers() -> None:
    thing = Thing()
    calls: list[str] = []

    def note(label: str) -> Any:
        def wrapper(call_next: Any) -> str:
            calls.append(label)
            return call_next()

        return wrapper

    undo_inner = wrap(thing, "greet", "inner", 1, note("inner"))
    undo_outer = wrap(thing, "greet", "outer", 2, note("outer"))
    assert thing.greet() == "class" and calls == ["outer", "inner"]
    undo_outer()
    assert wrappers(thing, "greet") == ["inner"]
    undo_inner()
    assert wrappers(thing, "greet") == [] and vars(thing) == {}
