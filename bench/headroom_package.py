"""The repository as the package `headroom` for the benches that need only its engine (no ComfyUI): the repo root is
the package, imported without putting the root on sys.path (as ComfyUI imports a custom node)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def import_headroom():
    """The package `headroom` (imported once; later calls return it)."""
    if "headroom" in sys.modules:
        return sys.modules["headroom"]
    spec = importlib.util.spec_from_file_location("headroom", REPO_ROOT / "__init__.py",
                                                  submodule_search_locations=[str(REPO_ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["headroom"] = module
    spec.loader.exec_module(module)
    return module


def import_headroom_and_comfyui() -> None:
    """The package `headroom` and ComfyUI imported in-process on the CPU (found as the tests find it:
    tests/comfy_harness.py), for the benches that drive the nodes."""
    import_headroom()
    spec = importlib.util.spec_from_file_location("comfy_harness", REPO_ROOT / "tests" / "comfy_harness.py")
    harness = importlib.util.module_from_spec(spec)
    sys.modules["comfy_harness"] = harness
    spec.loader.exec_module(harness)
    harness.import_comfyui_in_process()
