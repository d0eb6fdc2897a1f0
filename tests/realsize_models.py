"""Real-size models from ComfyUI's own classes, with seeded random weights (nothing is downloaded).

Shared by the real-size test tier (tests/realsize/test_realsize.py, tests/realsize_worker.py) and the benchmarks
(bench/bench_realsize.py, bench/gpu/suite.py). Each builder mirrors nodes/bridge/tiny_models.py at real width:

- diffusion models: the `unet_config` ComfyUI's model_detection derives from the released checkpoints, through
  `model_config_from_unet_config` -> `supported_models` config -> `model_base` model -> ModelPatcher. SDXL is
  full size (2.57 B); SD3.5-Large and Flux-dev keep their real width (2432 / 3072) with a selectable depth.
- text encoders: `comfy.sd.CLIP` with ComfyUI's CLIP-L / CLIP-G / T5-XXL classes and their shipped configs and
  tokenizers; T5-XXL keeps its width (4096, d_ff 10240, 64 heads) with fewer layers through ComfyUI's own
  `t5xxl_model_config` model option.
- VAEs: `comfy.sd.VAE` through its state-dict detection path, as a real file takes it: the SD / SDXL VAE
  (AutoencoderKL, 4 latent channels) or the SD3 / Flux VAE (AutoencodingEngine, 16 latent channels).

No builder holds a second copy of the weights: ComfyUI's ops allocate parameters uninitialised (`torch.empty`)
and `random_init_` fills each one in place, one tensor at a time.
"""
from __future__ import annotations

import contextlib
import logging
import math

import torch

# unet_config dicts as comfy/model_detection.py derives them from the released checkpoints.
ARCHITECTURES = {
    "sdxl": {
        "text_tokens": 77, "text_encoder": "sdxl", "latent_channels": 4, "depth": None,
        "unet_config": {
            "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
            "legacy": False, "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4,
            "model_channels": 320, "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10],
            "channel_mult": [1, 2, 4], "transformer_depth_middle": 10, "use_linear_in_transformer": True,
            "context_dim": 2048, "num_head_channels": 64, "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
            "use_temporal_attention": False, "use_temporal_resblock": False,
        },
    },
    "sd35_large": {
        # MMDiT's width is 64 * depth by construction (depth 38 -> 2432 wide, 38 heads); `num_blocks` sets how many
        # joint blocks there are, so a reduced-depth model keeps the real width.
        "text_tokens": 154, "text_encoder": "sd3", "latent_channels": 16, "depth": 38,
        "unet_config": {
            "in_channels": 16, "patch_size": 2, "out_channels": 16, "depth": 38, "input_size": None,
            "adm_in_channels": 2048,
            "context_embedder_config": {"target": "torch.nn.Linear", "params": {"in_features": 4096, "out_features": 2432}},
            "num_patches": 36864, "pos_embed_max_size": 192, "qk_norm": "rms", "pos_embed_scaling_factor": None,
            "x_block_self_attn_layers": [],
        },
    },
    "flux_dev": {
        "text_tokens": 256, "text_encoder": "flux", "latent_channels": 16, "depth": (19, 38),
        "unet_config": {
            "image_model": "flux", "axes_dim": [16, 56, 56], "num_heads": 24, "mlp_ratio": 4.0, "theta": 10000,
            "out_channels": 16, "qkv_bias": True, "txt_ids_dims": [], "in_channels": 16, "hidden_size": 3072,
            "context_in_dim": 4096, "patch_size": 2, "vec_in_dim": 768, "depth": 19, "depth_single_blocks": 38,
            "guidance_embed": True, "yak_mlp": False, "txt_norm": False,
        },
    },
    "zimage": {
        # Z-Image (Turbo) as comfy/model_detection.py derives it from the released file (dim 3840 -> 30 heads of 128,
        # RoPE [32, 48, 48], theta 256, FFN 8/3, Z-Image modulation; cap_pad_token -> pad to 32; 2 noise / 2 caption
        # refiner layers, the class default, which detection does not read); `n_layers` sets the main depth (30).
        "text_tokens": 128, "text_encoder": "zimage", "latent_channels": 16, "vae": "flux", "depth": 30,
        "unet_config": {
            "image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 3840, "cap_feat_dim": 2560,
            "n_layers": 30, "qk_norm": True, "n_heads": 30, "n_kv_heads": 30, "axes_dims": [32, 48, 48],
            "axes_lens": [1536, 512, 512], "rope_theta": 256.0, "ffn_dim_multiplier": 8.0 / 3.0,
            "z_image_modulation": True, "time_scale": 1000.0, "pad_tokens_multiple": 32,
        },
    },
    "qwen_image": {
        # Qwen-Image: detection reads the input channels and the depth (60 blocks); the rest is the class default
        # (24 heads of 128 = 3072 wide, text width 3584).
        "text_tokens": 128, "text_encoder": "qwen_image", "latent_channels": 16, "vae": "wan21", "depth": 60,
        "unet_config": {"image_model": "qwen_image", "in_channels": 64, "num_layers": 60},
    },
}


