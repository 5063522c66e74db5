"""Functions the rank pool runs on every rank (importable by spawned workers)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from accel.parallel.attention import usp_attention
from accel.parallel.comm import TRAFFIC
from accel.parallel.layout import SequenceLayout
from accel.parallel.mesh import Degrees, build_mesh

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def attention_error(
    ulysses: int,
    ring: int,
    dtype: str,
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
    dim: int,
    masked: bool,
    seed: int = 0,
    host_hint: bool = False,
) -> float:
    """Max-abs error of this rank's context-parallel output against SDPA on the full tensors.

    The reference runs in float64 on the same (possibly low-precision) inputs. `host_hint` also
    passes the layout's real-key counts, as the engine does, so padded blocks are cut, not masked."""
    mesh = build_mesh(Degrees(ulysses=ulysses, ring=ring), "cpu")
    world, rank = ulysses * ring, mesh.sequence_rank
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, dim, generator=generator).to(DTYPES[dtype])
    k = torch.randn(batch, heads, k_len, dim, generator=generator).to(DTYPES[dtype])
    v = torch.randn(batch, heads, k_len, dim, generator=generator).to(DTYPES[dtype])
    real = torch.ones(batch, k_len, dtype=torch.bool)
    if masked:  # key padding that differs per batch row; row 0 keeps at least one key
        lengths = torch.randint(1, k_len + 1, (batch,), generator=generator)
        real = torch.arange(k_len)[None, :] < lengths[:, None]
    reference = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=real[:, None, None, :] if masked else None
    )

    q_layout, k_layout = SequenceLayout(q_len, world), SequenceLayout(k_len, world)
    shard = lambda x, layout: layout.split(x, 2, rank)  # noqa: E731
    key_valid = k_layout.valid()[:, None, :]
    if masked:
        key_valid = key_valid & torch.stack([k_layout.split(real, 1, r) for r in range(world)])
    elif not k_layout.pad:
        key_valid = None
    real_keys = [k_layout.real(p) for p in range(world)] if host_hint and key_valid is not None and not masked else None
    out = usp_attention(
        shard(q, q_layout),
        shard(k, k_layout),
        shard(v, k_layout),
        mesh.ulysses_group if ulysses > 1 else None,
        mesh.ring_group if ring > 1 else None,
        key_valid,
        None,
        real_keys,
    )
    assert out.dtype == q.dtype and out.shape == (batch, heads, q_layout.shard, dim)
    expected = shard(reference, q_layout)
    rows = min(q_layout.shard, q_len - rank * q_layout.shard)  # padded query rows are dropped later
    return (out[:, :, :rows].double() - expected[:, :, :rows]).abs().max().item() if rows > 0 else 0.0


def pair_mask_error(ulysses: int, ring: int, tokens: int, block: int, additive: bool = False, heads: int = 4) -> float:
    """Max-abs error of this rank's self-attention under a whole-sequence block-causal pair mask
    (tokens in blocks of `block`; a block sees itself and earlier ones, and the first query of a
    block sees nothing but its own block) against SDPA with that mask on the full tensors.

    `additive`: the mask is a float bias per head instead, as LTX-2 IC-LoRA's: -inf where the bool
    one is False (so ring blocks a query sees nothing of), beside it random finite values and -10000
    on every fourth key (large negative, ordinary attention)."""
    mesh = build_mesh(Degrees(ulysses=ulysses, ring=ring), "cpu")
    world, rank = ulysses * ring, mesh.sequence_rank
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, heads, tokens, 16, generator=generator) for _ in range(3))
    blocks = torch.arange(tokens) // block
    allowed = blocks[None, :] <= blocks[:, None]  # (queries, keys)
    mask: torch.Tensor = allowed
    if additive:
        mask = -torch.rand(1, heads, tokens, tokens, generator=generator) * 3
        mask[..., ::4] = -10000.0
        mask = mask.masked_fill(~allowed, float("-inf"))
    reference = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask.double() if additive else mask
    )
    layout = SequenceLayout(tokens, world)
    pairs = F.pad(mask if additive else mask[None, None], (0, layout.pad, 0, layout.pad), value=0)
    if not additive:
        pairs[..., tokens:, :] = True
    shard = lambda x: layout.split(x, 2, rank)  # noqa: E731
    out = usp_attention(
        shard(q),
        shard(k),
        shard(v),
        mesh.ulysses_group if ulysses > 1 else None,
        mesh.ring_group if ring > 1 else None,
        layout.valid()[:, None, :] if layout.pad else None,
        None,
        None,
        pairs,
    )
    rows = min(layout.shard, tokens - rank * layout.shard)
    assert not out.isnan().any()
    return (out[:, :, :rows].double() - shard(reference)[:, :, :rows]).abs().max().item() if rows > 0 else 0.0


