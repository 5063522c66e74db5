"""First Block Cache: what a cached transformer call costs, and what `accel.apply` costs when off.

Prints ratios measured side by side in one process (absolute times on a shared machine mean
little):

1. On a deep FLUX-class transformer (real diffusers class, random weights, ≥ 16 blocks): a cached
   call ÷ a full call, beside the ideal (one block ÷ all blocks, by count and by measured time).
2. tiny-flux: `accel.apply(pipe, {})` (everything off) ÷ the raw pipeline (target ≤ 1.02), and the
   cache wrappers installed at threshold 0 (never caching) ÷ raw, which is their pure overhead.

    python benchmarks/fbcache.py [--tokens 1024] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from timing import median_time


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median of each, alternating between them so drift in machine load hits all alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


@torch.no_grad()
def deep_transformer(tokens: int, repeats: int) -> None:
    from diffusers import FluxTransformer2DModel

    from accel.cache.fbcache import FirstBlockCache
    from accel.models.flux import FAMILY

    torch.manual_seed(0)
    double, single = 4, 16
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=64,
        num_attention_heads=4,
        joint_attention_dim=64,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(16, 24, 24),
    ).eval()
    text = 64
    side = int(tokens**0.5)
    inputs = dict(
        hidden_states=torch.randn(1, tokens, 16),
        encoder_hidden_states=torch.randn(1, text, 64),
        pooled_projections=torch.randn(1, 32),
        timestep=torch.tensor([0.5]),
        guidance=torch.tensor([3.5]),
        img_ids=torch.stack(
            torch.meshgrid(
                torch.zeros(1), torch.arange(side).float(), torch.arange(tokens // side).float(), indexing="ij"
            ),
            -1,
        )
        .reshape(-1, 3)
        .float(),
        txt_ids=torch.zeros(text, 3),
        return_dict=False,
    )
    temb = model.time_text_embed(inputs["timestep"] * 1000, inputs["guidance"] * 1000, inputs["pooled_projections"])
    image = model.x_embedder(inputs["hidden_states"])
    context = model.context_embedder(inputs["encoder_hidden_states"])
    rotary = model.pos_embed(torch.cat([inputs["txt_ids"], inputs["img_ids"]]))
    block0 = model.transformer_blocks[0]

    full = median_time(lambda: model(**inputs), repeats)
    first_only = median_time(lambda: block0(image, context, temb, rotary), repeats)
    cache = FirstBlockCache(model, FAMILY.blocks, threshold=1e9)
    model(**inputs)  # computes and fills the cache
    cached = median_time(lambda: model(**inputs), repeats)
    assert cache.stats.cached == cache.stats.calls - 1, "every call after the first must be cached"
    cache.remove()

    blocks = double + single
    print(f"deep FLUX-class transformer: {double} double + {single} single blocks, {tokens} image + {text} text tokens")
    print(f"  full call                        {full * 1e3:8.2f} ms")
    print(f"  cached call                      {cached * 1e3:8.2f} ms")
    print(f"  cached ÷ full                    {cached / full:8.3f}")
    print(f"  ideal by count (1 ÷ {blocks} blocks)   {1 / blocks:8.3f}")
    print(f"  ideal by time (block 0 ÷ full)   {first_only / full:8.3f}")


@torch.no_grad()
def apply_overhead(repeats: int) -> None:
    import accel
    from accel.cache.fbcache import FirstBlockCache
    from accel.models.flux import FAMILY

    pipe = accel.load_pipeline("tiny-flux")
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt="a fox", height=64, width=64, num_inference_steps=4, output_type="np")

    def call() -> object:
        return pipe(**kwargs, generator=torch.Generator().manual_seed(0))

    raw = median_time(call, repeats)
    handle = accel.apply(pipe, {})
    off = median_time(call, repeats)
    handle.remove()
    cache = FirstBlockCache(pipe.transformer, FAMILY.blocks, threshold=0.0)
    wrapped = median_time(call, repeats)
    cache.remove()
    again = median_time(call, repeats)
    baseline = (raw + again) / 2
    print("tiny-flux pipeline call (4 steps, 64×64)")
    print(
        f"  raw pipeline                     {baseline * 1e3:8.2f} ms  (before {raw * 1e3:.2f}, after "
        f"{again * 1e3:.2f})"
    )
    print(f"  accel.apply, everything off ÷ raw {off / baseline:7.3f}   (target ≤ 1.02)")
    print(f"  cache wrappers at threshold 0 ÷ raw {wrapped / baseline:5.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024, help="image tokens of the deep transformer")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    deep_transformer(args.tokens, args.repeats)
    apply_overhead(args.repeats)


if __name__ == "__main__":
    main()
