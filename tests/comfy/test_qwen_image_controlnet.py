"""Qwen-Image ControlNets (InstantX layout, ComfyUI's QwenImageControlNetModel): the stock ControlNetLoader detects
the saved file and rebuilds it at the released widths (24 heads of 128, text 3584; it reads only the depth and the
input channels), so the load-back is checked at real width with reduced depth; the tiny one trains through the same
path (tests/comfy/test_controlnet_training.py: its training forward is the stock apply path) and its file says why
the stock loader would not rebuild it. Real ComfyUI, in-process, CPU."""
import gc

import pytest
import torch

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]


def _real_width_base(layers: int):
    """A Qwen-Image MODEL as ComfyUI detects a released checkpoint (widths from the class defaults), `layers` deep,
    bf16, seeded."""
    import comfy.model_patcher
    import comfy.supported_models
    from headroom.nodes.bridge.tiny_models import init_weights_

    config = comfy.supported_models.QwenImage({"image_model": "qwen_image", "in_channels": 64, "num_layers": layers})
    config.set_inference_dtype(torch.bfloat16, None)
    model = config.get_model({}, "", device="cpu")
    init_weights_(model.diffusion_model, 0)
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


@torch.no_grad()
def _as_if_trained(controlnet, seed=1, scale=0.02):
    generator = torch.Generator().manual_seed(seed)
    for layer in controlnet.controlnet_type.zero_initialised(controlnet.module):
        for param in layer.parameters():
            param.copy_((torch.randn(param.shape, generator=generator) * scale).to(param.dtype))


def test_real_width_controlnet_loads_back_through_the_stock_loader_with_every_key_and_its_output(comfyui):
    import comfy.ldm.qwen_image.controlnet
    import folder_paths
    import nodes
    from headroom.nodes.bridge.controlnet_build import build_controlnet, save_controlnet

    base = _real_width_base(layers=1)
    controlnet = build_controlnet(base, seed=1, dtype=torch.bfloat16)
    assert controlnet.type_name == "qwen_image" and controlnet.blocks == 1 and controlnet.hint == "latents"
    _as_if_trained(controlnet)
    folder = folder_paths.get_folder_paths("controlnet")[0]
    exported = save_controlnet(controlnet, f"{folder}/headroom-test/qwen_instantx.safetensors", {"steps": 0})
    assert exported.layout == "qwen-image-instantx" and exported.problem is None
    saved_keys = sorted(exported.tensors)
    del base, exported  # keeps the test's peak at about three copies of a 0.7 GB block (base, ours, loaded)
    gc.collect()
    loaded = nodes.ControlNetLoader().load_controlnet("headroom-test/qwen_instantx.safetensors")[0]

    module = loaded.control_model
    assert type(module) is comfy.ldm.qwen_image.controlnet.QwenImageControlNetModel
    ours = controlnet.module.state_dict()
    theirs = module.state_dict()
    assert sorted(theirs) == sorted(ours) == saved_keys  # every key, none left over
    assert all(torch.equal(theirs[k].to(ours[k].dtype), ours[k]) for k in ours)
    print(f"qwen_image InstantX ControlNet at real width: {len(ours)} keys, "
          f"{sum(t.numel() for t in ours.values()) / 1e6:.0f} M params, loaded back bit-exact")

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 1, 4, 4, generator=generator).to(torch.bfloat16)
    hint = torch.randn(1, 16, 1, 4, 4, generator=generator).to(torch.bfloat16)
    context = torch.randn(1, 3, 3584, generator=generator).to(torch.bfloat16)
    timesteps = torch.tensor([500.0], dtype=torch.bfloat16)
    with torch.no_grad():
        expected = controlnet.module(x=x, hint=hint, timesteps=timesteps, context=context)["input"]
        got = module.to(torch.bfloat16)(x=x, hint=hint, timesteps=timesteps, context=context)["input"]
    assert len(got) == len(expected) == 60  # one residual per block of the released 60-block model
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert expected[0].abs().sum() > 0  # the trained output layers make residuals: not a trivially equal zero


def test_tiny_controlnet_file_says_the_stock_loader_would_rebuild_it_at_the_released_widths(comfyui, tmp_path):
    from headroom.nodes.bridge.controlnet_build import ControlNetError, build_controlnet, save_controlnet
    from headroom.nodes.bridge.tiny_models import build_tiny_model_patcher

    base = build_tiny_model_patcher("qwen_image", 0)
    controlnet = build_controlnet(base, seed=1)
    # The tiny base has 2 blocks; ComfyUI's module repeats each ControlNet block's output ceil(60 / blocks) times,
    # so a second block would never reach it: the default is 1, and 2 is refused with the reason.
    assert controlnet.blocks == 1
    with pytest.raises(ControlNetError, match=r"blocks=2: .* on this 2-block base only 1 would ever be used; use 1"):
        build_controlnet(base, blocks=2)
    exported = save_controlnet(controlnet, tmp_path / "tiny_qwen.safetensors")
    assert exported.layout == "qwen-image-instantx"
    assert "num_attention_heads: ours 1, loader 24" in exported.problem
    assert "joint_attention_dim: ours 32, loader 3584" in exported.problem
