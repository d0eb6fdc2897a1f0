"""SD2.0 / SD2.1 (512 base, 768-v, inpainting): UNet denoisers that are plain `comfy.model_base.BaseModel`s built
from ComfyUI's `supported_models.SD20` config (1024-wide OpenCLIP-H text, linear transformer projections, 64-wide
heads); the 768 models predict v. ControlNets of the cldm type (nodes/bridge/families/sd15.py).

Runs stored by Headroom before this family existed name an SD2 model's family "sd15" (that family then covered every
plain UNet); they resume as they are (nodes/bridge/comfy_bridge.py CONFIG_RENAMED): the preset trains the same layers."""
from __future__ import annotations

import comfy.model_base
import comfy.model_sampling
import comfy.supported_models

from ....training.core.adapters import TargetPreset
from .base import TINY_CLIP_L, Family, TinyModel
from .sd15 import CLDM, UNET_ATTENTION, UNET_CONV


def is_sd2(model) -> bool:
    """A plain UNet BaseModel of ComfyUI's SD20 config (its subclasses SD21UnclipL/H, the x4 upscaler and Lotus make
    other model_base classes)."""
    return (type(model) is comfy.model_base.BaseModel and type(model.diffusion_model).__name__ == "UNetModel"
            and isinstance(model.model_config, comfy.supported_models.SD20))


def _kohya_prediction(model) -> dict[str, str]:
    """What sd-scripts writes for SD2 (train_network.py, library/model_util.get_model_version_str_for_sd1_sd2,
    library/sai_model_spec.py): ss_v2, and with v_parameterization "sd_v2_v" / the 768-v architecture."""
    v = isinstance(model.model_sampling, comfy.model_sampling.V_PREDICTION)
    if not v:
        return {"ss_v2": "True", "modelspec.prediction_type": "epsilon"}
    return {"ss_v2": "True", "ss_base_model_version": "sd_v2_v", "modelspec.architecture": "stable-diffusion-v2-768-v/lora",
            "modelspec.prediction_type": "v"}


class _TinySD21V(comfy.supported_models.SD20):
    """SD20 with the 768-v objective. ComfyUI picks v for an SD2 checkpoint from the statistics of one trained weight
    (SD20.model_type: a norm bias's spread), which seeded random weights do not have, so the tiny one says it."""

    def model_type(self, state_dict, prefix=""):
        return comfy.model_base.ModelType.V_PREDICTION


# SD2's layout in small: linear projections, 64-wide heads (SD20's unet_extra_config), OpenCLIP-H's context width.
_TINY_CLIP_H = dict(TINY_CLIP_L)  # ComfyUI's OpenCLIP-H class (sd2_clip_config.json), shrunk; SD2 reads its layer -2
_TINY_UNET = {
    "use_checkpoint": False, "image_size": 32, "in_channels": 4, "out_channels": 4, "model_channels": 64,
    "num_res_blocks": [1, 1], "channel_mult": [1, 2], "transformer_depth": [1, 1],
    "transformer_depth_output": [1, 1, 1, 1], "transformer_depth_middle": 1, "use_spatial_transformer": True,
    "legacy": False, "adm_in_channels": None, "context_dim": _TINY_CLIP_H["hidden_size"],
    "use_linear_in_transformer": True, "use_temporal_attention": False, "use_temporal_resblock": False,
}

TINY = TinyModel(
    model_config=lambda: _TinySD21V(dict(_TINY_UNET)),
    clip_target=lambda: _TinySD21V(dict(_TINY_UNET)).clip_target(),
    text_encoder_options={"clip_h_model_config": dict(_TINY_CLIP_H)},
    latent_channels=4,
    tooltip="sd2: v-prediction UNet (SD2.1-768-v), OpenCLIP-H text",
)

FAMILY = Family(
    name="sd2",
    description="SD2.0 / SD2.1 UNet (eps or v-prediction)",
    recognise=is_sd2,
    lora_preset=TargetPreset("sd2", UNET_ATTENTION, UNET_CONV),
    text_tokens=77,
    diffusers_component="unet",
    # sd-scripts' SD2 without v_parameterization; v-prediction models get "sd_v2_v" / 768-v (kohya_extra).
    kohya_base=("sd_v2", "stable-diffusion-v2-512/lora"),
    kohya_extra=_kohya_prediction,
    kohya_diffusers_block_names=True,  # sd-scripts names SD2 UNet layers as SD1's: diffusers' block names
    controlnet=CLDM,
    tiny=TINY,
    position=0,  # after sd15 (same position: by name)
)
