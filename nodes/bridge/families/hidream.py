"""HiDream-I1 (full / dev / fast): a double- and single-stream DiT with mixture-of-experts feed-forwards
(`comfy.model_base.HiDream`), conditioned on four text encoders at once: CLIP-L + CLIP-G pooled (the `y` vector),
T5-XXL, and every hidden layer of Llama-3.1-8B (`conditioning_llama3`, one layer per block); Flux's 16-channel
latents, flow. (HiDream-O1, pixel space, is another model class and not this family.)

No tiny model yet: ComfyUI's HiDream tokenizer reads comfy/text_encoders/llama_tokenizer/tokenizer.json, which the
ComfyUI checkout the tests run on lacks, so its text encoder cannot be built there. `TINY_DIT` (the diffusion model
alone) is what tests/comfy/test_families.py recognises; tests/realsize/test_realsize.py maps the preset's keys at real width."""
from __future__ import annotations

import comfy.model_base

from ....training.core.adapters import TargetPreset
from .base import TINY_CLIP_G, TINY_CLIP_L, TINY_T5, Family

# HiDream's head geometry (128 wide, RoPE axes [64, 32, 32], as comfy/model_detection.py fixes it) with one head; one
# double- and one single-stream block, each reading one Llama layer (llama_layers: which hidden state per block).
TINY_DIT = {
    "image_model": "hidream", "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 1,
    "num_single_layers": 1, "attention_head_dim": 128, "num_attention_heads": 1, "axes_dims_rope": [64, 32, 32],
    "caption_channels": [TINY_T5["d_model"], 32], "text_emb_dim": TINY_CLIP_L["projection_dim"] + TINY_CLIP_G["projection_dim"],
    "num_routed_experts": 4, "num_activated_experts": 2, "max_resolution": [128, 128], "llama_layers": [0, 1],
}

FAMILY = Family(
    name="hidream",
    description="HiDream-I1 MoE DiT",
    recognise=lambda model: isinstance(model, comfy.model_base.HiDream),
    # The attention projections of both streams (image and text: `_t`), and the feed-forwards every token passes: the
    # shared expert of the image stream and the text stream's; the routed experts (each sees only the tokens routed
    # to it) stay frozen.
    lora_preset=TargetPreset("hidream", (
        r"^(double|single)_stream_blocks\.\d+\.block\.attn1\.to_(q|k|v|out)(_t)?$",
        r"^(double|single)_stream_blocks\.\d+\.block\.(ff_i\.shared_experts|ff_t)\.w[123]$")),
    text_tokens=128,  # ComfyUI's HiDream tokenizer pads T5 and Llama to 128 tokens
    diffusers_component="transformer",  # diffusers' HiDreamImageTransformer2DModel: ComfyUI's module names
    # sd-scripts and musubi-tuner do not train HiDream (no ss_base_model_version / modelspec id established there):
    # the model's own name.
    kohya_base=("hidream_i1", "hidream-i1/lora"),
    position=22,
)