def whole_query_error(world: int, q_len: int, k_len: int, masked: bool, host_hint: bool) -> float:
    """Max-abs error of `whole_query_attention` (every rank all queries, its shard of the keys) against
    SDPA on the full tensors, with the keys' padding (and a per-row key mask) applied."""
    from accel.parallel.attention import whole_query_attention

    mesh = build_mesh(Degrees(ring=world), "cpu")
    rank = mesh.sequence_rank
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, n, 16, generator=generator) for n in (q_len, k_len, k_len))
    real = torch.ones(2, k_len, dtype=torch.bool)
    if masked:
        real[1, k_len // 2 :] = False
    reference = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=real[:, None, None, :])
    layout = SequenceLayout(k_len, world)
    key_valid = layout.valid()[:, None, :]
    if masked:
        key_valid = key_valid & torch.stack([layout.split(real, 1, r) for r in range(world)])
    real_keys = [layout.real(p) for p in range(world)] if host_hint else None
    out = whole_query_attention(
        q,
        layout.split(k, 2, rank),
        layout.split(v, 2, rank),
        mesh.sequence_group,
        key_valid if layout.pad or masked else None,
        None,
        real_keys,
    )
    return (out.double() - reference).abs().max().item()


def shared_keys_error(ulysses: int, ring: int, heads: int, tokens: int, shared: int) -> float:
    """Max-abs error of `usp_attention` whose queries are a cut stream's, attending to its keys and to
    `shared` keys every rank holds whole (Qwen-Image 2.1's cached prompt), against SDPA over the
    shared keys then the stream's on the full tensors; batch row 1 masks its last shared keys."""
    mesh = build_mesh(Degrees(ulysses=ulysses, ring=ring), "cpu")
    world, rank = ulysses * ring, mesh.sequence_rank
    generator = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, heads, tokens, 16, generator=generator) for _ in range(3))
    shared_k, shared_v = (torch.randn(2, heads, shared, 16, generator=generator) for _ in range(2))
    shared_valid = torch.ones(2, shared, dtype=torch.bool)
    shared_valid[1, shared // 2 :] = False
    real = torch.cat([shared_valid, torch.ones(2, tokens, dtype=torch.bool)], dim=1)
    reference = F.scaled_dot_product_attention(
        q.double(),
        torch.cat([shared_k, k], 2).double(),
        torch.cat([shared_v, v], 2).double(),
        attn_mask=real[:, None, None, :],
    )
    layout = SequenceLayout(tokens, world)
    key_valid = layout.valid()[:, None, :] if layout.pad else None
    out = usp_attention(
        layout.split(q, 2, rank),
        layout.split(k, 2, rank),
        layout.split(v, 2, rank),
        mesh.ulysses_group if ulysses > 1 else None,
        mesh.ring_group if ring > 1 else None,
        key_valid,
        shared=(shared_k, shared_v, shared_valid),
    )
    rows = min(layout.shard, tokens - rank * layout.shard)
    expected = layout.split(reference, 2, rank)
    return (out[:, :, :rows].double() - expected[:, :, :rows]).abs().max().item() if rows > 0 else 0.0


def traffic_bytes(ulysses: int, ring: int, batch: int, heads: int, tokens: int, dim: int) -> int:
    """Bytes this rank sends for one self-attention call on `tokens` tokens (float32)."""
    mesh = build_mesh(Degrees(ulysses=ulysses, ring=ring), "cpu")
    shard = tokens // (ulysses * ring)
    q, k, v = (torch.randn(batch, heads, shard, dim) for _ in range(3))
    TRAFFIC.reset()
    usp_attention(q, k, v, mesh.ulysses_group if ulysses > 1 else None, mesh.ring_group if ring > 1 else None)
    return TRAFFIC.total_bytes


def world_rank() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def group_ranks(ulysses: int, ring: int, fallback: bool) -> dict[str, Any]:
    from accel.parallel.mesh import flattened_group_fallback

    mesh = build_mesh(Degrees(ulysses=ulysses, ring=ring), "cpu")
    sequence = flattened_group_fallback(mesh.device_mesh, ("ring", "ulysses")) if fallback else mesh.sequence_group
    return {
        name: dist.get_process_group_ranks(group)
        for name, group in (("ulysses", mesh.ulysses_group), ("ring", mesh.ring_group), ("sequence", sequence))
    }


_pipelines: dict[str, Any] = {}


def tiny_pipeline(model: str, key: str | None = None) -> Any:
    """A tiny pipeline by alias ("tiny-wan") or builder ("accel.models.wan:build_tiny_i2v"), built once
    per process (per `key` where one is given: another copy of the same model)."""
    key = key or model
    if key not in _pipelines:
        import importlib

        import accel

        if ":" in model:
            module, name = model.split(":")
            pipe = getattr(importlib.import_module(module), name)()
        else:
            pipe = accel.load_pipeline(model)
        pipe.set_progress_bar_config(disable=True)
        _pipelines[key] = pipe
    return _pipelines[key]


def _rotate_in_float32(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Kandinsky 5's rotary rotation (rope holds a 2x2 matrix per pair of channels), kept in x's dtype."""
    pairs = x.reshape(*x.shape[:-1], -1, 1, 2).to(torch.float32)
    return (rope * pairs).sum(dim=-1).reshape(*x.shape).to(x.dtype)


class Float32RotaryProcessor:
    """Kandinsky 5's attention as diffusers' processor computes it, except that the rotated queries
    and keys stay float32: diffusers' rounds them to bfloat16 whatever the model's dtype, which
    turns last-bit differences (a ring merge order, a fused compiled kernel) into bfloat16 steps."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        rotary_emb: torch.Tensor | None = None,
        sparse_params: Any = None,
    ) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if sparse_params is not None:
            raise NotImplementedError("NABLA sparse attention")
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        heads = lambda x: x.reshape(*x.shape[:-1], attn.num_heads, -1)  # noqa: E731
        query, key, value = (
            heads(attn.to_query(hidden_states)),
            heads(attn.to_key(context)),
            heads(attn.to_value(context)),
        )
        query = attn.query_norm(query.float()).type_as(query)
        key = attn.key_norm(key.float()).type_as(key)
        if rotary_emb is not None:
            query, key = _rotate_in_float32(query, rotary_emb), _rotate_in_float32(key, rotary_emb)
        return attn.out_layer(dispatch_attention_fn(query, key, value).flatten(-2, -1))


def tiny_kandinsky5_float32_rotary() -> Any:
    """tiny-kandinsky5 with Float32RotaryProcessor on every attention (this instance only)."""
    from accel.models import kandinsky5

    pipe = kandinsky5.build_tiny()
    for module in pipe.transformer.modules():
        if type(module).__name__ == "Kandinsky5Attention":
            module.set_processor(Float32RotaryProcessor())
    return pipe


def tiny_kandinsky5_nabla() -> Any:
    """tiny-kandinsky5 configured for NABLA sparse attention (the 10 s checkpoints'), which context
    parallelism refuses when it is applied, before any call."""
    from accel.models import kandinsky5

    pipe = kandinsky5.build_tiny()
    pipe.transformer.register_to_config(attention_type="nabla")
    return pipe


def tiny_wan_three_heads() -> Any:
    """tiny-wan with a three-head transformer: a head count Ulysses 2 does not divide."""
    from accel.models import wan

    pipe = wan.build_tiny()
    pipe.transformer = wan._tiny_transformer(2, text_dim=pipe.text_encoder.config.d_model, num_attention_heads=3)
    return pipe


def tiny_wan_six_heads() -> Any:
    """tiny-wan with a six-head transformer: under tp 2 each rank holds three, which Ulysses 2 pads."""
    from accel.models import wan

    pipe = wan.build_tiny()
    pipe.transformer = wan._tiny_transformer(2, text_dim=pipe.text_encoder.config.d_model, num_attention_heads=6)
    return pipe


def tiny_ltx2_i2v() -> Any:
    """tiny-ltx2's components as LTX2ImageToVideoPipeline (the variant accel builds with from_pipe)."""
    from diffusers import LTX2ImageToVideoPipeline

    return LTX2ImageToVideoPipeline.from_pipe(tiny_pipeline("tiny-ltx2"))


def tiny_hunyuan_i2v_33ch() -> Any:
    """tiny HunyuanVideo-I2V with the 33-channel checkpoint's transformer config: the picture's
    latents and a mask concatenated in channels (latent_concat), no guidance embedding."""
    from accel.models import hunyuan

    pipe = hunyuan.build_tiny_i2v()
    pipe.transformer = hunyuan._tiny_transformer(
        9,
        text_dim=pipe.text_encoder.config.text_config.hidden_size,
        pooled_dim=pipe.text_encoder_2.config.hidden_size,
        in_channels=2 * 16 + 1,
        guidance_embeds=False,
        image_condition_type="latent_concat",
    )
    return pipe


def tiny_helios_amplified() -> Any:
    """tiny-helios with history-key amplification (`is_amplify_history`): each head's keys of the
    history tokens scaled by its own random factor, which a shard must apply to its own history keys."""
    from accel.models import helios

    pipe = helios.build_tiny(is_amplify_history=True)
    generator = torch.Generator().manual_seed(0)
    for block in pipe.transformer.blocks:
        block.attn1.history_key_scale.data = torch.randn(block.attn1.heads, generator=generator)
    return pipe


def tiny_helios_cfg_zero_star() -> Any:
    """tiny Helios pyramid with Helios-Mid's CFG-Zero* guidance (both branches' outputs rescaled together)."""
    from accel.models import helios

    return helios.build_tiny_pyramid(cfg_zero_star=True)


def tiny_output(model: str, recipe: dict[str, Any], call: dict[str, Any], seed: int = 0) -> Any:
    """This rank's output of the tiny pipeline under `accel.apply(pipe, recipe)` (undone afterwards)."""
    return tiny_run(model, recipe, call, seed)[0]


def tiny_run(model: str, recipe: dict[str, Any], call: dict[str, Any], seed: int = 0) -> tuple[Any, Any, int]:
    """(output, cache records as (step, branch, change, cached) or None, bytes this rank sent) of the
    tiny pipeline under `recipe`."""
    import accel

    pipe = pipeline_for(model, recipe)
    handle = accel.apply(pipe, recipe)
    TRAFFIC.reset()
    try:
        result = pipe(**call, generator=torch.Generator().manual_seed(seed), output_type="np")
        stats = handle.cache_stats
    finally:
        handle.remove()
    decisions = [(r.step, r.branch, r.change, r.cached) for r in stats.records] if stats is not None else None
    return output_of(result, pipe), decisions, TRAFFIC.total_bytes


def batched_outputs(
    model: str, recipe: dict[str, Any], call: dict[str, Any], prompts: list[str], seeds: list[int]
) -> list[Any]:
    """This rank's outputs of one batched call of the tiny pipeline under `recipe` (accel serve
    --max-batch), sample i from seeds[i]."""
    import accel
    from accel.generate import generate_batch

    pipe = pipeline_for(model, recipe)
    handle = accel.apply(pipe, recipe)
    try:
        return [output for output, _ in generate_batch(pipe, call, prompts, seeds)]
    finally:
        handle.remove()


def pipeline_for(model: str, recipe: dict[str, Any]) -> Any:
    """The tiny pipeline `recipe` runs on: the shared one, or under tp a split copy of its own."""
    tp = recipe.get("parallel", {}).get("tp", 1)
    return tiny_pipeline(model) if tp == 1 else tiny_split_pipeline(model, recipe["parallel"])


def tiny_split_pipeline(model: str, parallel: dict[str, int]) -> Any:
    """A pipeline of its own for a tensor-parallel layout: the split outlives `handle.remove()`, so
    it must not be the one the other layouts of this rank share. One per degree and rank index,
    which is all the split depends on (a layout's TP group holds consecutive ranks)."""
    import torch.distributed as dist

    tp = parallel["tp"]
    return tiny_pipeline(model, key=f"{model}@tp{tp}.{dist.get_rank() % tp}")


_curves: dict[str, Any] = {}


def magcache_curve(model: str, call: dict[str, Any]) -> list[list[float]]:
    """MagCache's calibrated curve of the tiny pipeline for `call`, measured once in this process."""
    import accel
    from accel.tune import calibrate_magcache

    key = model + repr(sorted(call.items()))
    if key not in _curves:
        pipe = tiny_pipeline(model)
        handle = accel.apply(pipe, {})
        try:
            _curves[key] = [list(curve) for curve in calibrate_magcache(pipe, handle, call, 0)]
        finally:
            handle.remove()
    return _curves[key]


def output_of(result: Any, pipe: Any = None) -> Any:
    """A pipeline result as one array: frames or images, with the audio samples appended (flattened)
    where the pipeline makes sound (LTX-2; Cosmos 3, whose fields the family of `pipe` names), so every
    comparison of outputs covers both."""
    import numpy as np

    from accel.models.registry import family_of
    from accel.generate import output_array

    output = np.asarray(output_array(result, pipe))
    spec = family_of(pipe).audio if pipe is not None else None
    audio = getattr(result, spec.field if spec is not None else "audio", None)
    if audio is None:
        return output
    return np.concatenate(
        [output.ravel(), np.asarray(audio.float().cpu() if isinstance(audio, torch.Tensor) else audio).ravel()]
    )


def tiny_error(model: str, recipe: dict[str, Any], call: dict[str, Any]) -> str:
    """The one-line error this rank's run of the tiny pipeline under `recipe` stops with."""
    from accel.errors import UserError

    try:
        tiny_run(model, recipe, call)
    except UserError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def held_bytes(model: str, recipe: dict[str, Any], call: dict[str, Any]) -> tuple[int, list[int]]:
    """(bytes of this rank's transformer parameters under `recipe`, the Linear in/out widths of its
    first block's layers) after one call."""
    tiny_run(model, recipe, call)
    pipe = pipeline_for(model, recipe)
    transformer = pipe.transformer
    return sum(p.numel() * p.element_size() for p in transformer.parameters()), [
        m.weight.shape[0] * 10_000 + m.weight.shape[1]
        for m in transformer.transformer_blocks[0].modules()
        if isinstance(m, torch.nn.Linear)
    ]


def split_load_run(folder: str, tp: int, call: dict[str, Any]) -> tuple[Any, int, bool]:
    """(output, bytes of this rank's transformer parameters, whether it came split from the loader)
    of the pipeline saved in `folder`, loaded as this rank's TP slice and run under tp."""
    import torch.distributed as dist

    import accel
    from accel.parallel.tensor import SPLIT_MARK

    pipe = accel.load_pipeline(folder, "float32", tp_slice=(tp, dist.get_rank() % tp))
    pipe.set_progress_bar_config(disable=True)
    came_split = getattr(pipe.transformer, SPLIT_MARK, None) is not None
    held = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
    accel.apply(pipe, {"parallel": {"tp": tp}})
    result = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="np")
    return output_of(result, pipe), held, came_split


