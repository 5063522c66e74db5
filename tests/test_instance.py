"""The one mechanism every accelerator uses to change a pipeline: per-instance overrides."""

from __future__ import annotations

from accel.instance import override


class Thing:
    def greet(self) -> str:
        return "class"


def test_override_shadows_only_this_instance_and_undo_shows_the_class_again() -> None:
    thing, other = Thing(), Thing()
    undo = override(thing, "greet", lambda: "instance")
    assert thing.greet() == "instance" and other.greet() == "class"
    undo()
    assert thing.greet() == "class" and "greet" not in thing.__dict__


def test_nested_overrides_undo_to_the_earlier_instance_attribute() -> None:
    thing = Thing()
    undo_outer = override(thing, "greet", lambda: "outer")
    undo_inner = override(thing, "greet", lambda: "inner")
    assert thing.greet() == "inner"
    undo_inner()
    assert thing.greet() == "outer"
    undo_outer()
    assert thing.greet() == "class" and "greet" not in thing.__dict__
