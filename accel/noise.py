"""Known library noise, silenced in accel's own commands (`accel ...` and the ranks of `accel
launch`), never on import of the library: a user of `accel.apply` keeps their warnings and logging.

Each filter names one message of one library, so nothing unknown is hidden."""

from __future__ import annotations

import logging
import os
import warnings

# diffusers' Mochi transformer computes its rotary frequencies under torch.autocast(float32), which torch
# refuses on every call ("In CPU autocast, but the target dtype is not supported"); the math is float32 anyway.
MOCHI_AUTOCAST = r"In \w+ autocast, but the target dtype is not supported"
MOCHI_MODULE = r"diffusers\.models\.transformers\.transformer_mochi"


def quiet_library_noise() -> None:
    """For accel's own commands: the stack's import-time notices (torchao/torch version skew, optional
    torchvision) are not the user's business, nor are the known warnings below."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    quiet_known_warnings()


def quiet_known_warnings() -> None:
    """Also for a rank of `accel launch`, whose script's own logging stays as it sets it: torch's pytree
    calls torchao's Enum registration deprecated (once per process, so once per rank), and Mochi's
    autocast warning comes on every transformer call."""
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=MOCHI_AUTOCAST, category=UserWarning, module=MOCHI_MODULE)