def tp_after_quant_error(model: str, call: dict[str, Any]) -> str:
    """The error `accel.apply` gives for tp = 2 on a pipeline quantized by an earlier apply."""
    import accel
    from accel.errors import UserError

    pipe = tiny_pipeline(model, key=f"{model}@quantized")
    accel.apply(pipe, {"quant": {"type": "int8wo"}}).remove()  # quantization stays
    try:
        accel.apply(pipe, {"parallel": {"tp": 2}})
    except UserError as error:
        return str(error)
    return "no error"


def gradient_image(size: int = 64) -> Any:
    """A deterministic RGB test picture for image-to-video pipelines."""
    import numpy as np
    from PIL import Image

    ramp = np.linspace(0, 255, size)
    r, g = np.meshgrid(ramp, ramp)
    return Image.fromarray(np.stack([r, g, 255 - (r + g) / 2], -1).astype(np.uint8))


def wan_per_token_timestep_error(ulysses: int, ring: int) -> float:
    """Max-abs difference, this rank, between the tiny Wan transformer with one timestep per video
    token (Wan 2.2 TI2V) under context parallelism and the same call on one process."""
    from accel.models.registry import FAMILIES
    from accel.parallel.engine import ContextParallel
    from accel.parallel.plan import resolve_plan

    transformer = tiny_pipeline("tiny-wan").transformer
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, 2, 6, 10, generator=generator)  # 2 x 3 x 5 = 30 tokens
    text = torch.randn(1, 512, 32, generator=generator)
    timestep = torch.linspace(0, 999, 30)[None, :]  # (batch, tokens): differs per token
    with torch.no_grad():
        expected = transformer(latents, timestep, text, return_dict=False)[0]
        engine = ContextParallel(
            transformer,
            resolve_plan(FAMILIES["wan"].parallel, transformer),
            build_mesh(Degrees(ulysses=ulysses, ring=ring), "cpu"),
        )
        try:
            got = transformer(latents, timestep, text, return_dict=False)[0]
        finally:
            engine.remove()
    return (got - expected).abs().max().item()


