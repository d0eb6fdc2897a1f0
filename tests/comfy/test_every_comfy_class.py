"""Every other image / video diffusion class ComfyUI 0.33 ships (no family module describes them: Headroom's generic
path, targets all_linear), built tiny from ComfyUI's own classes with seeded random weights: it trains a few steps and
the saved LoRA samples through the stock Load LoRA + KSampler exactly as the trainer's validation did, with no key
left unloaded (family_checks.check_stock_round_trip), or it is refused before any step with a message naming the
class and what is missing. docs/FAMILIES.md's table says which.

How each is made tiny: its `supported_models` config with a small unet_config (the geometry ComfyUI's detection fixes
kept where the class needs it: head widths, RoPE axes), its own text encoder class shrunk through ComfyUI's
`<name>_model_config` options (vision towers, which ComfyUI builds at their released size whatever the config, are
rebuilt small through the `<name>_class` option: prompts never reach them), tokenizers ComfyUI reads from the text
encoder file (Gemma 2's sentencepiece, GPT-OSS's tokenizer.json, Mistral's tekken) made small and byte-level, and a
VAE of the model's latent format (channels, downscale, image or video latents)."""
from __future__ import annotations

import dataclasses
import functools
import io
import re
from collections.abc import Callable

import pytest
import torch

from family_checks import cached_data, check_stock_round_trip, init_run

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]

_TEXT = 32  # every tiny text encoder's width


# --- tokenizers ComfyUI reads from the text encoder file ------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _gemma_spiece() -> bytes:
    """A sentencepiece model with Gemma's special ids (pad 0, eos 1, bos 2, unk 3), byte fallback: every text
    tokenises. The released one is read out of the Gemma 2 text encoder file (`spiece_model`)."""
    import sentencepiece

    model = io.BytesIO()
    words = "a red green blue circle square triangle at the center moving right left top bottom photo of".split()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([" ".join(words[i:] + words[:i]) for i in range(len(words))]), model_writer=model,
        vocab_size=320, model_type="bpe", byte_fallback=True, character_coverage=1.0, hard_vocab_limit=False,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, minloglevel=2)
    return model.getvalue()


@functools.lru_cache(maxsize=1)
def _byte_level_tokenizer_json() -> bytes:
    """A `tokenizers` JSON with one token per byte (GPT-OSS's is read out of the Lens text encoder file)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: i for i, char in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer.to_str().encode()


def _tekken() -> dict:
    """Mistral's tekken tokenizer, byte-level (ErnieImage's Ministral-3 reads it from its text encoder file)."""
    from headroom.nodes.bridge.families.flux2 import tiny_tekken

    return {"tekken_model": tiny_tekken()}


# --- text encoders: ComfyUI's classes with their vision towers small --------------------------------------------
_TINY_LLM = {"hidden_size": _TEXT, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1}


def _small_qwen3vl_vision(clip_model):
    """`clip_model` (a Qwen3-VL SDClipModel class) with its vision tower built at width 32, one block."""
    from comfy.text_encoders.qwen3vl import QWEN3VL_VISION_COMMON, Qwen3VLVisionModel

    class SmallVision(clip_model):
        def __init__(self, device="cpu", dtype=None, model_options={}, **kwargs):
            super().__init__(device=device, dtype=dtype, model_options=model_options, **kwargs)
            config = {**QWEN3VL_VISION_COMMON, "num_heads": 2, "hidden_size": 32, "intermediate_size": 64,
                      "depth": 1, "deepstack_visual_indexes": [0], "num_position_embeddings": 16,
                      "out_hidden_size": _TEXT}
            self.transformer.visual = Qwen3VLVisionModel(config, device=device, dtype=dtype, ops=self.operations)

    return SmallVision


def _small_qwen25vl_vision(clip_model):
    """`clip_model` (a Qwen2.5-VL SDClipModel class) with its vision tower built at width 32, one block."""
    from comfy.text_encoders.qwen_vl import Qwen2VLVisionTransformer

    class SmallVision(clip_model):
        def __init__(self, device="cpu", dtype=None, model_options={}, **kwargs):
            super().__init__(device=device, dtype=dtype, model_options=model_options, **kwargs)
            self.transformer.visual = Qwen2VLVisionTransformer(
                hidden_size=32, output_hidden_size=_TEXT, intermediate_size=64, num_heads=2, num_layers=1,
                device=device, dtype=dtype, ops=self.operations)

    return SmallVision


# --- VAEs ---------------------------------------------------------------------------------------------------------
def _flux_vae():
    from headroom.nodes.bridge.families.base import autoencoder_kl

    return autoencoder_kl(16)


def _flux2_vae():
    from headroom.nodes.bridge.families.flux2 import tiny_vae

    return tiny_vae()


def _wan_vae():
    from headroom.nodes.bridge.families.qwen_image import _tiny_wan_vae

    return _tiny_wan_vae()


def _pixel_space():
    """ComfyUI's pixel-space "VAE" (what its loader makes of a `pixel_space_vae` file): pixels are the latents."""
    return None, None


