"""The fake-CUDA harness: one CPU process plays rank r of N on `cuda` tensors that hold no data.

No GPU exists where the suite runs, yet the GPU-only code paths (the flash / efficient / cuDNN
kernels, NCCL-style collectives on device tensors, device placement of masks) are where the bugs
a CPU run cannot see live. Three torch pieces make them checkable on the CPU:

- `FakeTensorMode`: tensors carry shape, dtype and device but no data, and every op runs its meta
  kernel, so a `cuda` tensor needs no GPU, a real-width model costs nothing, and an op that mixes
  a CPU and a CUDA tensor raises exactly as on a GPU.
- the `fake` process group: collectives return at once with shapes intact, so one process is any
  rank of any world size.
- `Probe`, a dispatch mode under which the transformer runs: it records each host synchronisation
  (the GPU would stall there), each attention kernel and each collective's tensor devices. Fake
  tensors cannot produce a value, so a scalar read gets a scripted answer and the code goes on.
"""

from __future__ import annotations

import functools
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from accel.memory.fake_cuda import KnownValues
from accel.parallel.mesh import Degrees, ParallelMesh, build_mesh

DTYPE = torch.bfloat16
aten = torch.ops.aten
# Fake `cuda` tensors need torch's CUDA build (PyPI's default Linux wheel), not a GPU: a CPU-only build
# ("+cpu") raises "PyTorch is not linked with support for cuda devices" at a fake tensor's first index
# (`x[:, None]`, in C++ indexing) and at `uniform_` (every nn.Linear's init), seen on 2.13.0+cpu; the same
# 2.13.0 as +cu130 (and 2.14.x+cu130) runs the tier on a machine with no GPU.
needs_cuda_build = pytest.mark.skipif(
    not torch.backends.cuda.is_built(),
    reason=f"fake CUDA needs torch's CUDA build (PyPI's default wheel; no GPU needed): {torch.__version__} is CPU-only",
)

# Ops that make the host wait for the device: a value read into Python, or a result whose shape
# depends on the data (the host must learn the size before it can go on).
SYNC_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.item.default, aten.nonzero.default}
KERNELS = {
    aten._scaled_dot_product_flash_attention.default: "flash",
    aten._scaled_dot_product_efficient_attention.default: "efficient",
    aten._scaled_dot_product_cudnn_attention.default: "cudnn",
    aten._scaled_dot_product_attention_math.default: "math",
    aten._safe_softmax.default: "math",  # what plain SDPA on fake CUDA decomposes to on a CPU build
    aten._scaled_dot_product_flash_attention_for_cpu.default: "cpu",
}
# The fused kernels' position of their mask / bias argument (None: they take none).
_BIAS_ARG = {"flash": None, "efficient": 3, "cudnn": 3}
_HERE = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


@dataclass(frozen=True)
class Sync:
    """One host synchronisation: the op, and the innermost frame outside torch that asked for it."""

    op: str
    where: str

    def __str__(self) -> str:
        return f"{self.op} at {self.where}"


@dataclass(frozen=True)
class Kernel:
    name: str  # flash, efficient, cudnn, math, cpu
    masked: bool


