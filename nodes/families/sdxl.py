"""SDXL (base and refiner): UNet denoisers; ControlNets of the cldm type (nodes/families/sd15.py)."""
from __future__ import annotations

import comfy.model_base

from ...training.adapters import TargetPreset
from .base import Family
from .sd15 import CLDM, UNET_ATTENTION, UNET_CONV

FAMILY = Family(
    name="sdxl",
    description="SDXL base / refiner UNet",
    recognise=lambda model: isinstance(model, (comfy.model_base.SDXL, comfy.model_base.SDXLRefiner)),
    lora_preset=TargetPreset("sdxl", UNET_ATTENTION, UNET_CONV),
    text_tokens=77,
    diffusers_component="unet",
    kohya_base=("sdxl_base_v1-0", "stable-diffusion-xl-v1-base/lora"),
    calibration_pooled_width=1280,  # CLIP-G's pooled output; the size embeddings come from extra_conds
    controlnet=CLDM,
    position=1,
)