_HUNYUAN_VIDEO_VAE = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 32,
                      "ch_mult": [1, 1, 2, 2], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0,
                      "conv3d": True, "time_compress": 4}


def _hunyuan_video_vae():
    from comfy.ldm.models.autoencoder import AutoencoderKL

    return AutoencoderKL(ddconfig=dict(_HUNYUAN_VIDEO_VAE), embed_dim=16), {"ddconfig": _HUNYUAN_VIDEO_VAE}


def _narrow_hunyuan_video_vae_class():
    import comfy.model_management
    import comfy.sd
    from comfy.ldm.models.autoencoder import AutoencoderKL
    from headroom.nodes.bridge.families.hunyuan_image import _without_no_vae_warning, load_narrow_vae

    class NarrowHunyuanVideoVAE(comfy.sd.VAE):
        """comfy.sd.VAE holding the HunyuanVideo VAE (causal 3-D AutoencoderKL, 16 channels, 8x spatial / 4x
        temporal: Kandinsky 5's video latents) at base width 32: ComfyUI's detection builds it at 128 only. The
        settings are those of that detection branch (comfy/sd.py, `decoder.conv_in.conv.weight`)."""

        def __init__(self, sd=None, config=None, **kwargs):
            with _without_no_vae_warning():
                super().__init__(sd={})
            self.first_stage_model = AutoencoderKL(ddconfig=dict(config["ddconfig"]), embed_dim=16).eval()
            self.upscale_ratio = (lambda a: max(0, a * 4 - 3), 8, 8)
            self.upscale_index_formula = (4, 8, 8)
            self.downscale_ratio = (lambda a: max(0, (a + 3) // 4), 8, 8)
            self.downscale_index_formula = (4, 8, 8)
            self.latent_dim = 3
            self.latent_channels = 16
            self.working_dtypes = [torch.bfloat16, torch.float16, torch.float32]
            size = comfy.model_management.dtype_size
            self.memory_used_decode = lambda shape, dtype: 2800 * 8 * shape[3] * shape[4] * 64 * size(dtype)
            self.memory_used_encode = lambda shape, dtype: 1400 * 9 * shape[3] * shape[4] * size(dtype)
            load_narrow_vae(self, sd)

    return NarrowHunyuanVideoVAE


# --- the classes ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Tiny:
    config: str  # the comfy.supported_models class
    unet: dict  # its unet_config, small
    text_encoder_options: Callable[[], dict]  # comfy.sd.CLIP model_options: the encoder's size (and class) options
    vae: Callable[[], tuple]  # -> (module to seed, comfy.sd.VAE config), or (None, None): pixel space
    tokenizer_data: Callable[[], dict] = dict
    vae_class: Callable[[], type] | None = None
    shrink: Callable[[object], None] | None = None  # a model_base model -> parts its class builds at a fixed size, small
    # -> the text encoder's weights, for encoders whose layers get them only from a file (else init_weights_ seeds them)
    text_encoder_weights: Callable[[], dict] | None = None


_TINY_GPT_OSS = {"vocab_size": 256, "hidden_size": _TEXT, "intermediate_size": 32, "num_hidden_layers": 2,
                 "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_local_experts": 2,
                 "num_experts_per_tok": 1}


def _gpt_oss_weights() -> dict:
    """Lens's GPT-OSS layers are ComfyUI's mixed-precision ops, which get their weights only when a file is loaded:
    zeros of each layer's shape, under the names a text encoder file has them, for comfy.sd.CLIP's loading path (then
    seeded as every other encoder)."""
    import comfy.ops
    from comfy.text_encoders.gpt_oss import GptOss20BConfig, GptOssModel

    ops = comfy.ops.mixed_precision_ops({}, torch.float32, full_precision_mm=True)
    model = GptOssModel(GptOss20BConfig(**_TINY_GPT_OSS), device="cpu", dtype=torch.float32, ops=ops)
    weights = {}
    for name, module in model.named_modules():
        for key, value in module.named_parameters(prefix=name, recurse=False):
            weights[key] = torch.zeros(value.shape)
        if getattr(module, "weight", 0) is None or (hasattr(module, "in_features") and not hasattr(module, "weight")):
            shape = getattr(module, "_orig_shape", None) or (module.out_features, module.in_features)
            weights[f"{name}.weight"] = torch.zeros(shape)
    return {f"gpt_oss.transformer.{k}": v for k, v in weights.items()}


def _small_llm_adapter(model) -> None:
    """Anima's LLMAdapter (T5 token ids attending to Qwen3 features: comfy/ldm/anima/model.py) is built at its released
    1024 wide, 6 blocks whatever the unet_config: ComfyUI's class again at the tiny text width, one block."""
    import comfy.ops
    from comfy.ldm.anima.model import LLMAdapter

    operations = comfy.ops.pick_operations(None, model.manual_cast_dtype, model_config=model.model_config)
    model.diffusion_model.llm_adapter = LLMAdapter(source_dim=_TEXT, target_dim=_TEXT, model_dim=_TEXT, num_layers=1,
                                                   num_heads=2, dtype=model.get_dtype(), operations=operations)


def _kandinsky5_options():
    import comfy.text_encoders.kandinsky5

    return {"qwen25_7b_model_config": dict(_TINY_LLM),
            "qwen25_7b_class": _small_qwen25vl_vision(comfy.text_encoders.kandinsky5.Qwen25_7BVLIModel),
            "clip_l_model_config": {"hidden_size": _TEXT, "intermediate_size": 64, "num_hidden_layers": 2,
                                    "num_attention_heads": 2, "projection_dim": _TEXT}}


def _qwen3vl_options(name: str, clip_model: Callable[[], type]):
    return lambda: {f"{name}_model_config": dict(_TINY_LLM), f"{name}_class": _small_qwen3vl_vision(clip_model())}


def _joyimage_clip():
    import comfy.text_encoders.joyimage

    return comfy.text_encoders.joyimage._JoyImageClipModel


def _mage_flow_clip():
    import comfy.text_encoders.mage_flow

    return comfy.text_encoders.mage_flow.MageFlowQwen3VLClipModel


def _boogu_clip():
    import comfy.text_encoders.boogu

    return comfy.text_encoders.boogu.BooguQwen3VLClipModel


# Kandinsky 5: ComfyUI's detection sets head width = sum(axes_dims); the tiny one keeps Lite video's axes.
_KANDINSKY5 = {"image_model": "kandinsky5", "in_text_dim": _TEXT, "in_text_dim2": _TEXT, "time_dim": 32,
               "model_dim": 64, "ff_dim": 128, "num_text_blocks": 1, "num_visual_blocks": 1, "axes_dims": (16, 24, 24)}

# Cosmos Predict2 / Anima (comfy/ldm/cosmos/predict2.py MiniTrainDIT): the detection's settings, 2 heads of 32.
_COSMOS = {"image_model": "cosmos_predict2", "max_img_h": 240, "max_img_w": 240, "max_frames": 128, "in_channels": 16,
           "out_channels": 16, "patch_spatial": 2, "patch_temporal": 1, "model_channels": 64, "num_blocks": 1,
           "num_heads": 2, "concat_padding_mask": True, "crossattn_emb_channels": _TEXT, "pos_emb_cls": "rope3d",
           "pos_emb_learnable": True, "pos_emb_interpolation": "crop", "min_fps": 1, "max_fps": 30,
           "use_adaln_lora": True, "adaln_lora_dim": 16, "extra_per_block_abs_pos_emb": False,
           "rope_h_extrapolation_ratio": 4.0, "rope_w_extrapolation_ratio": 4.0, "rope_t_extrapolation_ratio": 1.0,
           "extra_h_extrapolation_ratio": 1.0, "extra_w_extrapolation_ratio": 1.0, "extra_t_extrapolation_ratio": 1.0,
           "rope_enable_fps_modulation": False}

# Lumina 2 NextDiT with Lumina 2.0's detection geometry (RoPE axes 32 x 3: 96-wide heads), one head, one layer.
_LUMINA2 = {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 96, "cap_feat_dim": _TEXT,
            "n_layers": 1, "n_refiner_layers": 1, "qk_norm": True, "n_heads": 1, "n_kv_heads": 1,
            "axes_dims": [32, 32, 32], "axes_lens": [300, 512, 512], "rope_theta": 10000.0,
            "ffn_dim_multiplier": 4.0}

# OmniGen2 / Boogu: head width = sum(axes_dim_rope) (the released 120: 40 x 3), one head.
_OMNIGEN2 = {"image_model": "omnigen2", "axes_dim_rope": [8, 12, 12], "axes_lens": [1024, 1664, 1664],
             "ffn_dim_multiplier": None, "hidden_size": 32, "in_channels": 16, "multiple_of": 32, "norm_eps": 1e-05,
             "num_attention_heads": 1, "num_kv_heads": 1, "num_layers": 1, "num_refiner_layers": 1,
             "out_channels": None, "patch_size": 2, "text_feat_dim": _TEXT, "timestep_scale": 1000.0}

CLASSES = {
    "Kandinsky5": Tiny("Kandinsky5", dict(_KANDINSKY5, visual_embed_dim=4 * (16 + 16 + 1)), _kandinsky5_options,
                       _hunyuan_video_vae, vae_class=_narrow_hunyuan_video_vae_class),
    "Kandinsky5Image": Tiny("Kandinsky5Image", dict(_KANDINSKY5, visual_embed_dim=4 * 16,
                                                    rope_scale_factor=(1.0, 1.0, 1.0)),
                            _kandinsky5_options, _flux_vae),
    "ErnieImage": Tiny("ErnieImage", {"image_model": "ernie", "hidden_size": 128, "num_attention_heads": 1,
                                      "num_layers": 1, "ffn_hidden_size": 64, "text_in_dim": _TEXT},
                       lambda: {"ministral3_3b_model_config": dict(_TINY_LLM, num_hidden_layers=3)}, _flux2_vae,
                       tokenizer_data=_tekken),
    "JoyImage": Tiny("JoyImage", {"image_model": "joyimage", "hidden_size": 128, "num_attention_heads": 1,
                                  "text_dim": _TEXT, "num_layers": 1},
                     _qwen3vl_options("qwen3vl_8b", _joyimage_clip), _wan_vae),
    "Lens": Tiny("Lens", {"image_model": "lens", "in_channels": 128, "out_channels": 32, "num_layers": 1,
                          "attention_head_dim": 64, "num_attention_heads": 1, "enc_hidden_dim": _TEXT,
                          "multi_layer_encoder_feature": True, "selected_layer_index": (0, 1)},
                 lambda: {"gpt_oss_config": dict(_TINY_GPT_OSS), "selected_layers": (0, 1), "txt_offset": 4},
                 _flux2_vae, tokenizer_data=lambda: {"tokenizer_json": _byte_level_tokenizer_json()},
                 text_encoder_weights=_gpt_oss_weights),
    "MageFlow": Tiny("MageFlow", {"image_model": "mage_flow", "in_channels": 128, "out_channels": 128,
                                  "num_layers": 1, "attention_head_dim": 128, "num_attention_heads": 1,
                                  "joint_attention_dim": _TEXT},
                     _qwen3vl_options("qwen3vl_4b", _mage_flow_clip), _flux2_vae),
    "PixelDiTT2I": Tiny("PixelDiTT2I", {"image_model": "pixeldit_t2i", "num_groups": 2, "hidden_size": 64,
                                        "pixel_hidden_size": 8, "pixel_attn_hidden_size": 32, "pixel_num_groups": 2,
                                        "patch_depth": 1, "pixel_depth": 1, "patch_size": 16, "txt_embed_dim": _TEXT},
                        lambda: {"gemma2_2b_model_config": dict(_TINY_LLM, vocab_size=512)}, _pixel_space,
                        tokenizer_data=lambda: {"spiece_model": _gemma_spiece()}),
    "Anima": Tiny("Anima", dict(_COSMOS, image_model="anima"), lambda: {"qwen3_06b_model_config": dict(_TINY_LLM)},
                  _wan_vae, shrink=_small_llm_adapter),
    "CosmosT2IPredict2": Tiny("CosmosT2IPredict2", _COSMOS,
                              lambda: {"t5xxl_model_config": {"d_model": _TEXT, "d_ff": 64, "num_layers": 1,
                                                              "num_heads": 2, "d_kv": 16}}, _wan_vae),
    "Lumina2": Tiny("Lumina2", _LUMINA2, lambda: {"gemma2_2b_model_config": dict(_TINY_LLM, num_hidden_layers=3,
                                                                                 vocab_size=512)},
                    _flux_vae, tokenizer_data=lambda: {"spiece_model": _gemma_spiece()}),
    "Omnigen2": Tiny("Omnigen2", _OMNIGEN2, lambda: {"qwen25_3b_model_config": dict(_TINY_LLM)}, _flux_vae),
    "Boogu": Tiny("Boogu", {**{k: v for k, v in _OMNIGEN2.items() if k != "text_feat_dim"}, "image_model": "boogu",
                            "num_double_stream_layers": 1, "instruction_feat_dim": _TEXT,
                            "axes_lens": [2048, 1664, 1664]},
                  _qwen3vl_options("qwen3vl_8b", _boogu_clip), _flux_vae),
}


def build(name: str):
    """(MODEL, CLIP, VAE) of a tiny `name` through ComfyUI's own classes, seeded (as tests/comfy/test_generic_model.py
    builds AuraFlow)."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.sd
    import comfy.supported_models
    from headroom.nodes.bridge.tiny_models import init_weights_

    spec = CLASSES[name]
    with torch.inference_mode(False):
        config = getattr(comfy.supported_models, spec.config)(dict(spec.unet))
        config.set_inference_dtype(torch.float32, None)
        model = config.get_model({}, "")
        if spec.shrink is not None:
            spec.shrink(model)
        init_weights_(model.diffusion_model, 0)
        patcher = comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                                   offload_device=mm.unet_offload_device())
        weights = spec.text_encoder_weights() if spec.text_encoder_weights is not None else []
        clip = comfy.sd.CLIP(config.clip_target(), parameters=0, model_options=spec.text_encoder_options(),
                             tokenizer_data=spec.tokenizer_data(), state_dict=weights)
        init_weights_(clip.cond_stage_model, 1)
        module, vae_config = spec.vae()
        if module is None:
            vae = comfy.sd.VAE(sd={"pixel_space_vae": torch.tensor(1.0)})
        else:
            init_weights_(module, 2)
            vae = (spec.vae_class() if spec.vae_class else comfy.sd.VAE)(sd=module.state_dict(), config=vae_config)
    return patcher, clip, vae


# What Init shows on the node before training for classes that take inputs the caches do not hold.
NOTES = {"Kandinsky5": r"^Train LoRA: Init \(Headroom\): Kandinsky5: its image-to-video checkpoints take a start image "
                       r"\(the stock Kandinsky5ImageToVideo node's .*this run trains text-to-video"}
# Classes refused at Init, before any step: the message names the class and why.
REFUSED = {"PixelDiTT2I": r"^Train LoRA: Init \(Headroom\): this MODEL \(PixelDiTT2I\) cannot train a LoRA: ComfyUI's "
                          r"PixelDiT blocks modulate and update their activations in place .*; train another model$"}
TRAINED = [name for name in CLASSES if name not in REFUSED]


def check_training_input_is_the_samplers(model, latents, texts) -> None:
    """The model input the trainer makes of a latent at a noise level is the one ComfyUI's samplers make at the same
    sigma (model_sampling.noise_scaling; Cosmos Predict2's rectified flow under EDM sigmas: t = sigma / (1 + sigma)),
    so the model's prediction, the trainer's x0 estimate, is the same."""
    from headroom.nodes.bridge.comfy_model import ComfyDenoiser
    from headroom.training.core.objective import Objective
    from headroom.training.data.cache_store import item_conditioning

    denoiser = ComfyDenoiser(model)
    sampling = model.get_model_object("model_sampling")
    x0 = model.model.process_latent_in(latents.latent(0).unsqueeze(0).float())
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.6])
    sigma = Objective(denoiser.sampling).sigma_at(t)
    comfy_sigma = t / (1 - t) if denoiser.edm_flow else sigma
    cond = item_conditioning(texts, latents, 0)
    with torch.no_grad():
        trained = denoiser.predict(Objective(denoiser.sampling).noisy(x0, noise, sigma), sigma, [cond])
        conds = denoiser._model_conds(x0, [cond])  # the inputs extra_conds makes, as predict gives them
        sampled = model.model.apply_model(sampling.noise_scaling(comfy_sigma, noise, x0), comfy_sigma,
                                          transformer_options={}, **conds)
    torch.testing.assert_close(trained, sampled, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", TRAINED)
def test_class_trains_with_all_linear_and_round_trips_through_the_stock_nodes(comfyui, caplog, name):
    from headroom.nodes.bridge import families

    model, clip, vae = build(name)
    assert type(model.model.model_config).__name__ == name
    assert families.family_of(model.model) is None  # the generic path: no family module
    latents, texts = cached_data(model, clip, vae)
    check_training_input_is_the_samplers(model, latents, texts)
    run = init_run(model, latents, texts, f"every_{name}", 4, 2e-2, "all_linear", False)
    assert run.adapters.layers
    if name in NOTES:
        assert re.match(NOTES[name], run.inputs_note), run.inputs_note
    else:
        assert not run.inputs_note
    check_stock_round_trip(run, model, clip, vae, caplog, steps_trained=4, label=name)


@pytest.mark.parametrize("name", list(REFUSED))
def test_class_is_refused_before_any_step_naming_it_and_why(comfyui, name):
    """Refused at Init (no run folder made), and the reason is real: a backward through the model fails."""
    from headroom.nodes.bridge.model_files import runs_root

    model, clip, vae = build(name)
    latents, texts = cached_data(model, clip, vae)
    with pytest.raises(ValueError, match=REFUSED[name]):
        init_run(model, latents, texts, f"every_{name}", 4, 2e-2, "all_linear", False)
    assert not (runs_root() / f"every_{name}").exists()
    x = model.model.process_latent_in(latents.latent(0).unsqueeze(0).float()).requires_grad_(True)
    cross_attn = texts.empty_conditioning()["cross_attn"].unsqueeze(0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model.model.diffusion_model(x, torch.tensor([500.0]), context=cross_attn).sum().backward()


def test_comfy_kitchen_rope_backward_is_its_eager_references(comfyui):
    """The backward nodes/bridge/rope_autograd.py gives comfy_kitchen's RoPE ops (which have none) is the gradient of
    comfy_kitchen's own plain-torch reference, for the ops ComfyUI's models call while training."""
    from comfy_kitchen.backends.eager import rope as eager
    from headroom.nodes.bridge.rope_autograd import register_rope_autograd

    register_rope_autograd()
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 5, 2, 8, generator=generator) for _ in range(2))
    freqs = torch.randn(1, 5, 1, 4, 2, 2, generator=generator)
    scale = torch.rand(8, generator=generator)
    for name, extra in (("apply_rope_split_half", ()), ("apply_rope", ()), ("rms_rope", (scale, scale, 1e-6)),
                        ("rms_rope_split_half", (scale, scale, 1e-6))):
        grads = []
        for function in (getattr(torch.ops.comfy_kitchen, name), getattr(eager, name)):
            inputs = [q.clone().requires_grad_(True), k.clone().requires_grad_(True)]
            outputs = function(*inputs, freqs, *extra)
            loss = sum((out * torch.arange(out.numel()).reshape(out.shape)).sum() for out in outputs)
            grads.append(torch.autograd.grad(loss, inputs))
        for ours, reference in zip(*grads):
            torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5, msg=name)
