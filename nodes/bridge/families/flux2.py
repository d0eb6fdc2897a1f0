"""Flux.2 dev / Klein 4B / Klein 9B: `comfy.model_base.Flux2`, ComfyUI's Flux DiT class in its Flux.2 configuration
(shared "global" modulation, SiLU-gated MLPs, no biases, 4-axis RoPE, patch size 1 on 128-channel latents).

Its latents (latent_formats.Flux2) are 128 channels at 16x downscale: the VAE has 32 latent channels at 8x and
folds 2x2 latent pixels into channels itself (the `bn` batch-norm layer ComfyUI's VAE detection keys on), so the
DiT sees one token per 16x16 image pixels. Dev reads Mistral-Small-3 features and has a guidance input; Klein
reads Qwen3 (4B: 2560 wide, 9B: 4096) features and has none. ComfyUI tells them apart from the checkpoint alone
(comfy/model_detection.py: `double_stream_modulation_img` -> flux2; txt_in / img_in widths; `guidance_in`).
Flux.2 blocks are Flux's DoubleStreamBlock / SingleStreamBlock: they add into their inputs in place, which the flux
family's `inplace_blocks` rule (isinstance Flux, which Flux2 is) already reports."""
from __future__ import annotations

import base64
import json

import comfy.ldm.models.autoencoder
import comfy.model_base
import comfy.supported_models
import comfy.supported_models_base
import comfy.text_encoders.flux

from ....training.core.adapters import TargetPreset
from .base import Family, TinyModel

# The family's tiny text encoder is Klein's Qwen3-4B class: its tokenizer ships with ComfyUI (comfy/text_encoders/
# qwen25_tokenizer); dev's Mistral tokenizer ("tekken") is read from the text encoder file itself, so the flux2_dev
# variant below writes a small one. Qwen3_4BModel reads hidden states [9, 18, 27], so it keeps 28 layers (narrow
# ones); the head width (128) is fixed by the class.
TINY_QWEN3 = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 28, "num_attention_heads": 1,
              "num_key_value_heads": 1}

# A Flux.2 Klein DiT in the geometry comfy/model_detection.py fixes for every Flux.2 checkpoint (128-wide heads on
# four 32-wide RoPE axes, mlp_ratio 3, theta 2000, no biases, global modulation, SiLU-gated MLPs), one head wide:
# the context is the three stacked Qwen3 layers (3 x 32), no pooled vector, no guidance input (Klein).
_TINY_DIT = {
    "image_model": "flux2", "in_channels": 128, "out_channels": 128, "patch_size": 1, "vec_in_dim": None,
    "context_in_dim": 3 * TINY_QWEN3["hidden_size"], "hidden_size": 128, "mlp_ratio": 3.0, "num_heads": 1,
    "depth": 1, "depth_single_blocks": 2, "axes_dim": [32, 32, 32, 32], "theta": 2000, "qkv_bias": False,
    "guidance_embed": False, "txt_ids_dims": [3], "global_modulation": True, "mlp_silu_act": True, "ops_bias": False,
    "default_ref_method": "index", "ref_index_scale": 10.0,
}


def tiny_vae():
    """The Flux.2 VAE layout, small: comfy.sd.VAE detects it from the state dict as the VAELoader does (the `bn`
    running stats -> batch-norm latents, 2x2 folded: 32 -> 128 channels, 8x -> 16x). That detection fixes the
    encoder (128 base channels, [1, 2, 4, 4], two res blocks) and reads the decoder's width from its weights, so
    the decoder is the narrow part."""
    ddconfig = {"double_z": True, "z_channels": 32, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0,
                "batch_norm_latent": True}
    decoder = dict(ddconfig, ch=32)  # GroupNorm(32) needs 32 channels or more
    module = comfy.ldm.models.autoencoder.AutoencoderKL(ddconfig=ddconfig, embed_dim=32, decoder_ddconfig=decoder)
    return module, None


# Width -> modelspec.architecture, as musubi-tuner names the released variants (widths: tests/realsize_models.py).
_ARCHITECTURES = {6144: "Flux.2-dev/lora", 3072: "Flux.2-klein-4b/lora", 4096: "Flux.2-klein-9b/lora"}

TINY = TinyModel(
    model_config=lambda: comfy.supported_models.Flux2(dict(_TINY_DIT)),
    clip_target=lambda: comfy.supported_models_base.ClipTarget(comfy.text_encoders.flux.KleinTokenizer,
                                                               comfy.text_encoders.flux.klein_te()),
    text_encoder_options={"qwen3_4b_model_config": dict(TINY_QWEN3)},
    latent_channels=128,
    tooltip="flux2: Flux.2 Klein DiT (Qwen3 text, 128-channel 16x latents)",
    vae=tiny_vae,
)

