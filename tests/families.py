"""The registry of family test cases: each tests/test_family_<name>.py declares its `CASE` once; the shared
checks parametrize over FAMILY_CASES."""

from __future__ import annotations

from family_case import FamilyCase, case_of

# The order the shared matrices run the families in (and their test ids list them in).
FAMILY_ORDER = (
    "flux",
    "wan",
    "skyreels2",
    "hunyuan",
    "cogvideox",
    "mochi",
    "ltx",
    "qwenimage",
    "flux2-klein",
    "sd3",
    "flux2",
    "zimage",
    "hunyuan15",
    "kandinsky5",
    "ltx2",
    "chronoedit",
    "hunyuanimage",
    "qwenimage21",
    "helios",
    "cosmos3",
    "kandinsky6",
)

FAMILY_CASES: dict[str, FamilyCase] = {family: case_of(family) for family in FAMILY_ORDER}
