"""What the run asks of ComfyUI's model loading, checked against the real ComfyUI (in-process, CPU)."""
import pytest

pytestmark = pytest.mark.comfyui


def test_a_whole_block_load_moves_no_weight_and_leaves_every_layer_cast_from_host_ram(comfyui):
    """comfy_loads_no_weights (nodes/bridge/comfy_bridge.py): ComfyUI's load_models_gpu fills the free memory through
    the patcher's partially_load; given none to fill, its load moves no weight and marks every layer to be cast from
    host RAM, the state its partial unload leaves a layer in (and a whole-block training load then sends every block
    there anyway). On this CPU ComfyUI's load "moves" every weight onto the same device, so what it counts as loaded
    shows the difference."""
    import comfy.model_management as management

    from headroom.nodes.bridge.comfy_bridge import comfy_loads_no_weights
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, _, _ = build_tiny_models("flux", 0)
    patcher = model.clone(disable_dynamic=True)
    layers = [m for m in patcher.model.diffusion_model.modules() if hasattr(m, "comfy_cast_weights")]
    try:
        for _ in range(2):  # the first Steps call, and the next one (the clone is loaded already)
            with comfy_loads_no_weights(patcher):
                management.load_models_gpu([patcher])
            assert "partially_load" not in vars(patcher)
            assert patcher.loaded_size() == 0 and patcher.model.model_lowvram
            assert layers and all(m.comfy_cast_weights for m in layers)
        with comfy_loads_no_weights(patcher, active=False):  # a load that is not a whole-block one fills as before
            management.load_models_gpu([patcher])
        assert patcher.loaded_size() == patcher.model_size() > 0
        with pytest.raises(RuntimeError), comfy_loads_no_weights(patcher):
            raise RuntimeError("a load failing")
        assert "partially_load" not in vars(patcher)
    finally:
        management.unload_model_and_clones(patcher)
