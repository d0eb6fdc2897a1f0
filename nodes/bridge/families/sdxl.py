"""SDXL (base and refiner): UNet denoisers; ControlNets of the cldm type (nodes/bridge/families/sd15.py)."""
from __future__ import annotations

import comfy.model_base
import comfy.supported_models

from ....training.core.adapters import TargetPreset
from .base import TINY_CLIP_G, TINY_CLIP_L, Family, TinyModel
from .sd15 import CLDM, UNET_ATTENTION, UNET_CONV


def pooled_width(model) -> int:
    """CLIP-G's pooled width: the label embedding's input (adm_in_channels) less the size embeddings extra_conds adds
    (SDXL: height, width, crop_h, crop_w, target_height, target_width; the refiner: the first four and the aesthetic
    score), each `embedder.dim` wide. 1280 for the released models; the projection width of a smaller CLIP-G."""
    sizes = 5 if isinstance(model, comfy.model_base.SDXLRefiner) else 6
    return int(model.model_config.unet_config["adm_in_channels"]) - sizes * model.embedder.dim


# SDXL's layout in small: no attention at the first level, linear projections in the transformers, a label embedding
# of the pooled text and the six 256-wide size embeddings (so adm_in_channels = CLIP-G's projection + 1536).
_TINY_UNET = {
    "use_checkpoint": False, "image_size": 32, "in_channels": 4, "out_channels": 4, "model_channels": 32,
    "num_res_blocks": [1, 1], "channel_mult": [1, 2], "transformer_depth": [0, 1], "transformer_depth_middle": 1,
    "transformer_depth_output": [0, 0, 1, 1], "use_spatial_transformer": True, "legacy": False,
    "num_classes": "sequential", "adm_in_channels": TINY_CLIP_G["projection_dim"] + 6 * 256,
    "context_dim": TINY_CLIP_L["hidden_size"] + TINY_CLIP_G["hidden_size"],
    "use_linear_in_transformer": True, "use_temporal_attention": False, "use_temporal_resblock": False,
}

TINY = TinyModel(
    model_config=lambda: comfy.supported_models.SDXL(dict(_TINY_UNET)),
    clip_target=lambda: comfy.supported_models.SDXL(dict(_TINY_UNET)).clip_target(),
    text_encoder_options={"clip_l_model_config": dict(TINY_CLIP_L), "clip_g_model_config": dict(TINY_CLIP_G)},
    latent_channels=4,
    tooltip="sdxl: eps UNet with size conditioning, CLIP-L + CLIP-G",
)

FAMILY = Family(
    name="sdxl",
    description="SDXL base / refiner UNet",
    recognise=lambda model: isinstance(model, (comfy.model_base.SDXL, comfy.model_base.SDXLRefiner)),
    lora_preset=TargetPreset("sdxl", UNET_ATTENTION, UNET_CONV),
    text_tokens=77,
    diffusers_component="unet",
    kohya_base=("sdxl_base_v1-0", "stable-diffusion-xl-v1-base/lora"),
    calibration_pooled_width=pooled_width,  # CLIP-G's pooled output; the size embeddings come from extra_conds
    controlnet=CLDM,
    tiny=TINY,
    position=1,
)
