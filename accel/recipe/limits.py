"""The recipe's limits: numbers past which torch or numpy overflow, the largest recipe file, the longest
prompt. Checked before torch loads, so a bad value is one line rather than a traceback deep in a pipeline."""

from __future__ import annotations

import os
from os import PathLike

from accel.errors import RecipeError


# Bounds past which a number overflows torch or numpy (a traceback deep in a pipeline before these).
MAX_PIXELS_SIDE = 65536  # height / width: no model makes more; beyond, latent sizes overflow
MAX_STEPS = 10_000  # schedulers build arrays of this length; 1000 is already far past any model's use
MAX_FRAMES = 100_000
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
FLOAT32_MAX = 3.4028234663852886e38  # pipelines put scales into float32 tensors

# The recipe file: a recipe is a few kilobytes (a run's --json report, which reruns it, some more).
MAX_RECIPE_BYTES = 8 * 1024 * 1024
# The most characters of a prompt or negative prompt. Text encoders read at most a few thousand
# tokens (T5: 512, Gemma / Qwen: about 1024, some 4 characters each) and cut the rest, but their
# tokenizers see all of it first: megabytes cost seconds to minutes and can abort the process.
PROMPT_CHARS = 20_000
PROMPT_CHARS_ENV = "ACCEL_MAX_PROMPT_CHARS"


def prompt_chars() -> int:
    """The prompt limit: PROMPT_CHARS, or ACCEL_MAX_PROMPT_CHARS where set (a positive integer)."""
    raw = os.environ.get(PROMPT_CHARS_ENV, "").strip()
    if not raw:
        return PROMPT_CHARS
    if not raw.isdigit() or int(raw) < 1 or len(raw) > 12:
        raise RecipeError(
            f"{PROMPT_CHARS_ENV}={raw[:40]}: must be a positive integer (characters), e.g. {PROMPT_CHARS}"
        )
    return int(raw)


def read_capped(path: str | PathLike[str], source: str, advice: str) -> bytes:
    """The file's bytes, at most MAX_RECIPE_BYTES of them: /dev/zero or a huge file is refused after
    reading one byte past the cap, never read whole (RecipeError: "`source`: larger than …; `advice`")."""
    with open(path, "rb") as file:
        data = file.read(MAX_RECIPE_BYTES + 1)
    if len(data) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{source}: larger than {MAX_RECIPE_BYTES // 2**20} MiB; {advice}")
    return data