def compiled_attention(
    ulysses: int, ring: int, keys: int, heads: int = 4, pairs: bool = False
) -> tuple[float, int | None]:
    """(max-abs difference of `usp_attention` compiled with fullgraph=True from eager, graphs built by
    a second compiled call) on this rank; `keys` tokens that may not divide the ranks (pad keys);
    `pairs`: under a causal additive (1, heads, N, N) pair mask (-inf above the diagonal)."""
    from accel.optimize.compile import compiled_graphs

    mesh = build_mesh(Degrees(ulysses=ulysses, ring=ring), "cpu")
    layout = SequenceLayout(keys, ulysses * ring)
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, heads, layout.shard, 16, generator=generator) for _ in range(3))
    key_valid = layout.valid()[:, None, :] if layout.pad else None
    groups = (mesh.ulysses_group if ulysses > 1 else None, mesh.ring_group if ring > 1 else None)
    tokens = layout.shard * ulysses * ring
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    mask = (
        torch.randn(1, heads, tokens, tokens, generator=generator).masked_fill(~causal, float("-inf"))
        if pairs
        else None
    )
    extra = (None, None, mask)  # scale, real_keys, pair_mask
    eager = usp_attention(q, k, v, *groups, key_valid, *extra)
    compiled = torch.compile(usp_attention, fullgraph=True)  # any graph break raises
    compiled(q, k, v, *groups, key_valid, *extra)
    before = compiled_graphs()
    out = compiled(q, k, v, *groups, key_valid, *extra)
    after = compiled_graphs()
    return (out - eager).abs().max().item(), (after - before) if after is not None and before is not None else None


