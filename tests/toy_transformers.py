"""Small transformers shaped like the families' (block lists, return conventions), for cache tests."""

from __future__ import annotations

import torch
from torch import nn

from accel.models.base import BlockList
from accel.parallel.plan_format import ParallelPlan, SequenceSplit

# FLUX.1's plan as accel wrote it by hand before deriving it from diffusers' _cp_plan: the reference
# the derived plan is tested against, and a plan for toy modules that have no _cp_plan of their own.
FLUX_HAND_PLAN = ParallelPlan(
    splits=(
        SequenceSplit("hidden_states", "image"),
        SequenceSplit("img_ids", "image"),
        SequenceSplit("encoder_hidden_states", "text"),
        SequenceSplit("txt_ids", "text"),
        SequenceSplit("controlnet_block_samples", "image", dim=1),
        SequenceSplit("controlnet_single_block_samples", "image", dim=1),
    ),
    attention_keys=("text", "image"),
    output_stream="image",
)


class _Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0


class DoubleStreamBlock(_Counted):
    """FLUX double block: separate image and text streams, returns (text, image)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.image = nn.Linear(dim, dim)
        self.text = nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        mixed = hidden_states.mean(1, keepdim=True) + encoder_hidden_states.mean(1, keepdim=True)
        hidden = hidden_states + torch.tanh(self.image(hidden_states + mixed) + temb)
        text = encoder_hidden_states + torch.tanh(self.text(encoder_hidden_states + mixed) + temb)
        return text, hidden


class SingleStreamBlock(_Counted):
    """FLUX single block: text concatenated before the image tokens inside, returns (text, image)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        text_len = encoder_hidden_states.shape[1]
        joint = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        joint = joint + torch.tanh(self.proj(joint) + temb)
        return joint[:, :text_len], joint[:, text_len:]


class TwoListTransformer(nn.Module):
    """Double blocks called by keyword, single blocks positionally (both happen in diffusers)."""

    block_lists = (
        BlockList("transformer_blocks", returns=("encoder_hidden_states", "hidden_states")),
        BlockList("single_transformer_blocks", returns=("encoder_hidden_states", "hidden_states")),
    )

    def __init__(self, dim: int = 8, double: int = 3, single: int = 3) -> None:
        super().__init__()
        self.transformer_blocks = nn.ModuleList(DoubleStreamBlock(dim) for _ in range(double))
        self.single_transformer_blocks = nn.ModuleList(SingleStreamBlock(dim) for _ in range(single))
        self.out = nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, temb):  # type: ignore[no-untyped-def]
        for block in self.transformer_blocks:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, temb=temb
            )
        for block in self.single_transformer_blocks:
            encoder_hidden_states, hidden_states = block(hidden_states, encoder_hidden_states, temb)
        return self.out(hidden_states)


class CrossAttentionBlock(_Counted):
    """Wan / LTX block: text is read-only context, returns the video stream alone."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        context = encoder_hidden_states.mean(1, keepdim=True)
        return hidden_states + torch.tanh(self.proj(hidden_states + context) + temb)


class SingleTensorTransformer(nn.Module):
    block_lists = (BlockList("blocks", returns=("hidden_states",)),)

    def __init__(self, dim: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(CrossAttentionBlock(dim) for _ in range(depth))

    def forward(self, hidden_states, encoder_hidden_states, temb):  # type: ignore[no-untyped-def]
        for block in self.blocks:
            hidden_states = block(hidden_states, encoder_hidden_states, temb)
        return hidden_states


class JointBlock(DoubleStreamBlock):
    """CogVideoX / Mochi block: returns (image, text), the other order from FLUX."""

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None):  # type: ignore[no-untyped-def]
        text, hidden = super().forward(hidden_states, encoder_hidden_states, temb)
        return hidden, text


class JointTransformer(nn.Module):
    block_lists = (BlockList("transformer_blocks", returns=("hidden_states", "encoder_hidden_states")),)

    def __init__(self, dim: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.transformer_blocks = nn.ModuleList(JointBlock(dim) for _ in range(depth))

    def forward(self, hidden_states, encoder_hidden_states, temb):  # type: ignore[no-untyped-def]
        for block in self.transformer_blocks:
            hidden_states, encoder_hidden_states = block(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, temb=temb
            )
        return torch.cat([encoder_hidden_states, hidden_states], dim=1)


def all_blocks(model: nn.Module) -> list[nn.Module]:
    return [block for spec in model.block_lists for block in getattr(model, spec.attr)]


def inputs(seed: int, batch: int = 2, image: int = 6, text: int = 3, dim: int = 8) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, image, dim, generator=generator),
        torch.randn(batch, text, dim, generator=generator),
        torch.randn(batch, 1, dim, generator=generator),
    )


def flux_plan_outputs(ring: int, ulysses: int) -> list[torch.Tensor]:
    """tiny-flux's transformer output on this rank, at 15 image and 7 text tokens (no world size
    here divides either), under FLUX_HAND_PLAN and under the plan derived from diffusers' _cp_plan,
    and on one process: [hand, derived, single]."""
    from accel.models.registry import FAMILIES
    from accel.parallel.mesh import Degrees, build_mesh
    from accel.parallel.engine import ContextParallel
    from accel.parallel.plan import resolve_plan
    from parallel_cases import tiny_pipeline

    transformer = tiny_pipeline("tiny-flux").transformer
    generator = torch.Generator().manual_seed(0)
    config = transformer.config
    call = dict(
        hidden_states=torch.randn(1, 15, config.in_channels, generator=generator),
        encoder_hidden_states=torch.randn(1, 7, config.joint_attention_dim, generator=generator),
        pooled_projections=torch.randn(1, config.pooled_projection_dim, generator=generator),
        timestep=torch.tensor([0.5]),
        img_ids=torch.stack(
            torch.meshgrid(torch.zeros(1), torch.arange(3.0), torch.arange(5.0), indexing="ij"), -1
        ).reshape(15, 3),
        txt_ids=torch.zeros(7, 3),
        guidance=torch.tensor([3.5]),
        return_dict=False,
    )
    mesh = build_mesh(Degrees(ulysses=ulysses, ring=ring), "cpu")
    outputs = []
    with torch.no_grad():
        for plan in (FLUX_HAND_PLAN, FAMILIES["flux"].parallel):
            engine = ContextParallel(transformer, resolve_plan(plan, transformer), mesh)
            try:
                outputs.append(transformer(**call)[0])
            finally:
                engine.remove()
        outputs.append(transformer(**call)[0])
    return outputs


class _SelfAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)  # 2 heads
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


class DualAttentionBlock(nn.Module):
    """SD 3.5 medium's shape: joint attention over (text, image), then attention over the image alone."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = _SelfAttention(dim)
        self.attn2 = _SelfAttention(dim)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        image_table, text_table = tables  # position data per token, as a rotary table is
        joint = self.attn(torch.cat([encoder_hidden_states + text_table, hidden_states + image_table], 1))
        text, image = joint.split([encoder_hidden_states.shape[1], hidden_states.shape[1]], 1)
        return encoder_hidden_states + text, hidden_states + image + self.attn2(hidden_states + image)


