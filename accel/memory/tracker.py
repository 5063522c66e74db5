"""Peak memory of a piece of work, on real tensors or on fake `cuda` ones, through torch's own tracker.

torch.distributed._tools.mem_tracker.MemTracker follows every storage a block of work allocates and
frees (parameters, buffers, activations, temporaries) per device, and works under FakeTensorMode, so
the same measure gives the peak of a real CPU run and of a real-width model on a GPU that is not
there. It is a private module: this is the one place accel touches it. Where it is missing or its
interface moved, `tracked_peak` returns None and callers fall back to the weights they can count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Peak:
    """Bytes at the moment of highest use on one device: the modules' parameters and buffers, and the rest."""

    device: str
    total: int
    weights: int

    @property
    def working(self) -> int:
        """What the work itself held at its peak beyond the weights (activations, temporaries, workspaces)."""
        return self.total - self.weights


class _Root(torch.nn.Module):
    """The work as one module call: the tracker refuses a top-level module called twice (a video VAE
    calls its decoder once per latent frame), but counts repeated calls inside one root."""

    def __init__(self, work: Callable[[], Any]) -> None:
        super().__init__()
        self.work = work

    def forward(self) -> Any:
        return self.work()


def _tracker_class() -> type | None:
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError:
        return None
    needed = ("track_external", "get_tracker_snapshot", "__enter__", "__exit__")
    return MemTracker if all(hasattr(MemTracker, name) for name in needed) else None


def _device_peaks_only(tracker: Any) -> None:
    """The tracker also keeps each module's own peak, walking every module it has seen on every op:
    most of a video VAE's measure (thousands of ops, hundreds of modules). accel reads the device
    peaks only, so this tracker instance updates just those; where the internals moved it keeps its own."""
    if not all(
        hasattr(tracker, name) for name in ("_update_peak_stats", "_curr_mem_snap", "_peak_mem", "_peak_mem_snap")
    ):
        return

    def update_device_peaks(peak_state: Any) -> None:
        for device, snapshot in tracker._curr_mem_snap.items():
            if tracker._peak_mem.get(device, 0) < snapshot["Total"]:
                tracker._peak_mem[device] = snapshot["Total"]
                tracker._peak_mem_snap[device] = dict(snapshot)

    tracker._update_peak_stats = update_device_peaks


def tracked_peak(work: Callable[[], Any], *modules: torch.nn.Module, device: str | None = None) -> Peak | None:
    """Run `work` under the tracker and return the peak on `device` (default: the device that peaked
    highest); None when this torch has no usable tracker. Gradients are off: this is inference."""
    tracker_class = _tracker_class()
    if tracker_class is None:
        return None
    tracker = tracker_class()
    _device_peaks_only(tracker)
    # The tracker hooks every parameter's gradient, which a frozen one refuses (the TP split's are):
    # they want gradients for the measure's duration only, and no_grad keeps any from being made.
    frozen = [p for module in modules for p in module.parameters() if not p.requires_grad]
    for parameter in frozen:
        parameter.requires_grad_(True)
    try:
        if modules:
            tracker.track_external(*modules)
        with tracker, torch.no_grad():
            _Root(work)()
        snapshot = tracker.get_tracker_snapshot("peak")
    except (AttributeError, TypeError):  # the private interface moved under us: count weights instead
        return None
    finally:
        for parameter in frozen:
            parameter.requires_grad_(False)
    per_device = {str(where): counts for where, counts in snapshot.items()}
    if not per_device:
        return Peak(device or "cpu", 0, 0)
    where = device if device is not None else max(per_device, key=lambda name: per_device[name].get("Total", 0))
    counts = per_device.get(where, {})
    weights = sum(value for key, value in counts.items() if str(key).endswith(("PARAM", "BUFFER")))
    return Peak(where, int(counts.get("Total", 0)), int(weights))