def _flux2(hidden: int, context: int, depth: int, single: int, guidance: bool, text_tokens: int = 512) -> dict:
    """A Flux.2 unet_config as comfy/model_detection.py derives it from a Flux.2 checkpoint (the geometry it fixes
    for every Flux.2: 128-wide heads on four 32-wide RoPE axes, mlp_ratio 3, theta 2000, no biases, global
    modulation, SiLU-gated MLPs, 128-channel latents, patch 1; width, context width, depths and the guidance input
    read from the weights). The sizes are those of Black Forest Labs' released models (their flux2 code's
    Flux2Params / Klein4BParams / Klein9BParams, which musubi-tuner and ai-toolkit reuse)."""
    return {
        "text_tokens": text_tokens, "text_encoder": None, "latent_channels": 128, "depth": (depth, single),
        "unet_config": {
            "image_model": "flux2", "axes_dim": [32, 32, 32, 32], "num_heads": hidden // 128, "mlp_ratio": 3.0,
            "theta": 2000, "out_channels": 128, "global_modulation": True, "mlp_silu_act": True, "qkv_bias": False,
            "ops_bias": False, "default_ref_method": "index", "ref_index_scale": 10.0, "txt_ids_dims": [3],
            "in_channels": 128, "hidden_size": hidden, "context_in_dim": context, "patch_size": 1, "vec_in_dim": None,
            "depth": depth, "depth_single_blocks": single, "guidance_embed": guidance, "yak_mlp": False,
            "txt_norm": False,
        },
    }


# Flux.2: dev (32 B; Mistral-Small-3 text, 3 x 5120 wide), Klein 4B (Qwen3-4B, 3 x 2560), Klein 9B (Qwen3-8B, 3 x 4096).
ARCHITECTURES.update({
    "flux2_dev": _flux2(6144, 15360, 8, 48, guidance=True),
    "flux2_klein_4b": _flux2(3072, 7680, 5, 20, guidance=False),
    "flux2_klein_9b": _flux2(4096, 12288, 8, 24, guidance=False),
    # Families whose real-size coverage is their LoRA key names (tests/realsize_keys.py): the unet_config
    # comfy/model_detection derives from the released checkpoints (checked there: detect_unet_config of the
    # full-depth model's keys gives it back).
    "sd15": {  # model_detection's SD15: SD2.1's layout with CLIP-L's 768-wide context, 8 heads, conv projections
        "text_tokens": 77, "text_encoder": "sd15", "latent_channels": 4, "depth": None,
        "unet_config": {
            "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
            "legacy": False, "adm_in_channels": None, "in_channels": 4, "model_channels": 320,
            "num_res_blocks": [2, 2, 2, 2], "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0], "channel_mult": [1, 2, 4, 4],
            "transformer_depth_middle": 1, "use_linear_in_transformer": False, "context_dim": 768, "num_heads": 8,
            "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
            "use_temporal_attention": False, "use_temporal_resblock": False,
        },
    },
    "sd21_768_v": {  # model_detection's SD21 (SD2.1-768-v / 512-base share the UNet; v comes from the weights)
        "text_tokens": 77, "text_encoder": "sd2", "latent_channels": 4, "depth": None,
        "unet_config": {
            "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
            "legacy": False, "adm_in_channels": None, "in_channels": 4, "model_channels": 320,
            "num_res_blocks": [2, 2, 2, 2], "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0], "channel_mult": [1, 2, 4, 4],
            "transformer_depth_middle": 1, "use_linear_in_transformer": True, "context_dim": 1024,
            "num_head_channels": 64, "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
            "use_temporal_attention": False, "use_temporal_resblock": False,
        },
    },
    "chroma": {  # Chroma1-HD: 8.90 B, Flux-dev's width without the per-block modulations, T5-XXL only
        "text_tokens": 256, "text_encoder": "chroma", "latent_channels": 16, "depth": (19, 38),
        "unet_config": {
            "image_model": "chroma", "axes_dim": [16, 56, 56], "num_heads": 24, "mlp_ratio": 4.0, "theta": 10000,
            "out_channels": 64, "qkv_bias": True, "txt_ids_dims": [], "in_channels": 64, "hidden_size": 3072,
            "context_in_dim": 4096, "patch_size": 2, "vec_in_dim": None, "depth": 19, "depth_single_blocks": 38,
            "in_dim": 64, "out_dim": 3072, "hidden_dim": 5120, "n_layers": 5,
        },
    },
    "hidream_i1": {  # HiDream-I1: 17 B, 16 double- + 32 single-stream MoE blocks, 2560 wide
        "text_tokens": 128, "text_encoder": "hidream", "latent_channels": 16, "depth": (16, 32),
        "unet_config": {
            "image_model": "hidream", "attention_head_dim": 128, "axes_dims_rope": [64, 32, 32],
            "caption_channels": [4096, 4096], "max_resolution": [128, 128], "in_channels": 16,
            "llama_layers": [*range(32), *[31] * 16], "num_attention_heads": 20, "num_routed_experts": 4,
            "num_activated_experts": 2, "num_layers": 16, "num_single_layers": 32, "out_channels": 16, "patch_size": 2,
            "text_emb_dim": 2048,
        },
    },
    "hunyuan_image_21": {
        # HunyuanImage 2.1 (base) as comfy/model_detection.py derives it from the released file: 3584 wide (28 heads
        # of 128), 20 double- + 40 single-stream blocks, 1x1 patches of 64 latent channels, Qwen2.5-VL-7B text
        # (3584), the byT5 mapper, no guidance input (the distilled checkpoint has one), no meanflow.
        "text_tokens": 128, "text_encoder": "hunyuan_image", "latent_channels": 64, "depth": (20, 40),
        "unet_config": {
            "image_model": "hunyuan_video", "in_channels": 64, "patch_size": [1, 1], "out_channels": 64,
            "vec_in_dim": None, "axes_dim": [64, 64], "meanflow": False, "context_in_dim": 3584, "hidden_size": 3584,
            "mlp_ratio": 4.0, "num_heads": 28, "depth": 20, "depth_single_blocks": 40, "theta": 256,
            "qkv_bias": True, "byt5": True, "guidance_embed": False, "use_cond_type_embedding": False,
            "vision_in_dim": None, "meanflow_sum": False,
        },
    },
})