class DualAttentionModel(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([DualAttentionBlock(dim) for _ in range(2)])
        # Returns (image table, text table), as Qwen-Image's rotary module does: a per-item split.
        self.tables = _Tables()

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        tables = self.tables(hidden_states.shape[1], encoder_hidden_states.shape[1])
        for block in self.blocks:
            encoder_hidden_states, hidden_states = block(hidden_states, encoder_hidden_states, tables)
        return hidden_states


class _Tables(nn.Module):
    def forward(self, image: int, text: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.arange(image, dtype=torch.float32)[:, None] / image, -torch.arange(text, dtype=torch.float32)[
            :, None
        ] / text


DUAL_ATTENTION_PLAN = ParallelPlan(
    splits=(
        SequenceSplit("output", "image", dim=0, module="tables", element=0),
        SequenceSplit("output", "text", dim=0, module="tables", element=1),
        SequenceSplit("hidden_states", "image", dim=1, module="blocks.0"),
        SequenceSplit("encoder_hidden_states", "text", dim=1, module="blocks.0"),
    ),
    attention_keys=("text", "image"),
    output_stream="image",
    output_dim=1,
    module_keys=(("blocks.*.attn2", ("image",)),),
)


def dual_attention_error(ulysses: int, ring: int, image: int = 7, text: int = 5) -> float:
    """Max-abs difference of DualAttentionModel under DUAL_ATTENTION_PLAN from one process, this rank."""
    from accel.parallel.mesh import Degrees, build_mesh
    from accel.parallel.engine import ContextParallel

    torch.manual_seed(0)
    model = DualAttentionModel()
    inputs = (torch.randn(1, image, 8), torch.randn(1, text, 8))
    with torch.no_grad():
        expected = model(*inputs)
        engine = ContextParallel(model, DUAL_ATTENTION_PLAN, build_mesh(Degrees(ulysses=ulysses, ring=ring), "cpu"))
        try:
            got = model(*inputs)
        finally:
            engine.remove()
    return (got - expected).abs().max().item()


class _Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = _SelfAttention(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x)


class UnifiedModel(nn.Module):
    """Z-Image's shape: the sequence its layers run on (image then text) is built inside the
    forward, and a ControlNet's {layer index: residual} mapping is added after those layers."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(dim) for _ in range(2)])

    def forward(
        self, image: torch.Tensor, text: torch.Tensor, residuals: dict[int, torch.Tensor] | None = None
    ) -> torch.Tensor:
        x = torch.cat([image, text], dim=1)
        for index, layer in enumerate(self.layers):
            x = layer(x)
            if residuals is not None and index in residuals:
                x = x + residuals[index]
        return x


def unified_plan(at: str) -> ParallelPlan:
    """UnifiedModel's plan: the residuals cut at the forward (at "") or where layers.0 starts."""
    return ParallelPlan(
        splits=(
            SequenceSplit("x", "unified", dim=1, module="layers.0"),
            SequenceSplit("residuals", "unified", dim=1, at=at),
        ),
        attention_keys=("unified",),
        output_stream="unified",
        output_dim=1,
    )


def residual_mapping_error(ulysses: int, ring: int, at: str, image: int = 7, text: int = 6) -> float:
    """Max-abs difference of UnifiedModel with residuals {0: r0, 1: r1} under `unified_plan(at)` from
    one process, this rank (13 tokens: no world divides them)."""
    from accel.parallel.mesh import Degrees, build_mesh
    from accel.parallel.engine import ContextParallel

    torch.manual_seed(0)
    model = UnifiedModel()
    image_tokens, text_tokens = torch.randn(1, image, 8), torch.randn(1, text, 8)
    residuals = {0: torch.randn(1, image + text, 8), 1: torch.randn(1, image + text, 8)}
    with torch.no_grad():
        expected = model(image_tokens, text_tokens, residuals)
        engine = ContextParallel(model, unified_plan(at), build_mesh(Degrees(ulysses=ulysses, ring=ring), "cpu"))
        try:
            got = model(image_tokens, text_tokens, residuals)
        finally:
            engine.remove()
    assert sorted(residuals) == [0, 1] and all(
        r.shape[1] == image + text for r in residuals.values()
    )  # the caller's, untouched
    return (got - expected).abs().max().item()
