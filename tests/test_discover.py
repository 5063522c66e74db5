"""Finding a transformer's repeated blocks from the model itself (accel/models/discover.py, issue 34).

Four checks: on every accel family's tiny pipeline, discovery gives the family's hand-declared block
lists (or differs where the test says why, exactly), and the record the generic path learns with one
probe call is the family's own but for what a family adds by hand; on diffusers DiT transformers no family
describes, built tiny from their classes, it finds the lists configured; a module with no repeated
blocks is refused in one line.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may reach a model hub

from collections.abc import Callable  # noqa: E402
from dataclasses import replace  # noqa: E402
from typing import Any  # noqa: E402

import diffusers  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import ModelMixin  # noqa: E402
from diffusers.configuration_utils import ConfigMixin  # noqa: E402
from torch import nn  # noqa: E402

from accel.errors import UserError  # noqa: E402
from accel.models.base import BlockList  # noqa: E402
from accel.models.discover import Discovery, FoundList, discover_blocks, order_by_call  # noqa: E402
from accel.models.registry import FAMILIES  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

_PIPES: dict[str, Any] = {}


def _pipe(name: str, request: pytest.FixtureRequest) -> Any:
    """The family's tiny pipeline, built once per module (FLUX and Wan from the session's fixtures)."""
    if name in ("flux", "wan"):
        return request.getfixturevalue(f"tiny_{name}")
    if name not in _PIPES:
        _PIPES[name] = FAMILIES[name].tiny()  # type: ignore[misc]
    return _PIPES[name]


NO_ENTRY = "diffusers' block registry has no entry for {}"

# Lists discovery finds that a family does not declare, which run before the family's first list on
# one stream alone: Z-Image refines the image tokens and the text tokens apart before it joins them
# for `layers`; Kandinsky 5 encodes the text once per call before its visual blocks. The family's
# cache and plan work on the joined / visual stream only; the generic path must pick the same by
# probing (which list's output becomes the transformer's output).
EXTRA_LISTS: dict[str, tuple[str, ...]] = {
    "zimage": ("noise_refiner", "context_refiner"),
    "kandinsky5": ("text_transformer_blocks",),
    "kandinsky6": ("video_text_transformer_blocks", "audio_text_transformer_blocks"),
}

# Where what a block returns is not read from diffusers' registry (left to the probe), and why.
UNKNOWN_RETURNS: dict[str, str] = {
    "hunyuan15": NO_ENTRY.format("HunyuanVideo15TransformerBlock"),
    "skyreels2": NO_ENTRY.format("SkyReelsV2TransformerBlock"),
    "ltx2": NO_ENTRY.format("LTX2VideoTransformerBlock"),
    # ChronoEdit's module defines its own WanTransformerBlock, which diffusers' registry (keyed by class) lacks.
    "chronoedit": NO_ENTRY.format("WanTransformerBlock"),
    "qwenimage21": NO_ENTRY.format("QwenImage21TransformerBlock"),
    "helios": NO_ENTRY.format("HeliosTransformerBlock"),
    "kandinsky6": NO_ENTRY.format("Kandinsky6FusedTransformerDecoderBlock"),
    # diffusers registers Z-Image's block with the default argument name, but its forward takes `x`.
    "zimage": "diffusers' block registry names 'hidden_states', which ZImageTransformerBlock.forward does not take",
}

# Where the forward's source does not name the block list (it runs it from a helper), so discovery
# orders the lists by definition, and why that is the same order.
DEFINITION_ORDER: dict[str, str] = {
    "cosmos3": "Cosmos3OmniTransformer runs `layers` from _run_decoder_stack; one list, nothing to order"
}

# FLUX.2's single blocks run on text then image joined into one tensor: the family's `joins` says so,
# diffusers' registry (index 0 is the hidden states, no encoder output) cannot.
NO_JOINS = ("flux2", "flux2-klein")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_blocks_are_discovered(name: str, request: pytest.FixtureRequest) -> None:
    family = FAMILIES[name]
    pipe = _pipe(name, request)
    transformers = [getattr(pipe, attr) for attr in family.transformer_attrs if getattr(pipe, attr, None) is not None]
    assert transformers
    for transformer in transformers:
        found = discover_blocks(transformer)
        assert found.order == ("definition" if name in DEFINITION_ORDER else "forward source")
        assert found.transformer_class == type(transformer).__name__
        extra = EXTRA_LISTS.get(name, ())
        assert found.attrs == extra + tuple(block.attr for block in family.blocks)
        for item in found.lists:
            assert item.count == len(transformer.get_submodule(item.attr)) == 2
            assert item.found_by == (
                "_no_split_modules" if name in ("cogvideox", "mochi", "sd3") else "_repeated_blocks"
            )
        lists = {item.attr: item for item in found.lists}
        for block in family.blocks:
            item = lists[block.attr]
            if name in UNKNOWN_RETURNS:
                assert (item.returns, item.unknown) == (None, UNKNOWN_RETURNS[name])
                assert item.block_list() is None
            elif name in NO_JOINS and block.joins:
                assert item.block_list() == replace(block, joins=())
            else:
                assert (item.block_list(), item.unknown) == (block, "")
        if name not in UNKNOWN_RETURNS and name not in NO_JOINS and not extra:
            assert found.block_lists() == family.blocks


# What a tested family states by hand beyond what the generic path learns: its plans, how its pipeline
# runs guidance, its heads' config key, its processors. Not learned: the pipeline attributes of
# experts the tiny pipeline lacks (Wan 2.2's transformer_2).
HAND_ONLY = (
    "parallel",
    "tensor",
    "cfg",
    "cfg_scale",
    "cfg_above",
    "cfg_needs_negative",
    "cfg_outputs_vary",
    "cfg_output_like",
    "heads_key",
    "heads_of_config",
    "processors",
)
# The stream the cache compares, where the learned one (the first a block returns) would not do: Cosmos 3's
# first is its text, which attends only to itself and so is the same at every step; the family compares
# its generation stream (video and sound).
HAND_PRIMARY: dict[str, str] = {"cosmos3": "gen_seq"}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_tested_family_is_the_learned_record_with_overrides(name: str, request: pytest.FixtureRequest) -> None:
    from accel.models.generic import learned_acceleration

    family, pipe = FAMILIES[name], _pipe(name, request)
    pipe.set_progress_bar_config(disable=True)
    learned = learned_acceleration(pipe, pipe.transformer)
    assert learned.learned and learned.transformer_attrs == tuple(
        attr for attr in family.transformer_attrs if getattr(pipe, attr, None) is not None
    )
    overrides = {field: getattr(family.acceleration, field) for field in HAND_ONLY}
    if name in HAND_PRIMARY:
        assert (learned.primary_stream, family.primary_stream) == (family.blocks[0].returns[0], HAND_PRIMARY[name])
        overrides["primary_stream"] = family.primary_stream
    assert (
        replace(learned, **overrides, learned=False, transformer_attrs=family.transformer_attrs) == family.acceleration
    )


def _flux_like(**extra: Any) -> dict[str, Any]:
    return dict(num_attention_heads=2, attention_head_dim=16, **extra)


# diffusers transformers no accel family describes, from small configs: (class, config, expected
# lists as (attr, block class, count, found by, returns)), each list configured to a count of its own.
OUTSIDE: dict[str, tuple[dict[str, Any], tuple[tuple[str, str, int, str, tuple[str, ...] | None], ...]]] = {
    "MotifVideoTransformer3DModel": (
        _flux_like(
            num_layers=2, num_single_layers=3, text_embed_dim=32, rope_axes_dim=(4, 6, 6), in_channels=8, out_channels=8
        ),
        (
            (
                "transformer_blocks",
                "MotifVideoTransformerBlock",
                2,
                "_repeated_blocks",
                ("hidden_states", "encoder_hidden_states"),
            ),
            (
                "single_transformer_blocks",
                "MotifVideoSingleTransformerBlock",
                3,
                "_repeated_blocks",
                ("hidden_states", "encoder_hidden_states"),
            ),
        ),
    ),
    # AnyFlow's own Wan-shaped block, which the registry lacks (Helios, formerly here, is a family now).
    "AnyFlowTransformer3DModel": (
        _flux_like(text_dim=32, ffn_dim=64, num_layers=4, freq_dim=32),
        (("blocks", "AnyFlowTransformerBlock", 4, "_repeated_blocks", None),),
    ),
    "BriaFiboTransformer2DModel": (
        _flux_like(
            num_layers=2,
            num_single_layers=3,
            joint_attention_dim=32,
            axes_dims_rope=[4, 6, 6],
            text_encoder_dim=32,
            in_channels=8,
        ),
        (
            ("transformer_blocks", "BriaFiboTransformerBlock", 2, "_repeated_blocks", None),
            ("single_transformer_blocks", "BriaFiboSingleTransformerBlock", 3, "_repeated_blocks", None),
        ),
    ),
    # PRX and Allegro declare neither _repeated_blocks nor _no_split_modules: found by structure.
    "PRXTransformer2DModel": (
        dict(hidden_size=32, num_heads=2, depth=3, context_in_dim=32, axes_dim=[8, 8], in_channels=4),
        (("blocks", "PRXBlock", 3, "structure", None),),
    ),
    "AllegroTransformer3DModel": (
        _flux_like(
            num_layers=3, cross_attention_dim=32, caption_channels=32, sample_height=8, sample_width=8, sample_frames=2
        ),
        (("transformer_blocks", "AllegroTransformerBlock", 3, "structure", None),),
    ),
    # Lumina 2 defines noise_refiner before context_refiner but runs the text refiner first.
    "Lumina2Transformer2DModel": (
        dict(
            hidden_size=32,
            num_layers=3,
            num_refiner_layers=1,
            num_attention_heads=2,
            num_kv_heads=2,
            multiple_of=16,
            axes_dim_rope=(4, 6, 6),
            cap_feat_dim=32,
            in_channels=4,
        ),
        (
            ("context_refiner", "Lumina2TransformerBlock", 1, "_no_split_modules", None),
            ("noise_refiner", "Lumina2TransformerBlock", 1, "_no_split_modules", None),
            ("layers", "Lumina2TransformerBlock", 3, "_no_split_modules", None),
        ),
    ),
    # HiDream declares its inner block classes, but its lists hold HiDreamBlock wrappers: found by structure.
    "HiDreamImageTransformer2DModel": (
        _flux_like(
            num_layers=2,
            num_single_layers=3,
            caption_channels=[32, 32],
            text_emb_dim=32,
            num_routed_experts=2,
            num_activated_experts=1,
            axes_dims_rope=(8, 8),
            llama_layers=[0, 1],
            in_channels=4,
            patch_size=2,
        ),
        (
            ("double_stream_blocks", "HiDreamBlock", 2, "structure", None),
            ("single_stream_blocks", "HiDreamBlock", 3, "structure", None),
        ),
    ),
    "SanaTransformer2DModel": (
        _flux_like(
            num_layers=3,
            num_cross_attention_heads=2,
            cross_attention_head_dim=16,
            cross_attention_dim=32,
            caption_channels=32,
            in_channels=4,
            out_channels=4,
            sample_size=8,
        ),
        (("transformer_blocks", "SanaTransformerBlock", 3, "_no_split_modules", None),),
    ),
    "PixArtTransformer2DModel": (
        _flux_like(
            num_layers=3, cross_attention_dim=32, caption_channels=32, in_channels=4, out_channels=8, sample_size=8
        ),
        (("transformer_blocks", "BasicTransformerBlock", 3, "_no_split_modules", ("hidden_states",)),),
    ),
    "CogView4Transformer2DModel": (
        _flux_like(
            num_layers=3,
            text_embed_dim=32,
            time_embed_dim=16,
            condition_dim=8,
            rope_axes_dim=(8, 8),
            pos_embed_max_size=16,
            sample_size=8,
        ),
        (
            (
                "transformer_blocks",
                "CogView4TransformerBlock",
                3,
                "_no_split_modules",
                ("hidden_states", "encoder_hidden_states"),
            ),
        ),
    ),
    "ChromaTransformer2DModel": (
        _flux_like(
            num_layers=2,
            num_single_layers=3,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
            approximator_num_channels=8,
            approximator_hidden_dim=32,
            approximator_layers=2,
            in_channels=8,
        ),
        (
            ("transformer_blocks", "ChromaTransformerBlock", 2, "_repeated_blocks", None),
            ("single_transformer_blocks", "ChromaSingleTransformerBlock", 3, "_repeated_blocks", None),
        ),
    ),
    "AuraFlowTransformer2DModel": (
        _flux_like(
            num_mmdit_layers=2,
            num_single_dit_layers=3,
            joint_attention_dim=32,
            caption_projection_dim=32,
            sample_size=8,
            pos_embed_max_size=64,
        ),
        (
            ("joint_transformer_blocks", "AuraFlowJointTransformerBlock", 2, "_no_split_modules", None),
            ("single_transformer_blocks", "AuraFlowSingleTransformerBlock", 3, "_no_split_modules", None),
        ),
    ),
    "CosmosTransformer3DModel": (
        _flux_like(
            num_layers=3,
            text_embed_dim=32,
            adaln_lora_dim=8,
            max_size=(4, 16, 16),
            encoder_hidden_states_channels=32,
            crossattn_proj_in_channels=32,
        ),
        (("transformer_blocks", "CosmosTransformerBlock", 3, "_no_split_modules", None),),
    ),
}


def _build(class_name: str) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return getattr(diffusers, class_name)(**OUTSIDE[class_name][0]).eval()


@pytest.mark.parametrize("class_name", list(OUTSIDE))
def test_outside_transformers_are_discovered(class_name: str) -> None:
    found = discover_blocks(_build(class_name))
    assert found.transformer_class == class_name
    assert found.order == "forward source"
    expected = OUTSIDE[class_name][1]
    assert [(f.attr, f.block_class, f.count, f.found_by, f.returns) for f in found.lists] == list(expected)
    for item in found.lists:
        assert item.unknown == ("" if item.returns is not None else NO_ENTRY.format(item.block_class))


def test_order_by_call_confirms_lumina2_runs_text_refiner_first() -> None:
    transformer = _build("Lumina2Transformer2DModel")
    generator = torch.Generator().manual_seed(0)

    def call() -> Any:
        with torch.no_grad():
            return transformer(
                hidden_states=torch.randn(1, 4, 8, 8, generator=generator),
                timestep=torch.tensor([0.5]),
                encoder_hidden_states=torch.randn(1, 5, 32, generator=generator),
                encoder_attention_mask=torch.ones(1, 5, dtype=torch.bool),
            )

    order = order_by_call(transformer, call)
    assert order == ("context_refiner", "noise_refiner", "layers") == discover_blocks(transformer).attrs
    assert not any(block._forward_pre_hooks for block in transformer.modules())  # hooks removed


# Toy transformers for what no diffusers class shows.


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x)


class HelperRun(ModelMixin, ConfigMixin):
    """Two undeclared block lists defined in one order, run in the other from a helper method: the
    forward's source names neither, so only a call can tell."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.ModuleList([_Block(), _Block()])
        self.early = nn.ModuleList([_Block(), _Block(), _Block()])

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.early, *self.late]:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x)