# Flux.2 dev: the same DiT with guidance input, reading three hidden states (layers 10, 20, 30) of ComfyUI's
# Mistral-Small-3 class, so the tiny one keeps 31 narrow layers (the head width, 128, is fixed by the class).
TINY_MISTRAL3 = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 31, "num_attention_heads": 1,
                 "num_key_value_heads": 1}
# Mistral's control tokens at their tekken ranks (<pad> = 11: Mistral3Tokenizer pads with it; the Flux.2 template
# uses [INST] and [SYSTEM_PROMPT]); ranks 12-16 are unused here.
_TEKKEN_SPECIAL = {0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]", 11: "<pad>", 17: "[SYSTEM_PROMPT]",
                   18: "[/SYSTEM_PROMPT]"}
_TEKKEN_SPECIAL_COUNT = 20


def tiny_tekken() -> bytes:
    """A tekken tokenizer JSON (the format ComfyUI reads from a Flux.2 dev text encoder file: the released one is in
    the file, not shipped) with byte-level tokens only: every text tokenises, one token per UTF-8 byte."""
    vocab = [{"rank": byte, "token_bytes": base64.b64encode(bytes([byte])).decode()} for byte in range(256)]
    special = [{"rank": rank, "token_str": _TEKKEN_SPECIAL.get(rank, f"<SPECIAL_{rank}>"), "is_control": True}
               for rank in range(_TEKKEN_SPECIAL_COUNT)]
    config = {"pattern": "", "default_vocab_size": _TEKKEN_SPECIAL_COUNT + 256,
              "default_num_special_tokens": _TEKKEN_SPECIAL_COUNT}
    return json.dumps({"config": config, "vocab": vocab, "special_tokens": special}).encode()


_TINY_DEV_DIT = dict(_TINY_DIT, context_in_dim=3 * TINY_MISTRAL3["hidden_size"], guidance_embed=True)

TINY_VARIANTS = {
    "flux2_dev": TinyModel(
        model_config=lambda: comfy.supported_models.Flux2(dict(_TINY_DEV_DIT)),
        clip_target=lambda: comfy.supported_models_base.ClipTarget(comfy.text_encoders.flux.Flux2Tokenizer,
                                                                   comfy.text_encoders.flux.flux2_te()),
        text_encoder_options={"mistral3_24b_model_config": dict(TINY_MISTRAL3, vocab_size=_TEKKEN_SPECIAL_COUNT + 256)},
        latent_channels=128,
        tooltip="flux2_dev: Flux.2 dev DiT (Mistral-3 text with a byte-level tekken tokenizer, guidance input)",
        vae=tiny_vae,
        tokenizer_data=lambda: {"tekken_model": tiny_tekken()},
    ),
}

FAMILY = Family(
    name="flux2",
    description="Flux.2 dev / Klein DiT",
    recognise=lambda model: isinstance(model, comfy.model_base.Flux2),
    # Attention and MLP of both streams of the double blocks (the MLP's gated in-projection and out-projection),
    # both linears of the single blocks (fused qkv + gated MLP in; attention + MLP out). The shared modulation
    # layers stay frozen, as in ai-toolkit's and musubi-tuner's Flux.2 LoRAs.
    lora_preset=TargetPreset("flux2", (r"^double_blocks\.\d+\.(img|txt)_(attn\.(qkv|proj)|mlp\.[02])$",
                                       r"^single_blocks\.\d+\.(linear1|linear2)$")),
    text_tokens=512,  # ComfyUI pads Flux.2 text to 512 tokens (model_base.Flux2.extra_conds)
    diffusers_component="transformer",
    # diffusers' Flux2Transformer2DModel names: ComfyUI's key map (comfy.utils.flux_to_diffusers, shared with Flux.1)
    # lists Flux.1's `ff.net.0.proj` / `ff.net.2` / `proj_out` first and these Flux.2 names after them.
    diffusers_names_preferred=(r"\.ff(_context)?\.linear_(in|out)$",
                               r"\.single_transformer_blocks\.\d+\.attn\.to_(qkv_mlp_proj|out)$"),
    # musubi-tuner (its sai_model_spec) writes modelspec.architecture "Flux.2-dev/lora", "Flux.2-klein-4b/lora" or
    # "Flux.2-klein-9b/lora" and no ss_base_model_version (sd-scripts itself has no Flux.2): the variant is read
    # from the model's width; other widths (the tiny model, an unknown variant) get none rather than a wrong one.
    kohya_base=("", ""),
    kohya_architecture=lambda model: _ARCHITECTURES.get(model.model_config.unet_config.get("hidden_size")),
    latent_downscale=16,
    tiny=TINY,
    tiny_variants=TINY_VARIANTS,
    position=4,
)
