"""HunyuanVideo 1.5 specifics the shared matrices do not show by themselves.

Its pipeline takes no guidance scale: a `guider` component holds it, which accel sets from
[generate] guidance_scale for the call. Its transformer joins image, glyph (ByT5) and prompt tokens
into one text stream, valid tokens first: a quoted word in the prompt brings glyph tokens in, and
the parallel split must still equal one process.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import parallel_cases as cases
import pytest
from test_parallel_families import FAMILY_CASES, MODES, reference, world_of

from accel.errors import UserError
from accel.models.registry import FAMILIES
from accel.recipe import Recipe
from accel.runner import generate, generation_kwargs

TOLERANCE = 1e-4
GLYPH = dict(FAMILY_CASES["hunyuan15"].call, prompt='a shop sign that reads "OPEN"')


def test_the_guidance_scale_goes_to_the_guider_for_the_call_only() -> None:
    pipe = cases.tiny_pipeline("tiny-hunyuan15")
    recipe = Recipe.from_dict({"model": {"name": "tiny-hunyuan15"}, "generate": {"steps": 1, "guidance_scale": 1.0}})
    kwargs = generation_kwargs(FAMILIES["hunyuan15"], True, recipe, pipe)
    assert kwargs["guidance_scale"] == 1.0 and "height" in kwargs  # kept, though the call takes no such keyword
    calls: list[int] = []
    hook = pipe.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        generate(pipe, kwargs, seed=0)
    finally:
        hook.remove()
    assert len(calls) == 1  # scale 1: the guider runs the prompt alone
    assert pipe.guider.guidance_scale == 6.0  # the pipeline's own scale is back


def test_cfg_parallel_is_refused_where_the_guider_would_not_guide() -> None:
    recipe = Recipe.from_dict({"model": {"name": "tiny-hunyuan15"}, "generate": {"guidance_scale": 1.0}, "parallel": {"cfg": 2}})
    with pytest.raises(UserError, match="guidance_scale is 1.0, and guidance runs only above 1"):
        generation_kwargs(FAMILIES["hunyuan15"], True, recipe)


def test_quoted_text_brings_glyph_tokens_in() -> None:
    plain, _ = reference("hunyuan15", FAMILY_CASES["hunyuan15"].call)
    glyph, _ = reference("hunyuan15", GLYPH)
    assert np.abs(plain - glyph).mean() > 1e-4


@pytest.mark.parametrize("mode", ["ring2"])
def test_glyph_tokens_split_with_the_text_equal_one_process(rank_pools: Any, mode: str) -> None:
    expected, _ = reference("hunyuan15", GLYPH)
    parallel = MODES[mode]
    for output, _, bytes_sent in rank_pools(world_of(parallel)).run(cases.tiny_run, "tiny-hunyuan15", {"parallel": parallel}, GLYPH):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE
