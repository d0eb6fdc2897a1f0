"""Z-Image (Tongyi-MAI): a Lumina 2 NextDiT (`comfy.model_base.Lumina2`, comfy/ldm/lumina/) configured as ComfyUI's
`supported_models.ZImage` (3840 wide, Z-Image modulation), text encoder Qwen3-4B (comfy/text_encoders/z_image.py),
Flux's 16-channel VAE latents, flow matching (shift 3).

Plain Lumina 2.0 (`supported_models.Lumina2`: 2304 wide, Gemma 2 2B encoder) and NewBie run the same NextDiT class
but are other models (other widths, encoder, shift): a Z-Image LoRA does not fit them, so this family recognises
ZImage configs only (not the pixel-space Z-Image, another module class); those models train as unlisted ones
(targets all_linear)."""
from __future__ import annotations

import comfy.model_base
import comfy.supported_models
import comfy.supported_models_base
import comfy.text_encoders.z_image

from ....training.core.adapters import TargetPreset
from .base import Family, TinyModel

# Qwen3-4B shrunk through ComfyUI's `qwen3_4b_model_config` option (comfy/text_encoders/llama.py Qwen3_4BConfig; its
# head_dim 128 is fixed there). Z-Image reads the penultimate layer (layer_idx -2): three layers.
TINY_QWEN3_4B = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
                 "num_key_value_heads": 1}

# ComfyUI's Z-Image detection (comfy/model_detection.py, dim 3840) fixes the head geometry: 128-wide heads (30 of
# them; q/k/v heads equal), RoPE axes [32, 48, 48], theta 256, FFN 8/3, Z-Image modulation, time scale 1000, caption
# padding to 32 tokens. The tiny one keeps all of it with three heads (width 384), 2 layers and 1 refiner layer each:
# Z-Image modulation feeds a 256-wide timestep embedding to min(dim, 256)-wide layers (narrower than 256 fails), and
# at 384 the FFN width 8/3 * dim is a multiple of 256, as at 3840, so diffusers' ZImageTransformer2DModel (which does
# not round it) has the same shapes.
_TINY_NEXTDIT = {
    "image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 384, "cap_feat_dim": TINY_QWEN3_4B["hidden_size"],
    "n_layers": 2, "n_refiner_layers": 1, "qk_norm": True, "n_heads": 3, "n_kv_heads": 3, "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512], "rope_theta": 256.0, "ffn_dim_multiplier": 8.0 / 3.0, "z_image_modulation": True,
    "time_scale": 1000.0, "pad_tokens_multiple": 32,
}

TINY = TinyModel(
    model_config=lambda: comfy.supported_models.ZImage(dict(_TINY_NEXTDIT)),
    clip_target=lambda: comfy.supported_models_base.ClipTarget(comfy.text_encoders.z_image.ZImageTokenizer,
                                                               comfy.text_encoders.z_image.te()),
    text_encoder_options={"qwen3_4b_model_config": dict(TINY_QWEN3_4B)},
    latent_channels=16,
    tooltip="zimage: Z-Image (Lumina 2 NextDiT) with a Qwen3 text encoder",
)


def _recognise(model) -> bool:
    return (isinstance(model, comfy.model_base.Lumina2) and not isinstance(model, comfy.model_base.ZImagePixelSpace)
            and isinstance(model.model_config, comfy.supported_models.ZImage))


FAMILY = Family(
    name="zimage",
    description="Z-Image (Lumina 2 NextDiT, Qwen3 encoder)",
    recognise=_recognise,
    # Attention (fused qkv, out) and SwiGLU MLP of the main transformer blocks (`layers`), as musubi-tuner's Z-Image
    # LoRAs (its default leaves out the modulation linears and the noise / caption refiners). ComfyUI maps them under
    # their own names and as diffusers' to_q / to_k / to_v / to_out.0 / feed_forward.w1-3 (z_image_to_diffusers).
    lora_preset=TargetPreset("zimage", (r"^layers\.\d+\.(attention\.(qkv|out)|feed_forward\.w[123])$",)),
    text_tokens=128,  # Z-Image prompts: the chat template plus the prompt, padded to multiples of 32
    diffusers_component="transformer",
    # sd-scripts does not train Z-Image: musubi-tuner's names (its architecture id "z_image"; modelspec.architecture
    # "Z-Image/lora", musubi_tuner/utils/sai_model_spec.py).
    kohya_base=("z_image", "Z-Image/lora"),
    tiny=TINY,
    position=20,
)