def _wan21(dim: int, ffn_dim: int, depth: int) -> dict:
    """Wan 2.1 text-to-video as comfy/model_detection.py derives it from the released file: 128-wide heads, patch
    (1, 2, 2), frequency width 256, qk and cross-attention norms; width, FFN width and depth read from the weights
    (the text width, 4096 = UMT5-XXL's, is the class default). Wan 2.2 A14B's two experts are the 14B geometry."""
    return {
        "text_tokens": 512, "text_encoder": None, "latent_channels": 16, "vae": "wan21", "depth": depth,
        "unet_config": {
            "image_model": "wan2.1", "dim": dim, "out_dim": 16, "num_heads": dim // 128, "ffn_dim": ffn_dim,
            "num_layers": depth, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
            "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16, "model_type": "t2v",
        },
    }


ARCHITECTURES.update({"wan21_14b": _wan21(5120, 13824, 40), "wan21_1_3b": _wan21(1536, 8960, 30)})
# Wan 2.1 I2V 14B as detected from the released file: 36 input channels (latent, mask, start latent), the CLIP-vision
# projection img_emb (which makes it "i2v") and the image keys / values of every block's cross-attention.
ARCHITECTURES["wan21_i2v_14b"] = {**_wan21(5120, 13824, 40)}
ARCHITECTURES["wan21_i2v_14b"]["unet_config"] = {**ARCHITECTURES["wan21_14b"]["unet_config"], "in_dim": 36,
                                                 "model_type": "i2v"}
