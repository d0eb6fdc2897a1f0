"""Headroom: LoRA / ControlNet training and validation nodes for ComfyUI.

Importing this package changes nothing in ComfyUI: the nodes are imported only when ComfyUI
asks for them through the V3 entry point, and nothing is monkeypatched.
"""

WEB_DIRECTORY = "./js"


async def comfy_entrypoint():
    # Imported here, not at module level, so `training/` stays importable without ComfyUI.
    from .nodes import HeadroomExtension

    return HeadroomExtension()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
