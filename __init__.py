"""Headroom: LoRA / ControlNet training and validation nodes for ComfyUI.

Importing this package changes nothing in ComfyUI: the nodes are imported only when ComfyUI
asks for them through the V3 entry point, and nothing is monkeypatched.

On a ComfyUI or torch older than the pack needs (training/environment.py), or one whose classes the nodes cannot
import, the log says in one line what Headroom needs and what is installed, and a single node, "Headroom (needs an
update)", says the same in the editor: never IMPORT FAILED with a traceback and no word of what to do. A node whose
schema this ComfyUI cannot build is left out the same way (nodes/__init__.py), the others load.
"""
import logging

WEB_DIRECTORY = "./js"

log = logging.getLogger("headroom")


async def comfy_entrypoint():
    # Imported here, not at module level, so `training/` stays importable without ComfyUI.
    from .training.environment import environment_problem

    problem = environment_problem()
    if problem is None:
        try:
            from .nodes import HeadroomExtension

            return HeadroomExtension()
        except Exception as error:  # a class or option this ComfyUI lacks: say so instead of IMPORT FAILED
            problem = (f"Headroom's nodes cannot load on this ComfyUI ({type(error).__name__}: {error}); update "
                       "ComfyUI, then restart it. If it is up to date, report this line.")
            log.exception("Headroom: %s", problem)
    log.warning("Headroom: %s", problem)
    return _unavailable_extension(problem)


def unavailable_node(problem: str):
    """A node that shows `problem` in the editor and refuses to run, built from the oldest V3 features."""
    from comfy_api.latest import io

    class HeadroomUnavailable(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(node_id="HeadroomUnavailable", display_name="Headroom (needs an update)",
                             category="Headroom", description=problem, inputs=[], outputs=[], is_output_node=True)

        @classmethod
        def execute(cls):
            raise RuntimeError(problem)

    return HeadroomUnavailable


def _unavailable_extension(problem: str):
    from comfy_api.latest import ComfyExtension

    class HeadroomUnavailableExtension(ComfyExtension):
        async def get_node_list(self):
            return [unavailable_node(problem)]

    return HeadroomUnavailableExtension()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
