"""What every pooled rank imports sooner or later, imported once by the fork server the ranks start
from (tests/rankpool.py): torch.distributed, and diffusers' and transformers' classes of every family."""

from __future__ import annotations

import importlib
import pkgutil

import diffusers

import accel.models.tiny
from accel.models.registry import FAMILIES

importlib.import_module("torch.distributed")  # the ranks' process group
for family in FAMILIES.values():
    for name in (*family.pipeline_classes, *family.transformer_classes, *family.vaes):
        getattr(diffusers, name, None)  # diffusers imports its classes lazily, on first access
for module in pkgutil.iter_modules(accel.models.tiny.__path__, "accel.models.tiny."):
    importlib.import_module(module.name)  # the tiny builders, with the transformers classes they use
