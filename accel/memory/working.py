"""The working memory a layout's busiest rank adds on top of its weights, measured before any weight is
read: the transformer's forward (cut to one block of each kind, accel/memory/build.py) and the VAE's
decode run on fake `cuda` (accel/memory/fake_cuda.py) at the requested size under the tracker
(accel/memory/tracker.py).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from accel.memory.build import DTYPE, build, cut_config, on_device
from accel.memory.fake_cuda import fake_or_real, fake_world
from accel.memory.tracker import tracked_peak
from accel.models.base import Family
from accel.models.flagships import Flagship, Size
from accel.optimize.processors import install_processors
from accel.parallel.mesh import Degrees
from accel.parallel.plan_format import AutomaticPlan
from accel.vae.masks import fill_masks_by_frame


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
    with fake_world(inner.world_size):
        mesh = build_mesh(inner, device)
        assert mesh is not None
        with fake_or_real(device, fake):
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
                inputs = on_device(flagship.inputs(size), device)
            peak = tracked_peak(lambda: model(**inputs), model, device=_tracked_device(device))
    return peak.working if peak is not None else 0


def vae_working(
    flagship: Flagship, size: Size, device: str = "cuda", fake: bool = True, tiling: bool = False, ranks: int = 1
) -> int:
    """Bytes the VAE's decode of one output adds on rank 0 (`tiling`: diffusers' tiled decode, [vae]
    tiling; `ranks` > 1: accel's row-split decode over that many ranks, [vae] parallel, on a `fake`
    process group); "cpu" runs it for real."""
    component = flagship.of_kind("vae")[0]
    with fake_world(ranks) if ranks > 1 else nullcontext(), fake_or_real(device, fake):
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
