"""Checks every node's inputs share.

Float inputs: ComfyUI checks a FLOAT input against its min / max, but NaN compares false both ways (and an API
prompt's JSON may carry NaN or Infinity, which Python's json reads), so a NaN passed every range check, switched
features off silently and was stored in config.json, making the run unresumable. Every float a node takes goes
through `check_finite`.
"""
from __future__ import annotations

import math


def check_finite(owner: str, **values) -> None:
    """Raise ValueError naming `owner` and the input when any of `values` is a NaN or infinite float."""
    for name, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{owner}: {name}={value} is not a finite number; give a number (e.g. its default)")
