"""Ideogram 4 is released in fp8 only (Comfy-Org's ideogram4_fp8_scaled.safetensors, the file workflows/ideogram4_lora
names). The stock UNETLoader builds that file's layers as ComfyUI's mixed-precision ops (QuantizedTensor weights), which
are not torch Linear layers and take no adapter yet: Init refuses the MODEL before any work, naming why and what
loads instead (rather than "no target modules matched")."""
from __future__ import annotations

import pytest
import torch

from family_checks import cached_data, init_run

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]


def _scaled_fp8(state_dict: dict) -> dict:
    """The tiny model's weights in the layout of a scaled fp8 release: each block Linear's weight in float8_e4m3fn with
    its per-tensor `scale_weight`, and the `scaled_fp8` marker ComfyUI's loader converts (comfy.utils.convert_old_quants)."""
    out = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for key, tensor in state_dict.items():
        if key.startswith("layers.") and key.endswith(".weight") and tensor.ndim == 2:
            scale = tensor.abs().max().float() / 448.0
            out[key] = (tensor.float() / scale).to(torch.float8_e4m3fn)
            out[key[:-len("weight")] + "scale_weight"] = scale.reshape(())
        else:
            out[key] = tensor
    return out


def test_a_scaled_fp8_base_is_refused_at_init_naming_why(comfyui, monkeypatch):
    import comfy.sd
    import comfy.supported_models

    from headroom.nodes.bridge import families
    from headroom.nodes.bridge.comfy_model import quantized_layers
    from headroom.nodes.bridge.families import ideogram4
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, clip, vae = build_tiny_models("ideogram4", seed=0)
    latents, texts = cached_data(model, clip, vae)
    state_dict = _scaled_fp8(model.model.diffusion_model.state_dict())
    # ComfyUI's detection fixes the released geometry through the config's unet_extra_config: the tiny one's here.
    monkeypatch.setattr(comfy.supported_models.Ideogram4, "unet_extra_config", ideogram4._TinyIdeogram4.unet_extra_config)
    fp8 = comfy.sd.load_diffusion_model_state_dict(state_dict)  # what UNETLoader does with the file's tensors
    assert families.family_of(fp8.model).name == "ideogram4"
    assert not isinstance(fp8.model.diffusion_model.layers[0].attention.qkv, torch.nn.Linear)
    assert len(quantized_layers(fp8.model)) == 2 * 6 and quantized_layers(model.model) == []  # 6 Linears a block
    with pytest.raises(ValueError, match=r"^Train LoRA: Init \(Headroom\): this MODEL's layers hold ComfyUI's quantized "
                                         r"weights \(12 layers, e\.g\. layers\.0\.attention\.qkv: a scaled fp8 .*load "
                                         r"the model from a bf16 / fp16 / fp32 file"):
        init_run(fp8, latents, texts, "ideogram4_fp8_scaled", 4, 2e-2, "preset", False)