ARCHITECTURES["hunyuan_video15"] = {
    # HunyuanVideo 1.5 (8.3B, 480p / 720p text-to-video and image-to-video: one architecture, the same keys) as
    # comfy/model_detection.py derives it from the released file: 2048 wide (16 heads of 128), 54 double-stream
    # blocks and no single-stream ones, 3-D 1x1x1 patches of 65
    # input channels (latents, image latents, mask) and 32 output ones, Qwen2.5-VL-7B text (3584), the byT5 mapper,
    # the cond-type embedding, the SigLIP vision input (1152), no guidance input, no meanflow.
    "text_tokens": 256, "text_encoder": None, "latent_channels": 32, "depth": (54, 0),
    "unet_config": {
        "image_model": "hunyuan_video", "in_channels": 65, "patch_size": [1, 1, 1], "out_channels": 32,
        "vec_in_dim": None, "axes_dim": [16, 56, 56], "meanflow": False, "context_in_dim": 3584, "hidden_size": 2048,
        "mlp_ratio": 4.0, "num_heads": 16, "depth": 54, "depth_single_blocks": 0, "theta": 256, "qkv_bias": True,
        "byt5": True, "guidance_embed": False, "use_cond_type_embedding": True, "vision_in_dim": 1152,
        "meanflow_sum": True,
    },
}
ARCHITECTURES["ltx2"] = {
    # LTX-2 (19B audio-video) as comfy/model_detection.py derives it from the released file's keys: 48 blocks, 32 heads
    # of 128 (its detection fixes 32 heads and reads the width from attn2), text width 4096; the rest are LTXAVModel's
    # defaults, which are LTX-2's (the audio stream 32 heads of 64, caption_channels 3840 = Gemma 3 12B's width, 2-layer
    # connectors of 30 heads of 128). The file's metadata config repeats them; the key check reads the keys alone.
    "text_tokens": 1024, "text_encoder": None, "latent_channels": 128, "depth": 48,
    "unet_config": {"image_model": "ltxav", "num_layers": 48, "attention_head_dim": 128, "cross_attention_dim": 4096,
                    "use_keyframes_abs_pos_embedding": False},
}
ARCHITECTURES["krea2"] = {
    # Krea 2 as comfy/model_detection.py derives it from the released file: 6144 wide (first.weight), 48 heads and 12
    # KV heads of 128 (its detection's fixed head width), 28 blocks, patch 2, 16 channels, a 12-layer text stack of
    # Qwen3-VL-4B's 2560 (txtfusion.projector / prenorm); the text-fusion heads are the class default (20 of 128).
    # `layers` sets the depth (28). 12.8 B at full depth.
    "text_tokens": 128, "text_encoder": "krea2", "latent_channels": 16, "vae": "wan21", "depth": 28,
    "unet_config": {"image_model": "krea2", "features": 6144, "channels": 16, "patch": 2, "layers": 28, "heads": 48,
                    "kvheads": 12, "txtlayers": 12, "txtdim": 2560},
}
ARCHITECTURES["ideogram4"] = {
    # Ideogram 4 (9.3 B) as comfy/model_detection.py derives it from the released file: 128 input channels
    # (input_proj: Flux.2 latents) and 34 blocks (`layers`); the rest is supported_models.Ideogram4's
    # unet_extra_config, which sets it whatever the file: 18 heads of 256 (4608 wide), FFN 12288, adaLN 512, the
    # 13-layer Qwen3-VL-8B text stack of 4096 (53248).
    "text_tokens": 256, "text_encoder": "ideogram4", "latent_channels": 128, "depth": 34,
    "unet_config": {"image_model": "ideogram4", "in_channels": 128, "num_layers": 34},
}
ARCHITECTURES["hidream_o1"] = {
    # HiDream-O1-Image as ComfyUI builds it from the released file: its detection returns {"image_model": "hidream_o1"}
    # and every size is the class default (comfy/ldm/hidream_o1/model.py): Qwen3-VL-8B's decoder, 4096 wide, 36 layers
    # of 32 heads / 8 KV heads of 128, MLP 12288, its 151936-token embedding; the vision tower 1152 wide, 27 blocks.
    # `depth` sets the decoder layers (36); a reduced model also keeps one vision block (reference images only). No
    # text encoder weights (the "CLIP" only tokenizes) and no VAE (pixels in, pixels out). 8.8 B at full depth.
    "text_tokens": 128, "text_encoder": "hidream_o1", "latent_channels": 3, "vae": "pixel", "depth": 36,
    "unet_config": {"image_model": "hidream_o1"},
}
T5XXL_LAYERS = 24  # the released T5-XXL encoder