def counted_run(
    model: str, recipe: dict[str, Any], call: dict[str, Any], fresh: bool = False
) -> tuple[Any, Any, list[int]]:
    """Two pipeline calls under one `accel.apply`: the second's output and cache records, and the
    graphs torch.compile built during each call. `fresh`: a new pipeline (quantization changes
    one for good), else the process's shared one."""
    import accel
    from accel.optimize.compile import compiled_graphs

    if fresh:
        _pipelines.pop(model, None)
    pipe = tiny_pipeline(model)
    handle = accel.apply(pipe, recipe)
    graphs = []
    try:
        for _ in range(2):
            before = compiled_graphs()
            result = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="np")
            graphs.append((compiled_graphs() or 0) - (before or 0))
        stats = handle.cache_stats
    finally:
        handle.remove()
        if fresh:
            _pipelines.pop(model, None)
    decisions = [(r.step, r.branch, r.cached) for r in stats.records] if stats is not None else None
    return output_of(result, pipe), decisions, graphs


def per_rank_call(
    model: str, recipe: dict[str, Any], calls: list[tuple[tuple[Any, ...], dict[str, Any]]], seeds: list[int]
) -> tuple[str, Any, bool]:
    """Each rank calls the tiny pipeline under `recipe` with its own (args, kwargs) and seed: ("ok",
    output) or ("error", "Type: message"), and whether `remove()` left the pipeline as it was."""
    import numpy as np

    import accel

    pipe = tiny_pipeline(model)
    before = type(pipe)
    rank = dist.get_rank()
    args, kwargs = calls[rank]
    handle = accel.apply(pipe, recipe)
    try:
        result = pipe(*args, **kwargs, generator=torch.Generator().manual_seed(seeds[rank]), output_type="np")
        outcome: tuple[str, Any] = ("ok", np.asarray(result.images))
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        outcome = ("error", f"{type(error).__name__}: {error}")
    finally:
        handle.remove()
    # The pipeline's own call sets attributes (_guidance_scale, …); accel's must all be gone.
    return (*outcome, type(pipe) is before and not {"__call__", "prepare_latents", "_accel_wrapped"} & set(vars(pipe)))


