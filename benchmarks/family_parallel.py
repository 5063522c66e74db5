"""Every family under context and CFG parallelism: per-step transformer time, 2 CPU ranks against 1.

Ratios measured side by side in one run (absolute times on a shared machine mean little):

1. Each family's tiny pipeline, 1 process x 1 thread against 2 gloo ranks x 1 thread, for
   Ulysses 2, Ring 2 and CFG 2: the transformer's time per denoising step (the slower rank's),
   at the tiny size and at a longer sequence. The VAE is skipped (latent output).
2. With --device cuda: per-rank transformer forward time with the "fake" process group (one
   process plays rank 0 of N; collectives move nothing) for N = 2, 4, 8 against one device,
   real-size random-weight transformers in bf16: FLUX.1-dev at 1024x1024, Wan 2.1 14B at
   1280x720, 33 frames, SkyReels-V2 14B at 544x960, 97 frames, FLUX.2-dev at 1024x1024, Qwen-Image at
   1328x1328, HunyuanVideo 1.5 at 1280x720, 121 frames, LTX-2 at 512x768, 121 frames (video and audio), and
   HunyuanImage 2.1 at 2048x2048.
   On the CPU, --smoke runs the same code on scaled-down configs.

    python benchmarks/family_parallel.py [--families flux,wan] [--steps 3] [--device cpu|cuda] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.multiprocessing as mp
from ranks import join_gloo

from accel.launch.environment import free_port
from timing import median_time

MODES = {"ulysses 2": {"ulysses": 2}, "ring 2": {"ring": 2}, "cfg 2": {"cfg": 2}}
# A longer sequence per family: about 1-2k video/image tokens, guidance on.
LONG = {
    "flux": dict(height=256, width=512),  # 16 x 32 = 512 image tokens + 512 text
    "wan": dict(height=256, width=256, num_frames=17),  # 5 latent frames x 16 x 16 = 1280 tokens
    "hunyuan": dict(height=256, width=256, num_frames=17),  # 1280 video + 256 text
    "cogvideox": dict(height=256, width=256, num_frames=17),  # 5 x 16 x 16 = 1280 video + 226 text
    "mochi": dict(height=256, width=256, num_frames=13),  # 3 x 16 x 16 = 768 video + text
    "ltx": dict(height=512, width=512, num_frames=25),  # 4 x 16 x 16 = 1024 video tokens
    "qwenimage": dict(height=512, width=512),  # 32 x 32 = 1024 image tokens + the prompt's
    "flux2-klein": dict(height=512, width=512),  # 32 x 32 = 1024 image tokens + 512 text
    "sd3": dict(height=256, width=256),  # 16 x 16 = 256 image tokens + 333 text (the tiny crops positions at 16 x 16)
    "zimage": dict(height=512, width=512),  # 32 x 32 = 1024 image tokens + the caption, in one sequence
    "hunyuan15": dict(height=256, width=256, num_frames=17),  # 5 x 16 x 16 = 1280 video + 1985 joint text tokens
    "skyreels2": dict(height=256, width=256, num_frames=17),  # as Wan: 5 latent frames x 16 x 16 = 1280 tokens
    "kandinsky5": dict(height=256, width=256, num_frames=17),  # 5 latent frames x 16 x 16 = 1280 video tokens
    "ltx2": dict(height=512, width=512, num_frames=25),  # 4 x 16 x 16 = 1024 video tokens, 26 audio tokens (replicated)
    "hunyuanimage": dict(height=1024, width=1024),  # 32 x 32 = 1024 image tokens (32x VAE, patch 1) + 1128 text
}
CFG_ON = {
    "flux": dict(negative_prompt="blurry", true_cfg_scale=2.0),
    "hunyuan": dict(negative_prompt="blurry", true_cfg_scale=2.0),
    "qwenimage": dict(negative_prompt="blurry", true_cfg_scale=4.0),
    "zimage": dict(guidance_scale=4.0),  # the base model's batched CFG (Turbo runs without)
    "hunyuan15": dict(negative_prompt="blurry"),  # the guider's CFG (scale 6 in the tiny pipeline): two calls
    "hunyuanimage": dict(negative_prompt="blurry"),  # the guider's CFG (scale 3.5 in the tiny pipeline): two calls
    "kandinsky5": dict(guidance_scale=5.0),  # two calls per step
    # LTX-2: batched CFG; the pipeline's default spatio-temporal and modality guidance add two batch-1 calls a
    # step, which every CFG half runs whole
    "ltx2": dict(guidance_scale=4.0),
}
# Call keywords a family's pipeline does not take (FLUX.2 [klein] has no negative prompt; HunyuanVideo 1.5's
# and HunyuanImage 2.1's guidance scales sit on their guiders).
NOT_TAKEN = {"flux2-klein": ("negative_prompt",), "hunyuan15": ("guidance_scale",), "hunyuanimage": ("guidance_scale",)}


# --- 1. two CPU ranks against one ---------------------------------------------------------------


def _call(family: str, size: str, steps: int) -> dict[str, Any]:
    from accel.models.registry import FAMILIES

    defaults = FAMILIES[family].tiny_defaults
    assert defaults is not None
    call: dict[str, Any] = dict(
        prompt="a red fox",
        negative_prompt="blurry",
        num_inference_steps=steps,
        height=defaults.height,
        width=defaults.width,
        guidance_scale=defaults.guidance_scale,
    )
    if defaults.frames is not None:
        call["num_frames"] = defaults.frames
    call.update(CFG_ON.get(family, {}))
    for keyword in NOT_TAKEN.get(family, ()):
        call.pop(keyword)
    return call if size == "tiny" else dict(call, **LONG[family])


def _step_time(pipe: Any, recipe: dict[str, Any], call: dict[str, Any], repeats: int) -> float:
    """This rank's transformer seconds per denoising step (median over runs) under `recipe`."""
    import accel

    spent = [0.0]
    starts: list[float] = []
    transformer = pipe.transformer
    hooks = [
        transformer.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter())),
        transformer.register_forward_hook(
            lambda *_: spent.__setitem__(0, spent[0] + time.perf_counter() - starts.pop())
        ),
    ]
    handle = accel.apply(pipe, recipe)
    try:

        def run() -> None:
            pipe(**call, generator=torch.Generator().manual_seed(0), output_type="latent")

        run()  # warm-up
        per_run = []
        for _ in range(repeats):
            spent[0] = 0.0
            run()
            per_run.append(spent[0] / call["num_inference_steps"])
        return sorted(per_run)[len(per_run) // 2]
    finally:
        handle.remove()
        for hook in hooks:
            hook.remove()


def _family_rank(rank: int, world: int, port: int, families: list[str], steps: int, repeats: int, results: Any) -> None:
    import torch.distributed as dist

    import accel
    from accel.models.registry import FAMILIES

    join_gloo(rank, world, port)
    for family in families:
        pipe = accel.load_pipeline(f"tiny-{family}")
        pipe.set_progress_bar_config(disable=True)
        for size in ("tiny", "long"):
            call = _call(family, size, steps)
            if rank == 0:  # the single-process run, while the other rank waits
                results[(family, size, "1 process")] = _step_time(pipe, {}, call, repeats)
            dist.barrier()
            for mode, parallel in MODES.items():
                if mode.startswith("cfg") and FAMILIES[family].cfg is None:
                    continue
                seconds = torch.tensor(_step_time(pipe, {"parallel": parallel}, call, repeats))
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slower rank sets the pace
                if rank == 0:
                    results[(family, size, mode)] = seconds.item()


def family_section(families: list[str], steps: int, repeats: int) -> None:
    results = mp.Manager().dict()
    mp.spawn(_family_rank, args=(2, free_port(), families, steps, repeats, results), nprocs=2)
    print(f"\n1. transformer time per step, 2 gloo ranks x 1 thread against 1 process x 1 thread ({steps} steps)")
    print(f"   {'family':<12}{'size':<6}{'1 process':>11}" + "".join(f"{mode:>14}" for mode in MODES))
    for family in families:
        for size in ("tiny", "long"):
            single = results[(family, size, "1 process")]
            cells = [
                f"{single / results[(family, size, mode)]:>13.2f}x" if (family, size, mode) in results else f"{'—':>14}"
                for mode in MODES
            ]
            print(f"   {family:<12}{size:<6}{single * 1000:>9.1f}ms" + "".join(cells))


# --- 2. per-rank time with the fake process group -------------------------------------------------

REAL = {
    # FLUX.1-dev at 1024x1024: 64x64 packed tokens of 64 channels, 512 T5 tokens.
    "flux": dict(
        cls="FluxTransformer2DModel",
        config=dict(
            in_channels=64,
            num_layers=19,
            num_single_layers=38,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        ),
        tokens=(64, 64),
    ),
    # Wan 2.1 T2V 14B at 1280x720, 33 frames: 9 x 90 x 160 latents, (1, 2, 2) patches.
    "wan": dict(
        cls="WanTransformer3DModel",
        config=dict(
            num_attention_heads=40,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=13824,
            num_layers=40,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
        ),
        latents=(9, 90, 160),
    ),
    # SkyReels-V2 T2V 14B at 544x960, 97 frames (its defaults): 25 x 68 x 120 latents, Wan 2.1 14B's DiT.
    "skyreels2": dict(
        cls="SkyReelsV2Transformer3DModel",
        config=dict(
            num_attention_heads=40,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=13824,
            num_layers=40,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
        ),
        latents=(25, 68, 120),
    ),
    # FLUX.2-dev at 1024x1024: 64x64 packed tokens of 128 channels, 512 Mistral tokens (3 layers stacked: 15360 wide).
    # (--smoke: a quarter of the heads too; at full width one double block alone is 4 GB in float32.)
    "flux2": dict(
        cls="Flux2Transformer2DModel",
        config=dict(),
        tokens=(64, 64),
        text=512,
        family="flux2-klein",
        smoke=dict(num_attention_heads=12),
    ),
    # Qwen-Image at 1328x1328: 83x83 packed tokens of 64 channels, a 256-token prompt.
    "qwenimage": dict(cls="QwenImageTransformer2DModel", config=dict(), tokens=(83, 83), text=256),
    # HunyuanVideo 1.5 (the diffusers defaults: 54 blocks, 16 heads of 128) at 1280x720, 121 frames: 31 x 45 x 80
    # latents (16x VAE, patch 1) = 111600 video tokens, then the 1985-token joint text stream (128 of the 1000
    # prompt tokens real, no glyph text, 729 zero image tokens). On one device diffusers' processor builds a
    # (L, L) mask per block (13 GB of bools at this L); under accel each rank's L is 1/N of it.
    "hunyuan15": dict(
        cls="HunyuanVideo15Transformer3DModel",
        config=dict(),
        latents=(31, 45, 80),
        prompt=128,
        smoke=dict(num_attention_heads=4),
    ),
    # HunyuanImage 2.1 (the diffusers defaults: 20 double and 40 single blocks, 28 heads of 128) at 2048x2048:
    # 64 x 64 latents (32x VAE, patch 1) = 4096 image tokens, then 1000 Qwen tokens (128 real) and 128 ByT5
    # slots (no glyph text), joined valid first. (--smoke: 4 heads.)
    "hunyuanimage": dict(
        cls="HunyuanImageTransformer2DModel",
        config=dict(text_embed_2_dim=1472),
        latents=(64, 64),
        prompt=128,
        smoke=dict(num_attention_heads=4),
    ),
    # LTX-2 (48 blocks, 32 video heads of 128, 32 audio heads of 64) at 512x768, 121 frames: 16 x 16 x 24 latents,
    # 126 audio tokens (5 s), 1024 Gemma 3 tokens. (--smoke: 8 heads of each kind.)
    "ltx2": dict(
        cls="LTX2VideoTransformer3DModel",
        config=dict(num_layers=48, rope_type="split"),
        latents=(16, 16, 24),
        audio=126,
        text=1024,
        smoke=dict(
            num_attention_heads=8, cross_attention_dim=1024, audio_num_attention_heads=8, audio_cross_attention_dim=512
        ),
    ),
}
SMOKE = {"num_layers": 1, "num_single_layers": 1}  # CPU (--smoke): same attention shapes, far fewer layers


def _grid_ids(axes: int, *sizes: int) -> torch.Tensor:
    """Position ids of a token grid, one row per token: zeros then the grid coordinates (FLUX style)."""
    grids = torch.meshgrid(*(torch.arange(float(n)) for n in sizes), indexing="ij")
    ids = torch.stack([torch.zeros_like(grids[0])] * (axes - len(sizes)) + list(grids), -1)
    return ids.reshape(-1, axes)


def _inputs(family: str, spec: dict[str, Any], scale: int, dtype: torch.dtype, device: str) -> dict[str, Any]:
    make = lambda *shape: torch.randn(*shape, dtype=dtype, device=device)  # noqa: E731
    if family == "flux":
        h, w = (n // scale for n in spec["tokens"])
        ids = torch.stack(
            torch.meshgrid(torch.zeros(1), torch.arange(float(h)), torch.arange(float(w)), indexing="ij"), -1
        )
        return dict(
            hidden_states=make(1, h * w, 64),
            encoder_hidden_states=make(1, 512, 4096),
            pooled_projections=make(1, 768),
            timestep=torch.ones(1, device=device, dtype=dtype),
            guidance=torch.full((1,), 3.5, device=device, dtype=dtype),
            img_ids=ids.reshape(-1, 3).to(device, dtype),
            txt_ids=torch.zeros(512, 3, device=device, dtype=dtype),
            return_dict=False,
        )
    if family == "flux2":
        h, w = (n // scale for n in spec["tokens"])
        text = spec["text"]
        return dict(
            hidden_states=make(1, h * w, 128),
            encoder_hidden_states=make(1, text, 15360),
            timestep=torch.ones(1, device=device, dtype=dtype),
            guidance=torch.full((1,), 4.0, device=device, dtype=dtype),
            img_ids=_grid_ids(4, 1, h, w)[None].to(device, dtype),
            txt_ids=_grid_ids(4, text)[None].to(device, dtype),
            return_dict=False,
        )
    if family == "qwenimage":
        h, w = (n // scale for n in spec["tokens"])
        text = spec["text"]
        return dict(
            hidden_states=make(1, h * w, 64),
            encoder_hidden_states=make(1, text, 3584),
            encoder_hidden_states_mask=torch.ones(1, text, dtype=torch.bool, device=device),
            timestep=torch.ones(1, device=device, dtype=dtype),
            img_shapes=[[(1, h, w)]],
            return_dict=False,
        )
    if family == "hunyuan15":
        f, h, w = spec["latents"]
        f = (f - 1) // scale + 1  # --smoke: fewer frames too
        prompt = torch.zeros(1, 1000, dtype=torch.long, device=device)
        prompt[:, : spec["prompt"]] = 1
        return dict(
            hidden_states=make(1, 65, f, h // scale, w // scale),
            timestep=torch.ones(1, device=device, dtype=dtype),
            encoder_hidden_states=make(1, 1000, 3584),
            encoder_attention_mask=prompt,
            encoder_hidden_states_2=make(1, 256, 1472),
            encoder_attention_mask_2=torch.zeros(1, 256, dtype=torch.long, device=device),
            image_embeds=torch.zeros(1, 729, 1152, dtype=dtype, device=device),
            return_dict=False,
        )
    if family == "hunyuanimage":
        h, w = (n // scale for n in spec["latents"])
        prompt = torch.zeros(1, 1000, dtype=torch.long, device=device)
        prompt[:, : spec["prompt"]] = 1
        return dict(
            hidden_states=make(1, 64, h, w),
            timestep=torch.ones(1, device=device, dtype=dtype),
            encoder_hidden_states=make(1, 1000, 3584),
            encoder_attention_mask=prompt,
            encoder_hidden_states_2=make(1, 128, 1472),
            encoder_attention_mask_2=torch.zeros(1, 128, dtype=torch.long, device=device),
            return_dict=False,
        )
    if family == "ltx2":
        f, h, w = spec["latents"]
        h, w = max(1, h // scale), max(1, w // scale)
        audio, text = spec["audio"], spec["text"]
        mask = torch.ones(1, text, dtype=torch.long, device=device)
        return dict(
            hidden_states=make(1, f * h * w, 128),
            audio_hidden_states=make(1, audio, 128),
            encoder_hidden_states=make(1, text, 3840),
            audio_encoder_hidden_states=make(1, text, 3840),
            timestep=torch.full((1,), 500.0, device=device, dtype=dtype),
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=f,
            height=h,
            width=w,
            audio_num_frames=audio,
            return_dict=False,
        )
    f, h, w = spec["latents"]
    return dict(
        hidden_states=make(1, 16, f, h // scale, w // scale),
        encoder_hidden_states=make(1, 512, 4096),
        timestep=torch.ones(1, device=device),
        return_dict=False,
    )


def _defaults(cls: str) -> set[str]:
    import inspect

    import diffusers

    return set(inspect.signature(getattr(diffusers, cls).__init__).parameters)


def _transformer(family: str, spec: dict[str, Any], smoke: bool, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """Built directly in `dtype` on `device` (default dtype switched while constructing): a 12-14 B model
    built in float32 and cast afterwards would need 1.5x its bf16 size on the GPU, and the time to cast."""
    import diffusers

    config = dict(spec["config"])
    if smoke:
        config.update({k: v for k, v in SMOKE.items() if k in config or k in _defaults(spec["cls"])})
        config.update(spec.get("smoke", {}))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = getattr(diffusers, spec["cls"])(**config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


WORLDS = (1, 2, 4, 8)


def _fake_family(_index: int, family: str, device: str, repeats: int) -> None:
    """One process per family: the model is built once, then timed as rank 0 of each N in turn (the fake
    group re-made for each N), each line printed as soon as it is measured."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from accel.models.registry import FAMILIES
    from accel.parallel.mesh import Degrees, build_mesh
    from accel.parallel.engine import ContextParallel
    from accel.parallel.plan import resolve_plan

    smoke = device != "cuda"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    spec = REAL[family]
    transformer = _transformer(family, spec, smoke, dtype, device)
    inputs = _inputs(family, spec, 4 if smoke else 1, dtype, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    heads = int(transformer.config.num_attention_heads)
    single = None
    print(f"   {family}:", flush=True)
    with torch.no_grad():
        for world in WORLDS:
            if world == 1:
                try:
                    single = median_time(lambda: transformer(**inputs), repeats, sync, warmup=1)
                    print(f"     one device {single * 1000:.1f} ms", flush=True)
                except torch.OutOfMemoryError:  # HunyuanVideo 1.5's (L, L) masks at 720p: the parallel rows still print
                    print("     one device: out of memory", flush=True)
                continue
            dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
            cells = []
            for name, degrees in (("ulysses", Degrees(ulysses=world)), ("ring", Degrees(ring=world))):
                if heads % degrees.ulysses:
                    continue
                plan = resolve_plan(FAMILIES[spec.get("family", family)].plan_for(transformer), transformer)
                engine = ContextParallel(transformer, plan, build_mesh(degrees, device))
                seconds = median_time(lambda: transformer(**inputs), repeats, sync, warmup=1)
                engine.remove()
                cells.append(
                    f"{name} {seconds * 1000:.1f} ms"
                    + (f" ({single / seconds:.2f}x, ideal {world}x)" if single else "")
                )
            dist.destroy_process_group()
            print(f"     N={world}: " + ";  ".join(cells), flush=True)


def fake_section(families: list[str], device: str, repeats: int) -> None:
    what = (
        "real-size configs, bf16" if device == "cuda" else "CPU smoke test: 1-layer configs at 1/4 of the size, float32"
    )
    print(f"\n2. per-rank transformer forward time, fake process group, {what}, on {device}", flush=True)
    for family in families:
        mp.spawn(_fake_family, args=(family, device, repeats), nprocs=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--families",
        default="flux,wan,hunyuan,cogvideox,mochi,ltx,qwenimage,flux2-klein,sd3,flux2,zimage,hunyuan15,skyreels2,kandinsky5,ltx2,"
        "hunyuanimage",
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--skip-cpu-ranks", action="store_true", help="only section 2")
    parser.add_argument("--smoke", action="store_true", help="run section 2 on the CPU too (scaled-down configs)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, device {args.device}")
    if not args.skip_cpu_ranks:
        family_section([f for f in args.families.split(",") if f in LONG], args.steps, args.repeats)
    if args.device == "cuda" or args.smoke:
        fake_section([f for f in REAL if f in args.families.split(",")], args.device, args.repeats)


if __name__ == "__main__":
    main()
