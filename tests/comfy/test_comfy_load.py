"""What the run asks of ComfyUI's model loading, checked against the real ComfyUI (in-process, CPU)."""
import pytest
import torch

pytestmark = pytest.mark.comfyui


def test_a_load_fills_at_most_what_the_plan_keeps_and_casts_the_rest_from_host_ram(comfyui):
    """comfy_fills_at_most (nodes/bridge/comfy_bridge.py): ComfyUI's load_models_gpu fills the free memory through
    the patcher's load; given at most N bytes it loads no more and marks the other layers to be cast from host RAM,
    the state its partial unload leaves a layer in. A whole-block training load gives it none
    (every block goes to host RAM right after), a partial one its planned share. On this CPU ComfyUI's load "moves"
    every weight onto the same device, so what it counts as loaded shows the difference."""
    import comfy.model_management as management

    from headroom.nodes.bridge.comfy_bridge import comfy_fills_at_most
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, _, _ = build_tiny_models("flux", 0)
    patcher = model.clone(disable_dynamic=True)
    layers = [m for m in patcher.model.diffusion_model.modules() if hasattr(m, "comfy_cast_weights")]
    try:
        for _ in range(2):  # the first Steps call, and the next one (the clone is loaded already)
            with comfy_fills_at_most(patcher, 0):
                management.load_models_gpu([patcher])
            assert "load" not in vars(patcher)
            assert patcher.loaded_size() == 0 and patcher.model.model_lowvram
            assert layers and all(m.comfy_cast_weights for m in layers)
        # a clone with weight patches loaded whole in between (validation's "as saved file" sampling patches the
        # shared weights in place): the next load first unpatches them and asks again for what was loaded
        patched = patcher.clone()
        key = next(k for k in patched.model_state_dict() if k.endswith(".weight"))
        patched.add_patches({key: (torch.zeros_like(patched.model_state_dict()[key]),)}, 1.0)
        management.load_models_gpu([patched])
        assert patcher.loaded_size() == patcher.model_size()
        with comfy_fills_at_most(patcher, 0):
            management.load_models_gpu([patcher])
        assert patcher.loaded_size() == 0
        share = patcher.model_size() // 2
        with comfy_fills_at_most(patcher, share):
            management.load_models_gpu([patcher])
        assert 0 < patcher.loaded_size() <= share and patcher.model.model_lowvram
        with comfy_fills_at_most(patcher, None):  # no plan: as ComfyUI decides (here: everything)
            management.load_models_gpu([patcher])
        assert patcher.loaded_size() == patcher.model_size()
        with pytest.raises(RuntimeError), comfy_fills_at_most(patcher, 0):
            raise RuntimeError("a load failing")
        assert "load" not in vars(patcher)
        with comfy_fills_at_most(patcher, share):  # nested: the inner limit within the outer one, the outer's after
            outer = patcher.load
            with comfy_fills_at_most(patcher, 0):
                management.load_models_gpu([patcher])
            assert patcher.load is outer
        assert "load" not in vars(patcher)
    finally:
        management.unload_model_and_clones(patcher)
