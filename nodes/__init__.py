"""ComfyUI V3 nodes of Headroom. Thin: each node validates its inputs and calls `training/`.

Each module here exposes `NODES`, a list of `io.ComfyNode` classes; the extension lists them all.
"""
from typing_extensions import override

from comfy_api.latest import ComfyExtension, io

from . import cache, data, memory, monitor, tiny, train_controlnet, train_lora

_NODE_MODULES = [tiny, data, cache, train_lora, train_controlnet, memory, monitor]


class HeadroomExtension(ComfyExtension):
    @override
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [node for module in _NODE_MODULES for node in module.NODES]