def unet_config(name: str, depth=None) -> dict:
    """The architecture's unet_config; `depth` reduces it at real width: SD3.5 joint blocks (int), Wan / LTX-2 blocks
    (int; Ideogram 4: blocks), Flux / Chroma / HunyuanImage 2.1 / HunyuanVideo 1.5 (double blocks, single blocks), HiDream (double-, single-stream blocks). The UNets (SDXL, SD2.1) are always
    full size."""
    config = dict(ARCHITECTURES[name]["unet_config"])
    if depth is None:
        return config
    if name == "sd35_large":
        config["num_blocks"] = int(depth)
    elif name == "zimage":
        config["n_layers"] = int(depth)
    elif name == "krea2":
        config["layers"] = int(depth)
    elif name == "hidream_o1":
        config["text_config_overrides"] = {"num_hidden_layers": int(depth)}
        if int(depth) < ARCHITECTURES[name]["depth"]:
            config["vision_config_overrides"] = {"depth": 1, "deepstack_visual_indexes": ()}
    elif name in ("qwen_image", "ltx2", "ideogram4") or name.startswith("wan21_"):
        config["num_layers"] = int(depth)
    elif name in ("flux_dev", "chroma", "hunyuan_image_21", "hunyuan_video15") or name.startswith("flux2_"):
        config["depth"], config["depth_single_blocks"] = (int(d) for d in depth)
    elif name == "hidream_i1":
        config["num_layers"], config["num_single_layers"] = (int(d) for d in depth)
    else:
        raise ValueError(f"{name} is built at full size only (depth=None)")
    return config


# On a CPU, torch draws normal numbers one element at a time (~10 ns each; its bf16 normal_ is a scalar loop): SDXL's
# 3.4 B weights took 35 of its 44 s build. There each tensor is instead a window of one seeded pool of N(0, 1) draws,
# from a random offset, copied from the pool scaled to the tensor's std and cast to its dtype (a few stds and dtypes
# follow each other in a model: the last few are kept). The pool's size is prime, so consecutive rows of a matrix are
# different windows of it, as are tensors of the same shape.
POOL_SIZE = 4_194_301  # the largest prime below 2 ** 22: 16 MiB of fp32 draws, doubled (any window is one slice)
SCALED_POOLS_KEPT = 4  # with the doubled pool, at most ~0.16 GiB while a module is filled; freed when random_init_ returns


class _NormalPool:
    def __init__(self, generator: torch.Generator):
        pool = torch.randn(POOL_SIZE, generator=generator)
        self.doubled = torch.cat([pool, pool])
        self.scaled: dict[tuple[torch.dtype, float], torch.Tensor] = {}
        self.generator = generator

    def _scaled(self, dtype: torch.dtype, std: float) -> torch.Tensor:
        key = (dtype, std)
        pool = self.scaled.pop(key, None)
        if pool is None:
            pool = (self.doubled * std).to(dtype)
            if len(self.scaled) >= SCALED_POOLS_KEPT:
                self.scaled.pop(next(iter(self.scaled)))
        self.scaled[key] = pool  # the most recent last
        return pool

    def normal_(self, param: torch.Tensor, std: float) -> None:
        flat, pool = param.view(-1), self._scaled(param.dtype, std)
        start = int(torch.randint(POOL_SIZE, (1,), generator=self.generator))
        for begin in range(0, flat.numel(), POOL_SIZE):
            take = min(POOL_SIZE, flat.numel() - begin)
            flat[begin:begin + take].copy_(pool[start:start + take])
            start = (start + take) % POOL_SIZE


