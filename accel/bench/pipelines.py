"""The pipeline a bench measures, reloaded when a variant needs a state `remove()` cannot restore."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

from accel.recipe import Recipe


class Pipelines:
    """The loaded pipeline and what `remove()` cannot undo (its dtype, its quantization, its TP
    split, text encoders dropped by "rank0" placement or split by "sharded"): a variant that needs another state
    gets a fresh load."""

    def __init__(self, name: str, device: Any, pipeline: str = "", lora: tuple[str, ...] | None = None) -> None:
        self.name = name
        self.pipeline = pipeline
        self.lora = lora
        self.device = device
        self.pipe: Any = None
        self.model_dtype = ""
        self.quant: tuple[Any, ...] | None = None
        self.split = 1  # the TP degree the transformer is split over
        self.dropped = False  # the text encoders were dropped on the ranks that do not encode
        self.sharded = 1  # the ranks the text encoders are split over ("sharded")

    @property
    def dtype(self) -> Any:
        return self.pipe.transformer.dtype

    def get(self, recipe: Recipe, say: Callable[[str], None] | None = None) -> Any:
        quant = recipe.quant
        wanted = (quant.type, quant.scope, quant.exclude) if quant.type != "none" else None
        split = recipe.parallel.tp if recipe.parallel.world_size > 1 else 1
        from accel.parallel.encoders import ONE_RANK_PLACEMENTS, SHARDED

        dropped = recipe.memory.text_encoder in ONE_RANK_PLACEMENTS and recipe.parallel.world_size > 1
        sharded = recipe.parallel.world_size if recipe.memory.text_encoder == SHARDED else 1
        stale = (
            (self.quant is not None and self.quant != wanted)
            or (self.split > 1 and self.split != split)
            or (self.dropped and not dropped)
        )
        stale = stale or (self.sharded > 1 and self.sharded != sharded)
        if self.pipe is None or recipe.model.dtype != self.model_dtype or stale:
            tell = say or (lambda _line: None)
            first = self.pipe is None
            tell(
                f"loading {self.name}…"
                if first
                else "  reloading the pipeline (quantization, the tensor-parallel split, dropped or split text "
                "encoders and dtype cannot be undone in place)"
            )
            start = time.perf_counter()
            self._load(recipe.model.dtype)
            tell(f"{'loaded' if first else '  reloaded'} {self.name} in {time.perf_counter() - start:.1f} s")
        self.quant, self.split, self.dropped, self.sharded = wanted, split, dropped, sharded
        return self.pipe

    def _load(self, dtype: str) -> None:
        import torch

        from accel.models.loading import load_pipeline

        self.pipe = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.pipe = load_pipeline(self.name, dtype, self.device, self.pipeline or None, self.lora)
        self.pipe.set_progress_bar_config(disable=True)
        self.model_dtype = dtype
