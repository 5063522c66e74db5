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
# What an `accel` command started by the tests imports before its work (tests/commands.py forks them
# from the same server): the command line, the runner, the server's stack.
for name in ("accel.cli", "accel.runner", "accel.bench.run", "accel.batch.run", "accel.tune"):
    importlib.import_module(name)
for module in pkgutil.iter_modules(importlib.import_module("accel.serve").__path__, "accel.serve."):
    importlib.import_module(module.name)
