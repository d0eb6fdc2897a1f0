"""HiDream-O1-Image: ComfyUI's `comfy.model_base.HiDreamO1` (`supported_models.HiDreamO1`; comfy/ldm/hidream_o1/model.py
HiDreamO1Transformer), a pixel-space unified transformer: Qwen3-VL-8B's decoder (`language_model`, 36 layers of 4096,
32 heads / 8 KV heads of 128, interleaved M-RoPE) runs over the prompt's tokens and the image's 32x32 RGB patches in
one sequence (text causal, image tokens attending to everything), with a bottleneck patch embedding (3072 -> 1024 ->
4096, `x_embedder`), a timestep embedding written over the prompt's last token (`t_embedder1`), and a linear
unpatchify (`final_layer2`). A Qwen3-VL vision tower (`visual`) encodes reference images for editing only.

No separate text encoder: ComfyUI's "CLIP" for it (comfy/text_encoders/hidream_o1.py) only tokenizes the prompt into
the chat template and returns its token ids (`text_input_ids`, a conditioning extra, with a float copy as the
cross_attn placeholder); the model embeds them itself and `extra_conds` builds position ids / masks from the target
size. Headroom's text cache holds those ids, so the model's own text path trains with the LoRA. Reference images (the
stock HiDreamO1ReferenceImages node: `reference_latents` of raw images for the vision tower) are not cached: the family
trains text-to-image. The "latent" is the image itself: ComfyUI's PixelspaceConversionVAE (an identity, 3 channels at
1x, latent_formats.HiDreamO1Pixel), flow matching with shift 3.0 and noise scaled by 8.0 (sampling_settings).

LoRA preset: musubi-tuner's text-to-image choice (networks/lora_hidream_o1.py: the decoder layers, Qwen3VLTextDecoderLayer,
plus BottleneckPatchEmbed and FinalLayer; the vision tower only when it trains with control images, the timestep
embedder and token embeddings never): every Linear of the decoder layers (self_attn q / k / v / o_proj, MLP gate /
up / down_proj) and the pixel patch embedding and unpatchify (x_embedder.proj1 / proj2, final_layer2.linear), which
in a pixel-space model are where the image's statistics enter and leave. ComfyUI's key map names them by their module
paths (lora_unet_language_model_layers_0_self_attn_q_proj for kohya names); it has no diffusers names for HiDream-O1
(no diffusers class either), so that format is refused.

No ControlNet: ComfyUI's ControlNetLoader has no HiDream-O1 type."""
from __future__ import annotations

import comfy.model_base
import comfy.pixel_space_convert
import comfy.supported_models

from ....training.core.adapters import TargetPreset
from .base import Family, TinyModel

# The released geometry is the class default (comfy/ldm/hidream_o1/model.py HiDreamO1TextConfig; ComfyUI's detection
# returns only {"image_model": "hidream_o1"}). The tiny one keeps what the code fixes: 128-wide heads with grouped KV
# (the interleaved M-RoPE sections [24, 20, 20] cover 64 of 128), the vocabulary (the chat template's special tokens
# are ids up to 151673), 32-px patches; 2 layers of 32.
TINY_TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1}
# The vision tower (reference images only; never called by a text-to-image run) built small.
TINY_VISION = {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "depth": 1, "deepstack_visual_indexes": ()}

TINY = TinyModel(
    model_config=lambda: comfy.supported_models.HiDreamO1({
        "image_model": "hidream_o1", "text_config_overrides": dict(TINY_TEXT),
        "vision_config_overrides": dict(TINY_VISION)}),
    clip_target=lambda: comfy.supported_models.HiDreamO1({"image_model": "hidream_o1"}).clip_target(),
    text_encoder_options={},
    latent_channels=3,
    tooltip="hidream_o1: HiDream-O1-Image pixel-space Qwen3-VL transformer (the prompt's tokens embedded by the model)",
    vae=lambda: (comfy.pixel_space_convert.PixelspaceConversionVAE(), None),
)

FAMILY = Family(
    name="hidream_o1",
    description="HiDream-O1-Image pixel-space Qwen3-VL transformer (no VAE, no separate text encoder)",
    recognise=lambda model: type(model) is comfy.model_base.HiDreamO1,
    lora_preset=TargetPreset("hidream_o1", (
        r"^language_model\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))$",
        r"^x_embedder\.(proj1|proj2)$",
        r"^final_layer2\.linear$",
    )),
    text_tokens=128,  # the prompt's own tokens plus the chat template's 10
    diffusers_component=None,
    # musubi-tuner's names (its architecture id "hidream_o1_image"; modelspec.architecture after its "<arch>/lora").
    kohya_base=("hidream_o1_image", "HiDream-O1-Image/lora"),
    # The prompt's token ids (the model embeds them itself: comfy/ldm/hidream_o1) and their float placeholder.
    calibration_cond_shapes=lambda model, tokens: {"cross_attn": (tokens, 1), "text_input_ids": (tokens,)},
    latent_downscale=1,
    tiny=TINY,
    position=25,
)
