"""Which torch and ComfyUI Headroom runs on, checked when ComfyUI loads it (pyproject.toml declares the same:
`requires-comfyui` under [tool.comfy], `requires-torch` under [tool.headroom]; torch is never a dependency, since
installing must not replace the torch a user's ComfyUI came with).

ComfyUI >= 0.33.0: the version the pack is tested on (it needs the V3 schema with `advanced` inputs, 0.9.2 and
later, and text-encoder classes of later versions; a family whose classes are missing is left out on its own).
torch >= 2.8: the 2026 Windows portable build's; the pack uses torch's fused AdamW and grouped norms, and FSDP2's
public `fully_shard` (2.6 and later).
"""
from __future__ import annotations

import re

MIN_COMFYUI = "0.33.0"
MIN_TORCH = "2.8"


def _version_tuple(text: str) -> tuple[int, ...]:
    """'2.8.0+cu128' -> (2, 8, 0); the leading numeric parts only."""
    match = re.match(r"\d+(?:\.\d+)*", str(text).strip())
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def older_than(installed: str, minimum: str) -> bool:
    have, need = _version_tuple(installed), _version_tuple(minimum)
    width = max(len(have), len(need))
    return bool(have) and have + (0,) * (width - len(have)) < need + (0,) * (width - len(need))


def installed_versions() -> dict[str, str | None]:
    """torch's and ComfyUI's versions in this process (None where unknown: ComfyUI's comfyui_version module is on
    sys.path only inside ComfyUI)."""
    versions: dict[str, str | None] = {"torch": None, "ComfyUI": None}
    try:
        import torch

        versions["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        import comfyui_version

        versions["ComfyUI"] = str(comfyui_version.__version__)
    except (ImportError, AttributeError):
        pass
    return versions


def environment_problem(versions: dict[str, str | None] | None = None) -> str | None:
    """One line saying what Headroom needs and what is installed, or None when this environment has it."""
    versions = installed_versions() if versions is None else versions
    needs = {"ComfyUI": MIN_COMFYUI, "torch": MIN_TORCH}
    short = [f"{name} >= {minimum} (this one has {versions[name]})" for name, minimum in needs.items()
             if versions.get(name) and older_than(versions[name], minimum)]
    if not short:
        return None
    return ("Headroom needs " + " and ".join(short) + ": update ComfyUI (Windows portable: run "
            "update\\update_comfyui_and_python_dependencies.bat; ComfyUI Desktop updates itself; comfy-cli: comfy "
            "update all). Its nodes refuse to run until then.")
