"""The Headroom engine: pure torch + peft + safetensors (bitsandbytes, prodigyopt, came-pytorch where installed).

Nothing in this package imports ComfyUI; it is unit-tested on a machine without it.
Modules import each other relatively so the package works both as `<pack>.training`
inside ComfyUI and as `headroom.training` in the test suite.

Layout: data/ (datasets, caches, files), memory/ (policy, features, planner), core/ (trainer and what it trains
with); checks.py (shared input checks) and `public_module` here serve all three.
"""

_SUBPACKAGES = ("training", "nodes", "workflows")


def public_module(module_name: str) -> str:
    """The `__module__` our exception classes carry: "headroom.training.dataset" for "<root>.training.dataset".

    ComfyUI imports a custom node package under its folder path as the module name
    ("/home/me/ComfyUI/custom_nodes/comfyui-headroom"), and its error report names an exception's type as
    `__module__ + "." + __qualname__` (execution.full_type_name), so users saw a filesystem path there."""
    parts = module_name.split(".")
    starts = [i for i, part in enumerate(parts) if part in _SUBPACKAGES]
    return ".".join(["headroom", *parts[starts[0]:]]) if starts else module_name