def video_split_errors(ulysses: int, ring: int) -> list[float]:
    """Max-abs difference, this rank, between each Wan-shaped transformer under context parallelism
    and the same call on one process, at 2 latent frames of 5x5 patches: 50 video tokens, which
    3, 4 and 8 ranks do not divide. Wan (one timestep per token, as Wan 2.2 TI2V), Wan VACE (control
    tokens and hints cut with the video), SkyReels-V2 diffusion forcing (one timestep per frame,
    expanded by the transformer to a per-token modulation) and Wan Animate (pose latents added
    before the cut, the face adapter run by latent frame, frames of 25 tokens cut across ranks)."""
    from accel.models.registry import FAMILIES
    from accel.parallel.engine import ContextParallel
    from accel.parallel.plan import resolve_plan

    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, 2, 10, 10, generator=generator)
    text = torch.randn(1, 512, 32, generator=generator)
    calls = {
        "tiny-wan": dict(timestep=torch.linspace(0, 999, 50)[None, :]),
        "accel.models.wan:build_tiny_vace": dict(
            timestep=torch.tensor([500.0]), control_hidden_states=torch.randn(1, 96, 2, 10, 10, generator=generator)
        ),
        "tiny-skyreels2": dict(timestep=torch.tensor([[900.0, 300.0]]), enable_diffusion_forcing=True),
        # 36 channels (noise, mask, reference), a pose latent frame per frame after the first, one face crop.
        "accel.models.wan:build_tiny_animate": dict(
            timestep=torch.tensor([500.0]),
            hidden_states=torch.randn(1, 36, 2, 10, 10, generator=generator),
            pose_hidden_states=torch.randn(1, 16, 1, 10, 10, generator=generator),
            face_pixel_values=torch.randn(1, 3, 1, 16, 16, generator=generator),
        ),
    }
    mesh = build_mesh(Degrees(ulysses=ulysses, ring=ring), "cpu")
    errors = []
    for model, extra in calls.items():
        transformer = tiny_pipeline(model).transformer
        with torch.no_grad():
            call = {"hidden_states": latents, "encoder_hidden_states": text, "return_dict": False, **extra}
            expected = transformer(**call)[0]
            plan = FAMILIES["skyreels2" if "skyreels2" in model else "wan"].plan_for(transformer)
            engine = ContextParallel(transformer, resolve_plan(plan, transformer), mesh)
            try:
                got = transformer(**call)[0]
            finally:
                engine.remove()
        errors.append((got - expected).abs().max().item())
    return errors