class Probe(TorchDispatchMode):
    """Records syncs, attention kernels and collectives; answers scalar reads from `scalars`.

    `scalars` are handed out in order, one per `_local_scalar_dense` (then `default`), so a test
    scripts the branch a data-dependent decision takes (the cache's skip-or-compute). A
    data-dependent shape (`nonzero`) gets its largest possible size: every element counts."""

    def __init__(self, scalars: list[Any] | None = None, default: Any = 0, known: KnownValues | None = None) -> None:
        super().__init__()
        self.known = known  # small tensors whose values are kept (entered below this mode): their reads are real
        self._last_was_read = False
        self.scalars = list(scalars or [])
        self.default = default
        self.syncs: list[Sync] = []
        self.kernels: list[Kernel] = []
        self.collectives: list[tuple[str, tuple[str, ...]]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.known is not None and self._reads_known(func, args, kwargs):
            # A read of a value the mode below keeps (a mask made from known values): the GPU stalls
            # here as anywhere, and the answer is the real one.
            sync = Sync(str(func.overloadpacket.__name__), _caller())
            if not (
                func is aten._local_scalar_dense.default
                and self.syncs
                and self.syncs[-1] == sync
                and self._last_was_read
            ):
                self.syncs.append(sync)  # `tolist()` reads element by element here, from one copy on a GPU: one sync
            result = func(*args, **kwargs)
            self._last_was_read = func is aten._local_scalar_dense.default
            return result
        self._last_was_read = False
        if func in SYNC_OPS:
            self.syncs.append(Sync(str(func.overloadpacket.__name__), _caller()))
            if func is aten.nonzero.default:
                x = args[0]
                return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
            return self._answer(args[0])
        if func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            # `x[mask]` finds its size from the mask's data inside the op (a nonzero this mode
            # does not see): one sync, and, as for nonzero, every element counts.
            self.syncs.append(Sync("index with a boolean mask", _caller()))
            return func(args[0], [_every_index(i) for i in args[1]])
        if func in (aten._to_copy.default, aten.copy_.default):
            source, target = (
                (args[0], kwargs.get("device")) if func is aten._to_copy.default else (args[1], args[0].device)
            )
            if source.device.type == "cuda" and target is not None and torch.device(target).type == "cpu":
                self.syncs.append(Sync("device-to-host copy", _caller()))
        kernel = KERNELS.get(func)
        if kernel is not None:
            position = _BIAS_ARG.get(kernel)
            bias = args[position] if position is not None and len(args) > position else kwargs.get("attn_bias")
            self.kernels.append(Kernel(kernel, bias is not None))
        if func.namespace in ("c10d", "_c10d_functional"):
            devices = tuple(t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            self.collectives.append((func.overloadpacket.__name__, devices))
        return func(*args, **kwargs)

    def _reads_known(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """A sync op, or `repeat_interleave` by a repeats tensor (its output size is the repeats' sum),
        on a tensor whose values are known."""
        assert self.known is not None
        if func is aten.repeat_interleave.Tensor:
            return args[0] in self.known.values and kwargs.get("output_size") is None
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):  # `x[mask]`, `x[mask] = y`
            return any(i is not None and i.dtype == torch.bool and i in self.known.values for i in args[1])
        return func in SYNC_OPS and args[0] in self.known.values

    def _answer(self, tensor: torch.Tensor) -> Any:
        value = self.scalars.pop(0) if self.scalars else self.default
        if tensor.dtype == torch.bool:
            return bool(value)
        return int(value) if not tensor.dtype.is_floating_point else float(value)

    def fused(self) -> Counter[Kernel]:
        """The fused kernels (those the context-parallel engine picks), counted."""
        return Counter(k for k in self.kernels if k.name in ("flash", "efficient", "cudnn"))

    def non_cuda_collectives(self) -> list[tuple[str, tuple[str, ...]]]:
        return [(name, devices) for name, devices in self.collectives if any(d != "cuda" for d in devices)]


def _every_index(index: torch.Tensor | None) -> Any:
    """A boolean mask's positions as if every element were true; other indices unchanged. A
    k-dimensional mask stands for k index tensors (`None` where a boolean index is absent)."""
    if index is None or index.dtype != torch.bool:
        return index
    if index.dim() != 1:
        raise NotImplementedError("fake-CUDA probe: boolean masks of more than one dim")
    return torch.arange(index.shape[0], device=index.device)


def _caller() -> str:
    """`path:line` of the innermost frame outside torch and this harness (the code that synced);
    a function mode's `__torch_function__` only passes the call on, so the frame below it counts."""
    frame = sys._getframe(1)  # frames, not traceback.extract_stack: that reads every frame's source line
    while frame is not None:
        path = _absolute(frame.f_code.co_filename)
        if path != _HERE and not path.startswith(_TORCH) and frame.f_code.co_name != "__torch_function__":
            return f"{_short(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


@functools.cache
def _absolute(filename: str) -> str:
    return os.path.abspath(filename)


def _short(path: str) -> str:
    for marker in ("/accel/", "/diffusers/", "/tests/"):
        if marker in path:
            return marker[1:] + path.split(marker, 1)[1]
    return path


@contextmanager
def fake_rank(rank: int, world: int) -> Iterator[None]:
    """This process as rank `rank` of `world` on the `fake` backend, for the block's duration
    (a previous process group is destroyed first)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def fake_mesh(degrees: Degrees) -> ParallelMesh:
    """accel's own mesh on device type `cuda` over the fake group (init_device_mesh accepts it)."""
    mesh = build_mesh(degrees, "cuda")
    assert mesh is not None
    return mesh


def new_fake_mode() -> FakeTensorMode:
    """Fake tensors only: a real tensor reaching an op raises, so nothing slips past on the CPU."""
    return FakeTensorMode(allow_non_fake_inputs=False)


@contextmanager
def fake_cuda(mode: FakeTensorMode | None = None) -> Iterator[FakeTensorMode]:
    """Inside `mode` (default: a new one). Fake tensors belong to the mode that made them, so a
    module built once and reused across tests needs its mode entered again each time."""
    with mode or new_fake_mode() as entered:
        yield entered


def on_fake_cuda(cls: type[nn.Module], config: Mapping[str, Any], **overrides: Any) -> nn.Module:
    """`cls` built from `config` directly on fake `cuda:0` in bfloat16 (inside `fake_cuda()`).

    The default dtype is switched during construction because a fake module cannot be cast
    afterwards (`.to(bfloat16)` fails to swap its parameters)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        with torch.device("cuda"):
            module = cls.from_config({**dict(config), **overrides})  # type: ignore[attr-defined]
    finally:
        torch.set_default_dtype(previous)
    return module.eval()


def randn(*shape: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=dtype)


class ToyScheduler:
    """Just what `accel.steps.StepEvents` wraps: `set_timesteps` starts a generation, `step` ends a step."""

    def __init__(self) -> None:
        self.timesteps: list[int] = []

    def set_timesteps(self, steps: int) -> None:
        self.timesteps = list(range(steps))

    def step(self) -> None:
        return None


def run_probed(
    fn: Callable[[], Any], scalars: list[Any] | None = None, known: KnownValues | None = None
) -> tuple[Any, Probe]:
    """`fn()` under a fresh `Probe` (inside `fake_cuda()`, and inside `known` if given): its result and
    what the probe saw."""
    probe = Probe(scalars, known=known)
    with torch.no_grad(), probe:
        result = fn()
    return result, probe


# -- the tier's shapes: token grids and parallel layouts -----------------------------------------------
# Tiny configs get 24 heads (FLUX's, HunyuanVideo's, Mochi's count): every Ulysses degree of
# 2, 3, 4 and 8 divides it. Width costs nothing in fake mode.
HEADS = 24


@dataclass(frozen=True)
class Grid:
    """Latent frames x rows x cols (after patching: the token grid) and text tokens."""

    frames: int
    rows: int
    cols: int
    text: int

    @property
    def tokens(self) -> int:
        return self.frames * self.rows * self.cols


# Every world size here (2, 3, 4, 8) divides 96 and 48; none divides 35 or 37.
DIVIDING = Grid(frames=2, rows=6, cols=8, text=48)
UNEVEN = Grid(frames=1, rows=5, cols=7, text=37)


@dataclass(frozen=True)
class Layout:
    """A parallel layout and what to run on it."""

    world: int
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1
    cache: bool = False
    grid: Grid = DIVIDING
    tp: int = 1

    @property
    def degrees(self) -> Degrees:
        return Degrees(ulysses=self.ulysses, ring=self.ring, cfg=self.cfg, tp=self.tp)

    def __str__(self) -> str:
        parts = [f"w{self.world}"] + [
            f"{k}{getattr(self, k)}" for k in ("tp", "ulysses", "ring", "cfg") if getattr(self, k) > 1
        ]
        return "-".join(parts + ["cache" if self.cache else "nocache", "even" if self.grid == DIVIDING else "uneven"])


def out_channels(config: dict[str, Any]) -> int:
    """A transformer's output channels: its config's, or as many as it takes in."""
    return config.get("out_channels") or config["in_channels"]