@torch.no_grad()
def random_init_(module: torch.nn.Module, seed: int = 0) -> None:
    """Seeded random weights made where they live, one tensor at a time (ComfyUI's ops skip torch's init; a
    checkpoint would fill them in): norms 1 / 0, biases 0, embeddings N(0, 0.02), other vectors N(0, 0.02),
    matrices N(0, 1/fan_in); scalars such as CLIP's logit_scale keep their constructor value. On a CPU the draws are
    windows of one seeded pool (`_NormalPool`)."""
    from comfy.ldm.modules.diffusionmodules.mmdit import get_2d_sincos_pos_embed

    device = next(module.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    pool = _NormalPool(generator) if device.type == "cpu" else None

    def normal_(param: torch.Tensor, std: float) -> None:
        if pool is not None and param.is_contiguous():
            pool.normal_(param, std)
        else:
            param.normal_(0.0, std, generator=generator)

    for sub in module.modules():
        norm = "Norm" in type(sub).__name__
        for name, param in sub.named_parameters(recurse=False):
            if param.numel() == 1 and name != "weight":
                continue
            if norm:
                param.fill_(1.0 if name in ("weight", "scale") else 0.0)
            elif name == "bias":
                param.zero_()
            elif param.ndim < 2 or isinstance(sub, torch.nn.Embedding):
                normal_(param, 0.02)
            else:
                normal_(param, 1.0 / math.sqrt(math.prod(param.shape[1:])))
    pos_embed = getattr(module, "pos_embed", None)
    if isinstance(pos_embed, torch.Tensor) and not isinstance(pos_embed, torch.nn.Parameter):
        grid = int(math.isqrt(pos_embed.shape[1]))  # MMDiT's fixed sin-cos table, a buffer checkpoints fill in
        table = torch.from_numpy(get_2d_sincos_pos_embed(pos_embed.shape[2], grid))
        pos_embed.copy_(table.reshape(pos_embed.shape).to(pos_embed))


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (its weights as stored)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def build_model(name: str, depth=None, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device=None,
                disable_dynamic: bool = True, as_on_gpu: bool = False):
    """A ModelPatcher of the named architecture with `dtype` storage; ComfyUI picks the compute (manual cast)
    dtype for the load device as its loaders do (fp32 on a CPU for bf16 weights). `as_on_gpu`: no manual cast, as
    on a GPU that computes in `dtype`. On the meta device: shapes only, no weights (nothing to initialise)."""
    import comfy.model_detection
    import comfy.model_management as mm
    import comfy.model_patcher

    config = comfy.model_detection.model_config_from_unet_config(unet_config(name, depth))
    if config is None:
        raise RuntimeError(f"ComfyUI did not recognise the {name} config")
    load_device = mm.get_torch_device()
    device = load_device if device is None else torch.device(device)
    manual_cast = None if as_on_gpu else mm.unet_manual_cast(dtype, load_device, config.supported_inference_dtypes)
    config.set_inference_dtype(dtype, manual_cast, device=load_device)
    model = config.get_model({}, "", device=device)
    if device.type != "meta":
        random_init_(model.diffusion_model, seed)
    patcher_class = comfy.model_patcher.ModelPatcher if disable_dynamic else comfy.model_patcher.CoreModelPatcher
    patcher = patcher_class(model, load_device=load_device, offload_device=mm.unet_offload_device())
    patcher.cached_patcher_init = (_model_patcher, (name, depth, seed, dtype))
    return patcher


def _model_patcher(name, depth=None, seed=0, dtype=torch.bfloat16, disable_dynamic=False):
    return build_model(name, depth, seed, dtype, disable_dynamic=disable_dynamic)


def clip_target(text_encoder: str):
    """ComfyUI's ClipTarget (tokenizer + text-encoder class) of a family: sd15 (CLIP-L), sdxl (CLIP-L + CLIP-G), sd3 (CLIP-L +
    CLIP-G + T5-XXL), flux (CLIP-L + T5-XXL)."""
    import comfy.model_detection
    import comfy.supported_models
    import comfy.supported_models_base
    import comfy.text_encoders.flux
    import comfy.text_encoders.sd3_clip

    if text_encoder == "sdxl":
        return comfy.supported_models.SDXL(unet_config("sdxl")).clip_target()
    if text_encoder == "sd15":  # CLIP-L
        return comfy.supported_models.SD15(unet_config("sd15")).clip_target()
    if text_encoder == "sd3":
        return comfy.supported_models_base.ClipTarget(
            comfy.text_encoders.sd3_clip.SD3Tokenizer, comfy.text_encoders.sd3_clip.sd3_clip(clip_l=True, clip_g=True, t5=True))
    if text_encoder == "flux":
        return comfy.supported_models_base.ClipTarget(comfy.text_encoders.flux.FluxTokenizer,
                                                      comfy.text_encoders.flux.flux_clip())
    if text_encoder in ("zimage", "qwen_image", "krea2", "ideogram4",
                        "hidream_o1"):  # Qwen3-4B / Qwen2.5-VL-7B (with its vision
        # tower, fixed size) / Qwen3-VL-4B (Krea 2's 12-layer tap) / Qwen3-VL-8B's language model (Ideogram 4's 13 taps) /
        # HiDream-O1's tokenizer
        return comfy.model_detection.model_config_from_unet_config(unet_config(text_encoder)).clip_target()
    raise ValueError(f"unknown text encoder family {text_encoder!r}: sd15, sdxl, sd3, flux, zimage, qwen_image, krea2 "
                     "or ideogram4")


def _krea2_few_layers_clip_model(layers: int):
    """ComfyUI's Krea 2 Qwen3-VL text model at real width with `layers` layers (given through its `qwen3vl_4b_class`
    model option). Krea 2 taps 12 hidden states up to layer 35; with fewer layers the model taps every hidden state
    it has (layers + 1) and repeats them to 12, so its conditioning keeps the real shape (seq, 12 x 2560) that the DiT
    unpacks. The vision tower (1024 wide, 24 blocks, which ComfyUI builds at that size whatever the config) is built
    small: it encodes only images given to the text-encode node, which no caption here is."""
    import comfy.text_encoders.krea2
    import comfy.text_encoders.qwen3vl

    taps = len(comfy.text_encoders.krea2.KREA2_TAP_LAYERS)

    class FewLayers(comfy.text_encoders.krea2.Krea2Qwen3VLClipModel):
        def __init__(self, device="cpu", dtype=None, model_options={}, **kwargs):
            super().__init__(device=device, dtype=dtype, model_options=model_options, **kwargs)
            self.layer = list(range(layers + 1))
            self.options_default = (self.layer, *self.options_default[1:])  # what reset_clip_options restores
            config = {**comfy.text_encoders.qwen3vl.QWEN3VL_VISION_COMMON, "hidden_size": 32, "num_heads": 2,
                      "intermediate_size": 64, "depth": 1, "deepstack_visual_indexes": [0],
                      "out_hidden_size": self.transformer.model.config.hidden_size}
            self.transformer.visual = comfy.text_encoders.qwen3vl.Qwen3VLVisionModel(
                config, device=device, dtype=dtype, ops=self.operations)

        def forward(self, tokens):
            z, *rest = super().forward(tokens)  # z: [B, layers + 1, seq, 2560]
            z = z.repeat(1, -(-taps // z.shape[1]), 1, 1)[:, :taps]
            return (z, *rest)

    return FewLayers


def _ideogram4_few_layers_clip_model(layers: int):
    """ComfyUI's Ideogram 4 text model (Qwen3-VL-8B's language model, comfy/text_encoders/ideogram4.py) at real width
    with `layers` layers (given through its `qwen3vl_8b_class` model option). Ideogram 4 taps 13 hidden states up to
    the last layer's output (36); with fewer layers the model taps every hidden state it has (layers + 1) and repeats
    them to 13, so its conditioning keeps the real shape (seq, 13 x 4096) that the DiT projects."""
    import comfy.text_encoders.ideogram4

    taps = len(comfy.text_encoders.ideogram4.IDEOGRAM4_TAP_LAYERS)

    class FewLayers(comfy.text_encoders.ideogram4.Qwen3VL8BModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.layer = list(range(layers + 1))
            self.options_default = (self.layer, *self.options_default[1:])  # what reset_clip_options restores

        def forward(self, tokens):
            z, *rest = super().forward(tokens)  # z: [B, layers + 1, seq, 4096]
            z = z.repeat(1, -(-taps // z.shape[1]), 1, 1)[:, :taps]
            return (z, *rest)

    return FewLayers


def build_clip(text_encoder: str, t5_layers: int = T5XXL_LAYERS, seed: int = 1, dtype: torch.dtype | None = None,
               disable_dynamic: bool = False):
    """comfy.sd.CLIP of a family at real width; T5-XXL (or the Qwen LLM encoders of zimage / qwen_image) with
    `t5_layers` layers. `dtype` None: the dtype ComfyUI's loaders pick for text encoders on this device."""
    import comfy.sd

    options = {"t5xxl_model_config": {"num_layers": int(t5_layers), "num_decoder_layers": int(t5_layers)},
               "qwen3_4b_model_config": {"num_hidden_layers": int(t5_layers)},
               "qwen25_7b_model_config": {"num_hidden_layers": int(t5_layers)},
               "qwen3vl_4b_model_config": {"num_hidden_layers": int(t5_layers)},
               "qwen3vl_8b_model_config": {"num_hidden_layers": int(t5_layers)}}
    if text_encoder == "krea2" and int(t5_layers) < 36:
        options["qwen3vl_4b_class"] = _krea2_few_layers_clip_model(int(t5_layers))
    if text_encoder == "ideogram4" and int(t5_layers) < 36:
        options["qwen3vl_8b_class"] = _ideogram4_few_layers_clip_model(int(t5_layers))
    if dtype is not None:
        options["dtype"] = dtype
    clip = comfy.sd.CLIP(clip_target(text_encoder), parameters=0, model_options=options, disable_dynamic=disable_dynamic)
    if any(True for _ in clip.cond_stage_model.parameters()):  # HiDream-O1's tokenizer-only encoder has none
        random_init_(clip.cond_stage_model, seed)
    clip.patcher.cached_patcher_init = (_clip_patcher, (text_encoder, t5_layers, seed, dtype))
    return clip


def _clip_patcher(text_encoder, t5_layers=T5XXL_LAYERS, seed=1, dtype=None, disable_dynamic=False):
    return build_clip(text_encoder, t5_layers, seed, dtype, disable_dynamic=disable_dynamic).patcher


class _DropMissingKeys(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Missing VAE keys")


@contextlib.contextmanager
def _quiet_missing_keys():
    """The VAE is made from a key sketch, so every other key is missing by design: drop that one warning."""
    drop = _DropMissingKeys()
    root = logging.getLogger()
    root.addFilter(drop)
    try:
        yield
    finally:
        root.removeFilter(drop)


def build_vae(latent_channels: int, seed: int = 2, kind: str | None = None):
    """comfy.sd.VAE of the SD / SDXL (4 channels), SD3 / Flux (16) or Flux.2 (128) VAE, or (kind "wan21") the Wan 2.1
    video VAE of Qwen-Image, through ComfyUI's state-dict detection: the keys it reads to pick the class are given,
    the rest is made uninitialised and filled in place."""
    import comfy.sd

    if kind == "pixel":  # HiDream-O1's: ComfyUI's PixelspaceConversionVAE, what its checkpoint's sentinel makes
        vae = comfy.sd.VAE(sd={"pixel_space_vae": torch.tensor(1.0)})
        vae.patcher.cached_patcher_init = (_vae_patcher, (latent_channels, seed, kind))
        return vae
    if kind == "wan21":  # base width 96 (decoder.head.0.gamma), RGB in and out: the released Wan 2.1 VAE
        sketch = {"decoder.middle.0.residual.0.gamma": torch.zeros(384, 1, 1, 1),
                  "decoder.head.0.gamma": torch.zeros(96, 1, 1, 1), "encoder.conv1.weight": torch.zeros(96, 3, 3, 3, 3),
                  "decoder.head.2.weight": torch.zeros(3, 96, 3, 3, 3)}
        with _quiet_missing_keys():
            vae = comfy.sd.VAE(sd=sketch)
        random_init_(vae.first_stage_model, seed)
        vae.patcher.cached_patcher_init = (_vae_patcher, (latent_channels, seed, kind))
        return vae
    if latent_channels not in (4, 16, 128):
        raise ValueError("latent_channels: 4 (SD / SDXL VAE), 16 (SD3 / Flux VAE) or 128 (Flux.2 VAE)")
    if latent_channels == 128:  # Flux.2: 32 channels at 8x, folded 2x2 by its batch-norm latents -> 128 at 16x
        sketch = {"decoder.conv_in.weight": torch.zeros(512, 32, 3, 3),
                  "decoder.up.3.upsample.conv.weight": torch.zeros(512, 512, 3, 3),
                  "encoder.quant_conv.weight": torch.zeros(64, 64, 1, 1),  # BFL's file keeps them inside
                  "decoder.post_quant_conv.weight": torch.zeros(32, 32, 1, 1),
                  "bn.running_mean": torch.zeros(128), "bn.running_var": torch.ones(128)}
        with _quiet_missing_keys():
            vae = comfy.sd.VAE(sd=sketch)
        random_init_(vae.first_stage_model, seed)
        vae.patcher.cached_patcher_init = (_vae_patcher, (latent_channels, seed))
        return vae
    # decoder.conv_in: 512 = 128 base channels x ch_mult[-1] 4; a fourth level (the 8x VAEs, not the x4 upscaler's);
    # the SD VAE has post_quant_conv, SD3 / Flux have none.
    sketch = {"decoder.conv_in.weight": torch.zeros(512, latent_channels, 3, 3),
              "decoder.up.3.upsample.conv.weight": torch.zeros(512, 512, 3, 3)}
    if latent_channels == 4:
        sketch["post_quant_conv.weight"] = torch.zeros(4, 4, 1, 1)
    with _quiet_missing_keys():
        vae = comfy.sd.VAE(sd=sketch)
    random_init_(vae.first_stage_model, seed)
    vae.patcher.cached_patcher_init = (_vae_patcher, (latent_channels, seed))
    return vae


def _vae_patcher(latent_channels, seed=2, kind=None, disable_dynamic=False):
    return build_vae(latent_channels, seed, kind).patcher


def build_family(name: str, depth=None, t5_layers: int = 2, seed: int = 0):
    """(MODEL patcher, CLIP, VAE) of an architecture, all at real width."""
    spec = ARCHITECTURES[name]
    return (build_model(name, depth, seed), build_clip(spec["text_encoder"], t5_layers, seed + 1),
            build_vae(spec["latent_channels"], seed + 2, spec.get("vae")))
