"""ComfyUI V3 nodes of Headroom. Thin: each node validates its inputs and calls `training/`.

Each module here exposes `NODES`, a list of `io.ComfyNode` classes; the extension lists them all.
"""
import logging

from typing_extensions import override

from comfy_api.latest import ComfyExtension, io

from .. import unavailable_node
from . import cache, data, memory, monitor, tiny, train_controlnet, train_lora

_NODE_MODULES = [tiny, data, cache, train_lora, train_controlnet, memory, monitor]


log = logging.getLogger("headroom")


class HeadroomExtension(ComfyExtension):
    @override
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        # A schema this ComfyUI cannot build (an input option it lacks) would fail the whole pack at load: that node
        # is left out, and one node says which and why.
        nodes, failed = [], []
        for node in (node for module in _NODE_MODULES for node in module.NODES):
            try:
                node.GET_SCHEMA()
                nodes.append(node)
            except Exception as error:
                failed.append(f"{node.__name__} ({type(error).__name__}: {error})")
        if failed:
            problem = (f"{len(failed)} of Headroom's nodes cannot be built on this ComfyUI, so they are left out: "
                       + "; ".join(failed) + ". Update ComfyUI, then restart it.")
            log.warning("Headroom: %s", problem)
            nodes.append(unavailable_node(problem))
        return nodes