def test_order_unknown_from_source_is_learned_by_call() -> None:
    transformer = HelperRun()
    found = discover_blocks(transformer)
    assert found == Discovery(
        "HelperRun",
        (
            FoundList("late", "_Block", 2, "structure", None, NO_ENTRY.format("_Block")),
            FoundList("early", "_Block", 3, "structure", None, NO_ENTRY.format("_Block")),
        ),
        "definition",
    )
    order = order_by_call(transformer, lambda: transformer(torch.ones(1, 4)))
    assert order == ("early", "late")
    ordered = found.ordered(order)
    assert (ordered.attrs, ordered.order) == (("early", "late"), "call")
    assert found.block_lists() is None


class Staged(ModelMixin, ConfigMixin):
    """Declared blocks in lists nested one level down (stages of a list), beside a list of plain layers."""

    _repeated_blocks = ["_Block"]

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm(4), nn.LayerNorm(4)])
        self.stages = nn.ModuleList([nn.ModuleList([_Block(), _Block()]), nn.ModuleList([_Block()])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return x


def test_nested_lists_are_found_and_their_order_taken_from_definition() -> None:
    found = discover_blocks(Staged())
    # Both lists sit under `stages`: the forward's source names only that, so it cannot order them.
    assert found == Discovery(
        "Staged",
        (
            FoundList("stages.0", "_Block", 2, "_repeated_blocks", None, NO_ENTRY.format("_Block")),
            FoundList("stages.1", "_Block", 1, "_repeated_blocks", None, NO_ENTRY.format("_Block")),
        ),
        "definition",
    )


class NoBlocks(ModelMixin, ConfigMixin):
    """A transformer-like model with one attention and a list of plain layers, none repeated blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()
        self.heads = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


class DeclaredMissing(NoBlocks):
    """Declares block classes it does not hold in any list."""

    _repeated_blocks = ["MissingBlock"]
    _no_split_modules = ["MissingBlock", "PatchEmbed"]


REFUSALS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "undeclared": (
        NoBlocks,
        "NoBlocks has no repeated blocks: no _repeated_blocks or _no_split_modules, "
        "and no module list of two or more blocks of one class holding an attention",
    ),
    "declared": (
        DeclaredMissing,
        "DeclaredMissing has no repeated blocks: no module list of its declared blocks "
        "(MissingBlock, PatchEmbed), and no module list of two or more blocks of one class holding an attention",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_no_repeated_blocks_is_refused_in_one_line(case: str) -> None:
    build, message = REFUSALS[case]
    with pytest.raises(UserError) as caught:
        discover_blocks(build())
    assert str(caught.value) == message
    assert "\n" not in message


def test_block_list_of_a_known_list() -> None:
    found = FoundList("blocks", "B", 2, "_repeated_blocks", ("hidden_states",))
    assert found.block_list() == BlockList("blocks", returns=("hidden_states",))
