"""What a cached call adds in place of the blocks it skips: the last computed residual, or an
extrapolation of the last few (TaylorSeer).

A calibrator sees the skipped blocks' residual at every computed call of one branch, with the
step it was computed at, and is asked for a residual at a later step. It works per stream (image
and text) and per branch, so cond and uncond calls never mix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from torch import Tensor

Residuals = Mapping[str, Tensor]


class Calibrator(Protocol):
    def record(self, step: int, residuals: Residuals) -> None:
        """The skipped blocks' residual, computed at `step`."""

    def predict(self, step: int) -> Residuals:
        """The residual to add on a cached call at `step` (empty before any computed call)."""


class Reuse:
    """First Block Cache's and DBCache's plain rule: add the last computed residual unchanged."""

    def __init__(self) -> None:
        self._last: Residuals = {}

    def record(self, step: int, residuals: Residuals) -> None:
        self._last = residuals

    def predict(self, step: int) -> Residuals:
        return self._last


class TaylorSeer:
    """Extrapolate the residual to the cached step from the last `order + 1` computed ones.

    Newton's divided differences over the steps they were computed at (not assumed evenly spaced:
    cached calls leave gaps), so a residual that is a polynomial of degree `order` in the step is
    reproduced exactly. With fewer computed calls than that, the order drops to what they allow
    (one call: plain reuse)."""

    def __init__(self, order: int) -> None:
        if order not in (1, 2):
            raise ValueError(f"taylor_order must be 1 or 2, got {order}")
        self.order = order
        self._history: list[tuple[int, Residuals]] = []

    @property
    def computed(self) -> int:
        """How many computed values it extrapolates from (at most order + 1)."""
        return len(self._history)

    def record(self, step: int, residuals: Residuals) -> None:
        if self._history and self._history[-1][0] == step:  # a recomputation of the same step replaces it
            self._history.pop()
        self._history = [*self._history, (step, residuals)][-(self.order + 1) :]

    def predict(self, step: int) -> Residuals:
        if not self._history:
            return {}
        steps = [float(s) for s, _ in self._history]
        return {
            name: _newton(steps, [residuals[name] for _, residuals in self._history], float(step))
            for name in self._history[-1][1]
            if all(name in residuals for _, residuals in self._history)
        }


def _newton(steps: list[float], values: list[Tensor], at: float) -> Tensor:
    """The polynomial through (steps[i], values[i]) evaluated at `at`, in Newton's form, built
    from the newest point back so that one point is the newest value itself."""
    steps, values = steps[::-1], values[::-1]
    table = list(values)
    coefficients = [table[0]]
    for level in range(1, len(values)):
        table = [(table[i] - table[i + 1]) / (steps[i] - steps[i + level]) for i in range(len(table) - 1)]
        coefficients.append(table[0])
    result, product = coefficients[0], 1.0
    for level in range(1, len(coefficients)):
        product *= at - steps[level - 1]
        result = result + coefficients[level] * product
    return result
