"""Learning what blocks return from one call (accel/models/probe.py, issue 34): with diffusers'
registry answers erased, one one-step call of every family's tiny pipeline names each block
output exactly as the family declares it by hand; a transformer outside the families (Lumina2,
which the registry lacks) is learned the same way; what cannot be learned says why."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may reach a model hub

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from test_discover import _build  # noqa: E402
from families import FAMILY_CASES  # noqa: E402
from torch import nn  # noqa: E402

from accel.models.discover import Discovery, FoundList, discover_blocks  # noqa: E402
from accel.models.probe import probe_returns  # noqa: E402
from accel.models.registry import FAMILIES  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def erased(found: Discovery) -> Discovery:
    """The discovery as if diffusers' registry knew none of the blocks."""
    return replace(found, lists=tuple(replace(item, returns=None, unknown="") for item in found.lists))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_one_call_names_every_block_output_as_the_family_declares_it(name: str, request: pytest.FixtureRequest) -> None:
    family = FAMILIES[name]
    pipe = request.getfixturevalue(f"tiny_{name}") if name in ("flux", "wan") else family.tiny()
    pipe.set_progress_bar_config(disable=True)
    transformer = getattr(pipe, family.transformer_attrs[0])
    call = dict(
        FAMILY_CASES[name].call, num_inference_steps=2, output_type="latent"
    )  # one step: some schedulers refuse
    probed = probe_returns(
        transformer,
        erased(discover_blocks(transformer)),
        lambda: pipe(**call, generator=torch.Generator().manual_seed(0)),
    )
    lists = {item.attr: item for item in probed.lists}
    for block in family.blocks:
        assert (lists[block.attr].returns, lists[block.attr].unknown) == (block.returns, ""), block.attr
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in transformer.modules()), (
        "hooks removed"
    )


def test_a_transformer_outside_the_families_is_learned_and_one_block_lists_say_why() -> None:
    transformer = _build("Lumina2Transformer2DModel")  # diffusers' registry has no Lumina2 entry
    generator = torch.Generator().manual_seed(0)
    found = discover_blocks(transformer)
    assert all(item.returns is None for item in found.lists)
    probed = probe_returns(
        transformer,
        found,
        lambda: transformer(
            hidden_states=torch.randn(1, 4, 8, 8, generator=generator),
            timestep=torch.tensor([0.5]),
            encoder_hidden_states=torch.randn(1, 5, 32, generator=generator),
            encoder_attention_mask=torch.ones(1, 5, dtype=torch.bool),
        ),
    )
    assert [(item.attr, item.returns, item.unknown) for item in probed.lists] == [
        ("context_refiner", None, "context_refiner holds one block: no next block shows what it returns"),
        ("noise_refiner", None, "noise_refiner holds one block: no next block shows what it returns"),
        ("layers", ("hidden_states",), ""),
    ]
    assert probed.block_lists() is None  # the refiners stay unknown: the generic path must not guess them


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, hidden_states: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.proj(hidden_states), scale + 1


class _Rescaling(nn.Module):
    """Hands each block's first output on doubled: no argument of the next block is that output."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.zeros(1)
        for block in self.blocks:
            x, scale = block(x * 2, scale=scale)
        return x


def test_an_output_the_next_block_never_receives_stays_unknown_with_the_reason() -> None:
    transformer = _Rescaling()
    found = Discovery("_Rescaling", (FoundList("blocks", "_Block", 2, "structure", None),), "forward source")
    probed = probe_returns(transformer, found, lambda: transformer(torch.ones(1, 4)))
    assert (probed.lists[0].returns, probed.lists[0].unknown) == (
        None,
        "output 0 of _Block reaches the next block as no argument",
    )