def first_rank_encodes_run(
    model: str, parallel: dict[str, int], call: dict[str, Any], placement: str = "rank0"
) -> tuple[Any, list[str], list[str]]:
    """(output, the text encoders this rank still holds, the devices they were on during the call) of
    the tiny pipeline with [memory] text_encoder = `placement` ("rank0" or "cpu") under `parallel`, on
    a copy of its own (the dropped encoders stay dropped)."""
    import torch.distributed as dist

    import accel
    from accel.parallel.encoders import text_encoder_names

    pipe = tiny_pipeline(model, key=f"{model}@{placement}-encodes.{dist.get_rank()}.{sorted(parallel.items())}")
    handle = accel.apply(pipe, {"parallel": parallel, "memory": {"text_encoder": placement}})
    try:
        during = [str(next(getattr(pipe, name).parameters()).device) for name in text_encoder_names(pipe)]
        result = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="np")
    finally:
        handle.remove()
    return output_of(result, pipe), text_encoder_names(pipe), during


def first_rank_loads_run(folder: str, call: dict[str, Any]) -> tuple[Any, bool]:
    """(output, whether this rank loaded a text encoder) of the pipeline saved in `folder`, loaded as
    `accel run` loads it under [memory] text_encoder = "rank0" on ulysses 2, and run so."""
    import accel
    from accel.parallel.encoders import loads_text_encoders

    pipe = accel.load_pipeline(folder, "float32", text_encoders=loads_text_encoders("rank0", 2))
    pipe.set_progress_bar_config(disable=True)
    loaded = pipe.text_encoder is not None
    accel.apply(pipe, {"parallel": {"ulysses": 2}, "memory": {"text_encoder": "rank0"}})
    result = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="np")
    return output_of(result, pipe), loaded


def first_rank_decodes_run(model: str, recipe: dict[str, Any], calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The tiny pipeline (a copy of its own) under `recipe` ([memory] vae = "rank0" or not), each rank
    calling it with its own keywords: ("ok", output or None where the rank returned latents) or
    ("error", "Type: message"), how many times this rank's VAE decoder ran, and whether remove() left
    the pipeline's call unwrapped."""
    import accel
    from accel.hooks import wrappers

    pipe = tiny_pipeline(model, key=f"{model}@vae-placement.{dist.get_rank()}")
    decoded: list[int] = []
    hook = pipe.vae.decoder.register_forward_hook(lambda *_: decoded.append(1))
    handle = accel.apply(pipe, recipe)
    try:
        result = pipe(**calls[dist.get_rank()], generator=torch.Generator().manual_seed(0))
        images = getattr(result, "images", None)
        outcome: tuple[str, Any] = ("ok", output_of(result, pipe) if not isinstance(images, torch.Tensor) else None)
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        outcome = ("error", f"{type(error).__name__}: {error}")
    finally:
        handle.remove()
        hook.remove()
    return {"outcome": outcome, "decodes": len(decoded), "unwrapped": wrappers(pipe, "__call__") == []}


class _HeldVae(torch.nn.Module):
    """A VAE whose weights stand on the "meta" device for a GPU's (gloo ranks have none): moves are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(2, device="meta"))
        self.moves: list[str] = []

    def to(self, device: Any) -> "_HeldVae":  # type: ignore[override]
        self.moves.append(str(device))
        return self


class _Decoding:
    def __init__(self) -> None:
        self.vae = _HeldVae()
        self.asked: list[str] = []

    def __call__(self, prompt: str, output_type: str = "pil") -> str:
        self.asked.append(output_type)
        return output_type


def vae_moves_run() -> dict[str, Any]:
    """OtherRanksSkipDecode on a stand-in pipeline over the job: the output_type each call got, positional
    or keyword, and the VAE's moves while applied and after remove()."""
    from accel.vae.placement import OtherRanksSkipDecode

    pipe = _Decoding()
    placed = OtherRanksSkipDecode(pipe, None)
    pipe("a fox", "np")
    pipe("a fox", output_type="pt")
    applied = list(pipe.vae.moves)
    placed.remove()
    pipe("a fox")
    return {"asked": pipe.asked, "applied": applied, "after": pipe.vae.moves[len(applied) :]}


def sharded_encodes_run(model: str, parallel: dict[str, int], call: dict[str, Any]) -> dict[str, Any]:
    """The tiny pipeline (a copy of its own) with [memory] text_encoder = "sharded" under `parallel`:
    its output and embeddings, which encoders were split, and their parameter bytes on this rank before
    and after the split, whole and of the weights the plan splits (each rank's own slice after)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import accel
    from accel.parallel.encoders import local_bytes, text_encoder_names

    pipe = tiny_pipeline(model, key=f"{model}@sharded.{dist.get_rank()}.{sorted(parallel.items())}")
    names = text_encoder_names(pipe)
    before = {name: local_bytes(getattr(pipe, name)) for name in names}
    handle = accel.apply(pipe, {"parallel": parallel, "memory": {"text_encoder": "sharded"}})
    try:
        with torch.no_grad():
            embeds = pipe.encode_prompt(call["prompt"], device=torch.device("cpu"))[0]
        result = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="np")
    finally:
        handle.remove()
    split = {
        name: {n: p for n, p in getattr(pipe, name).named_parameters() if isinstance(p, DTensor)} for name in names
    }
    return dict(
        output=output_of(result, pipe),
        embeds=embeds,
        before=before,
        after={name: local_bytes(getattr(pipe, name)) for name in names},
        split={name: sorted(params) for name, params in split.items() if params},
        split_local={
            name: sum(p.to_local().numel() * p.element_size() for p in params.values())
            for name, params in split.items()
        },
        split_whole={
            name: sum(p.numel() * p.element_size() for p in params.values()) for name, params in split.items()
        },
    )


def sharded_loads_run(folder: str, call: dict[str, Any]) -> tuple[Any, int, int]:
    """(output, this rank's text encoder parameter bytes, its DTensor count) of the pipeline saved in
    `folder`, loaded as `accel run` loads it under [memory] text_encoder = "sharded" on 2 ranks, and run so."""
    from torch.distributed.tensor import DTensor

    import accel
    from accel.parallel.encoders import local_bytes

    pipe = accel.load_pipeline(folder, "float32", text_encoders_tp=2)
    pipe.set_progress_bar_config(disable=True)
    held = local_bytes(pipe.text_encoder)
    split = sum(isinstance(p, DTensor) for p in pipe.text_encoder.parameters())
    accel.apply(pipe, {"parallel": {"ulysses": 2}, "memory": {"text_encoder": "sharded"}})
    result = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="np")
    return output_of(result, pipe), held, split


def sibling_run(
    model: str, pipeline_class: str, recipe: dict[str, Any], call: dict[str, Any], attached: bool = True, seed: int = 0
) -> tuple[Any, Any]:
    """(output, cache records) of `pipeline_class` built from the tiny pipeline's modules (from_pipe):
    attached to the tiny pipeline's `accel.apply(pipe, recipe)` (the server's way), or, with `attached`
    False, accelerated by an apply of its own. Everything undone afterwards."""
    import diffusers

    import accel

    base = tiny_pipeline(model)
    sibling = getattr(diffusers, pipeline_class).from_pipe(base)
    sibling.set_progress_bar_config(disable=True)
    handle = accel.apply(base, recipe) if attached else accel.apply(sibling, recipe)
    try:
        if attached:
            handle.attach(sibling)
        result = sibling(**call, generator=torch.Generator().manual_seed(seed), output_type="np")
        stats = handle.cache_stats
    finally:
        handle.remove()
    decisions = [(r.step, r.branch, r.change, r.cached) for r in stats.records] if stats is not None else None
    return output_of(result, sibling), decisions
