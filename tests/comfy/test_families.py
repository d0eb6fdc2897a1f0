"""The family registry (nodes/bridge/families/): one module per family, recognised from ComfyUI's own model classes exactly
as the scattered rules it replaced recognised them, with the names stored in run folders and files unchanged."""
import re

import pytest
import torch

pytestmark = pytest.mark.comfyui


def _old_model_family(model):
    """The LoRA family rule before the registry (nodes/bridge/comfy_bridge.model_family), kept here as the reference."""
    import comfy.model_base

    if isinstance(model, comfy.model_base.Flux) and not isinstance(model, comfy.model_base.Flux2):
        return "flux"
    if isinstance(model, comfy.model_base.SD3):
        return "sd3"
    if isinstance(model, (comfy.model_base.SDXL, comfy.model_base.SDXLRefiner)):
        return "sdxl"
    if type(model) is comfy.model_base.BaseModel and type(model.diffusion_model).__name__ == "UNetModel":
        return "sd15"
    return None


# Families split off from an older family's rule: {family: the family the rule it replaced named}.
SPLIT_OFF = {"sd2": "sd15", "chroma": "flux"}


def _models():
    """{name: ModelPatcher}: every tiny model (each family's and its variants')."""
    from headroom.nodes.bridge.tiny_models import FAMILIES, build_tiny_model_patcher

    return {family: build_tiny_model_patcher(family, 0) for family in FAMILIES}


def test_one_module_per_family(comfyui):
    import pathlib

    from headroom.nodes.bridge import families

    folder = pathlib.Path(families.__file__).parent
    modules = sorted(p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "base"))
    assert list(families.FAMILIES) == ["sd15", "sd2", "sdxl", "sd3", "flux", "flux2", "chroma", "zimage", "qwen_image",
                                       "hidream", "hunyuan_image", "krea2", "hidream_o1", "ideogram4", "wan21", "hunyuan_video15", "ltx2"]
    assert sorted(families.FAMILIES) == modules
    assert list(families.CONTROLNET_TYPES) == ["unet", "sd3", "flux", "qwen_image"]  # stored names: never renamed
    assert (families.get("sd15").controlnet is families.get("sd2").controlnet is families.get("sdxl").controlnet
            is families.controlnet_type("unet"))


def test_recognition_is_the_rule_it_replaced(comfyui):
    from headroom.nodes.bridge import families
    from headroom.nodes.bridge.comfy_model import ComfyDenoiser, model_family

    from headroom.nodes.bridge.tiny_models import tiny_family

    models = _models()
    assert sorted({tiny_family(name) for name in models}) == sorted(families.FAMILIES)  # every family has a tiny model
    for tiny_name, patcher in models.items():
        name = tiny_family(tiny_name)  # a variant (flux2_dev) is recognised as its family
        model = patcher.model
        assert families.family_of(model).name == name == model_family(model)
        assert [f.name for f in families.FAMILIES.values() if f.recognise(model)] == [name]  # no overlap
        # Families new with the registry: the old rule refused them (None); SD2 / Chroma were claimed by sd15 / flux.
        assert _old_model_family(model) == (SPLIT_OFF.get(name, name) if name in ("sd15", "sd2", "sdxl", "sd3", "flux",
                                                                                 "chroma") else None)
        # Flux.2's, Chroma's, HunyuanImage's and HunyuanVideo 1.5's blocks are Flux's DoubleStreamBlock /
        # SingleStreamBlock kind: in place; LTX-2's blocks add into their (video, audio) streams in place.
        inplace = name in ("flux", "flux2", "chroma", "hunyuan_image", "hunyuan_video15", "ltx2")
        assert families.inplace_blocks(model) == inplace
        assert ComfyDenoiser(patcher).inplace_blocks == inplace
        if name in ("sd15", "sd2", "sdxl", "sd3", "flux", "qwen_image"):
            assert families.controlnet_type_of(patcher).name == {"sd15": "unet", "sd2": "unet", "sdxl": "unet"}.get(name, name)
        else:  # no ControlNet layout Headroom trains for these (tests/comfy/test_controlnet_build.py)
            with pytest.raises(families.ControlNetError, match="no ControlNet support for this MODEL"):
                families.controlnet_type_of(patcher)


def test_zimage_is_not_plain_lumina2(comfyui):
    """Lumina 2.0 runs Z-Image's NextDiT class with another config (2304 wide, Gemma encoder, shift 6): not a Z-Image
    model, so no zimage LoRA preset for it. The pixel-space Z-Image is another module class: not zimage either."""
    import comfy.supported_models

    from headroom.nodes.bridge import families

    lumina = {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 256, "cap_feat_dim": 32,
              "n_layers": 1, "n_refiner_layers": 1, "qk_norm": True, "n_heads": 2, "n_kv_heads": 1,
              "axes_dims": [32, 48, 48]}
    model = comfy.supported_models.Lumina2(lumina).get_model({}, "", device="meta")
    assert families.family_of(model) is None
    zimage = families.get("zimage").tiny.model_config().get_model({}, "", device="meta")
    assert families.family_of(zimage).name == "zimage"


def test_ltx2_is_the_audio_video_model_not_ltx_video(comfyui):
    """LTX-Video (model_base.LTXV: video only, T5 text) is another class than LTX-2's LTXAV: not ltx2. The tiny ltx2
    trains the video stream only: its preset picks no audio layer."""
    import comfy.supported_models

    from headroom.nodes.bridge import families

    ltxv = comfy.supported_models.LTXV({"image_model": "ltxv", "num_layers": 1, "attention_head_dim": 4,
                                        "cross_attention_dim": 128, "num_attention_heads": 32, "caption_channels": 32})
    assert families.family_of(ltxv.get_model({}, "", device="meta")) is None
    ltx2 = families.get("ltx2").tiny.model_config().get_model({}, "", device="meta")
    assert families.family_of(ltx2).name == "ltx2"
    audio = [name for name, module in ltx2.diffusion_model.named_modules() if isinstance(module, torch.nn.Linear)
             and name.startswith("transformer_blocks.") and ("audio" in name or "video_to_audio" in name)]
    preset = families.get("ltx2").lora_preset
    assert audio and not any(re.match(pattern, name) for pattern in preset.linear for name in audio)
    # The clip facts are ComfyUI's LTX latent format's: 32x spatial, 8x temporal (8k+1 frames), 128 channels.
    family, latent_format = families.get("ltx2"), ltx2.latent_format
    assert (family.latent_downscale, family.frame_step, family.tiny.latent_channels) == (
        latent_format.spacial_downscale_ratio, latent_format.temporal_downscale_ratio,
        latent_format.latent_channels) == (32, 8, 128)


def test_family_facts_are_the_tables_they_replaced(comfyui):
    from headroom.nodes.bridge import families, lora_formats

    assert {f.name: f.text_tokens for f in families.FAMILIES.values()} == {
        "sd15": 77, "sd2": 77, "sdxl": 77, "sd3": 154, "flux": 256, "flux2": 512, "chroma": 256, "zimage": 128,
        "qwen_image": 128, "hidream": 128, "hunyuan_image": 128, "krea2": 128, "ideogram4": 256, "hidream_o1": 128, "wan21": 512, "hunyuan_video15": 256,
        "ltx2": 1024}
    assert {name: lora_formats.diffusers_component(name) for name in families.FAMILIES} == {
        "sd15": "unet", "sd2": "unet", "sdxl": "unet", "sd3": "transformer", "flux": "transformer",
        "flux2": "transformer", "chroma": "transformer", "zimage": "transformer", "qwen_image": "transformer",
        "hidream": "transformer", "hunyuan_image": None, "krea2": "transformer", "ideogram4": None, "hidream_o1": None, "wan21": None, "hunyuan_video15": None,
        "ltx2": None}
    assert lora_formats.diffusers_component(None) is None and families.lora_preset("wan") is None
    assert {f.name: f.kohya_base for f in families.FAMILIES.values()} == {
        "sd15": ("sd_v1", "stable-diffusion-v1/lora"), "sdxl": ("sdxl_base_v1-0", "stable-diffusion-xl-v1-base/lora"),
        "sd3": ("sd3", "stable-diffusion-3/lora"), "flux": ("flux1", "flux-1-dev/lora"), "flux2": ("", ""),
        "sd2": ("sd_v2", "stable-diffusion-v2-512/lora"), "chroma": ("chroma", "chroma/lora"),
        "zimage": ("z_image", "Z-Image/lora"), "qwen_image": ("qwen_image", "Qwen-Image/lora"),
        "hidream": ("hidream_i1", "hidream-i1/lora"), "hunyuan_image": ("hunyuan_image_2_1", "HunyuanImage-2.1/lora"),
        "krea2": ("krea2", "Krea-2/lora"), "ideogram4": ("ideogram4", "Ideogram-4/lora"),
        "krea2": ("krea2", "Krea-2/lora"), "hidream_o1": ("hidream_o1_image", "HiDream-O1-Image/lora"),
        "wan21": ("wan", "wan2.1/lora"), "hunyuan_video15": ("hunyuan_video_1_5", "hunyuan-video-1.5/lora"),
        "ltx2": ("", "")}
    assert [f.name for f in families.FAMILIES.values() if f.lora_preset.conv is not None] == ["sd15", "sd2", "sdxl"]
    assert {name: t.hint for name, t in families.CONTROLNET_TYPES.items()} == {"unet": "pixels", "sd3": "latents",
                                                                              "flux": "pixels", "qwen_image": "latents"}


def test_a_model_of_no_family_trains_with_all_linear_only(comfyui):
    from headroom.nodes.bridge import families
    from headroom.training.core.adapters import AdapterConfig

    model = _models()["sd15"].model
    blocks = ["input_blocks.1"]
    with pytest.raises(ValueError, match=r"this model has no LoRA target preset \(presets: sd15, sd2, sdxl, sd3, "
                                         r"flux, flux2, chroma, zimage, qwen_image, hidream, hunyuan_image, krea2, hidream_o1, ideogram4, wan21, "
                                         r"hunyuan_video15, ltx2\); "
                                         "set targets to 'all_linear'"):
        families.lora_targets(model.diffusion_model, None, AdapterConfig(), blocks)
    assert families.lora_targets(model.diffusion_model, None, AdapterConfig(targets="all_linear"), blocks)


def test_zimage_and_qwen_image_expect_their_text_encoders_width(comfyui):
    """cross_attn is the text encoder's hidden size (Qwen3-4B 2560, Qwen2.5-VL-7B 3584; Krea 2: 12 Qwen3-VL-4B layers
    of 2560 side by side; Ideogram 4: 13 Qwen3-VL-8B layers of 4096), no pooled vector: from the unet_config ComfyUI detects for the released files (Qwen-Image's
    leaves the width to the class default), and from the tiny models; a text cache of another width is refused naming
    the fix."""
    import comfy.model_detection
    import torch

    import realsize_models as R
    from headroom.nodes.bridge.comfy_model import check_caches, expected_cond_dims
    from headroom.nodes.bridge.tiny_models import build_tiny_model_patcher

    for arch, width, tiny_width in (("zimage", 2560, 32), ("qwen_image", 3584, 32), ("krea2", 12 * 2560, 12 * 32),
                                    ("ideogram4", 13 * 4096, 13 * 32)):
        config = comfy.model_detection.model_config_from_unet_config(R.unet_config(arch, 1))
        assert expected_cond_dims(config.get_model({}, "", device="meta")) == {"cross_attn": width}
        tiny = build_tiny_model_patcher(arch, 0).model
        assert expected_cond_dims(tiny) == {"cross_attn": tiny_width}

        class Latents:  # the two things check_caches reads of each cache
            latent_channels = tiny.latent_format.latent_channels  # 16; Ideogram 4: Flux.2's 128

            def __len__(self):
                return 1

            def text_key(self, index):
                return "k"

        class Texts:
            def conditioning(self, key):
                return {"cross_attn": torch.zeros(7, 4096)}

        with pytest.raises(ValueError, match=f"the TEXT_CACHE 'cross_attn' is 4096 wide but this model expects "
                                             f"{tiny_width}: "
                                             r"cache the captions with this model's text encoder \(CLIP\)"):
            check_caches(tiny, Latents(), Texts())


def test_sd2_is_its_own_family_and_its_tiny_model_predicts_v(comfyui):
    """SD2.x: ComfyUI's SD20 config (sd15 no longer claims it); the tiny one is SD2.1-768-v's objective; its kohya
    metadata is what sd-scripts writes for a v-parameterization SD2 LoRA, and for an eps one (512 base)."""
    import comfy.model_sampling
    import comfy.supported_models

    from headroom.nodes.bridge import families, lora_formats
    from headroom.nodes.bridge.comfy_model import sampling_descriptor
    from headroom.nodes.bridge.tiny_models import build_tiny_model_patcher

    patcher = build_tiny_model_patcher("sd2", 0)
    model = patcher.model
    assert isinstance(model.model_config, comfy.supported_models.SD20)
    assert isinstance(model.model_sampling, comfy.model_sampling.V_PREDICTION)
    assert sampling_descriptor(model.model_sampling).prediction == "v"
    assert not families.get("sd15").recognise(model)
    metadata = lora_formats.kohya_metadata("sd2", "lora", 4, 4.0, 10, "t", (64, 64), model=patcher)
    assert (metadata["ss_base_model_version"], metadata["modelspec.architecture"], metadata["ss_v2"],
            metadata["modelspec.prediction_type"]) == ("sd_v2_v", "stable-diffusion-v2-768-v/lora", "True", "v")
    # SD2 512-base: the same family, eps; ComfyUI's own SD20 config picks eps for weights without v's statistics.
    config = comfy.supported_models.SD20(dict(model.model_config.unet_config))
    config.set_inference_dtype(model.get_dtype(), None)
    eps_model = config.get_model({}, "")
    assert families.family_of(eps_model).name == "sd2"
    assert sampling_descriptor(eps_model.model_sampling).prediction == "eps"
    eps = lora_formats.kohya_metadata("sd2", "lora", 4, 4.0, 10, "t", None, model=type("M", (), {"model": eps_model}))
    assert (eps["ss_base_model_version"], eps["modelspec.architecture"], eps["modelspec.prediction_type"]) == (
        "sd_v2", "stable-diffusion-v2-512/lora", "epsilon")


def test_sdxl_calibration_pooled_width_comes_from_the_model(comfyui):
    """The planner's calibration adds CLIP-G's pooled width: 1280 for the released base and refiner (configs as
    comfy/model_detection derives them, built on the meta device), the tiny CLIP-G's projection for the tiny one."""
    import comfy.model_detection
    import torch

    from headroom.nodes.bridge import families
    from headroom.nodes.bridge.families.base import TINY_CLIP_G
    from headroom.nodes.bridge.tiny_models import build_tiny_model_patcher

    width = families.get("sdxl").calibration_pooled_width
    assert width(build_tiny_model_patcher("sdxl", 0).model) == TINY_CLIP_G["projection_dim"]
    real = {"base": {"adm_in_channels": 2816, "model_channels": 320, "transformer_depth": [0, 0, 2, 2, 10, 10],
                     "context_dim": 2048, "channel_mult": [1, 2, 4], "transformer_depth_middle": 10,
                     "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10]},
            "refiner": {"adm_in_channels": 2560, "model_channels": 384, "transformer_depth": [0, 0, 4, 4, 4, 4, 0, 0],
                        "context_dim": 1280, "channel_mult": [1, 2, 4, 4], "transformer_depth_middle": 4,
                        "transformer_depth_output": [0, 0, 0, 4, 4, 4, 4, 4, 4, 0, 0, 0]}}
    common = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
              "legacy": False, "num_classes": "sequential", "in_channels": 4, "use_linear_in_transformer": True,
              "use_temporal_attention": False, "use_temporal_resblock": False}
    for name, unet in real.items():
        config = comfy.model_detection.model_config_from_unet_config({**common, **unet,
                                                                      "num_res_blocks": [2] * len(unet["channel_mult"])})
        config.set_inference_dtype(torch.bfloat16, None)
        model = config.get_model({}, "", device=torch.device("meta"))
        assert families.family_of(model).name == "sdxl"
        assert width(model) == 1280, name


@pytest.mark.parametrize("family", SPLIT_OFF)
def test_a_run_stored_under_the_family_it_split_off_from_resumes(comfyui, family):
    """Runs an earlier version stored for an SD2 model say family sd15, for a Chroma model flux (those families then
    claimed them): they resume (the presets train the same layers); a run stored under another family does not."""
    import json

    from family_checks import cached_data, init_run as _init
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, clip, vae = build_tiny_models(family, 0)
    latents, texts = cached_data(model, clip, vae, count=2)
    name = f"families_{family}_resume"
    run = _init(model, latents, texts, name, 4, 1e-3, "preset", False)
    assert run.config.family == family
    run.release()
    config_path = run.run_dir.config_path
    for stored, resumes in ((SPLIT_OFF[family], True), ("sd3", False)):
        config = json.loads(config_path.read_text())
        config["session"]["family"] = stored
        config_path.write_text(json.dumps(config))
        if resumes:
            again = _init(model, latents, texts, name, 4, 1e-3, "preset", False)
            assert again.run_dir.path == run.run_dir.path
            again.release()
        else:
            with pytest.raises(ValueError, match=rf"session.family: stored 'sd3', now '{family}'"):
                _init(model, latents, texts, name, 4, 1e-3, "preset", False)


def test_text_of_different_lengths_trains_in_groups_as_comfyui_samples_it(comfyui):
    """Chroma's T5 is unpadded, so captions give text of different lengths that ComfyUI cannot concatenate into one
    batch (its sampler runs such conds apart): the denoiser runs one forward per group and puts the outputs back in
    order, equal to forwards of each item alone."""
    from headroom.nodes.bridge.comfy_model import ComfyDenoiser, batchable_groups
    from family_checks import cached_data
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, clip, vae = build_tiny_models("chroma", 0)
    latents, texts = cached_data(model, clip, vae)
    conds = [texts.conditioning(latents.text_key(i)) for i in range(len(latents))]
    assert len({c["cross_attn"].shape[0] for c in conds}) > 1  # the captions' lengths differ
    denoiser = ComfyDenoiser(model)
    x = torch.randn(len(conds), 16, 4, 4, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.2, 0.4, 0.6, 0.8])
    groups = batchable_groups(denoiser._item_conds(x, conds))
    assert 1 < len(groups) and sorted(i for g in groups for i in g) == list(range(len(conds)))
    with torch.no_grad():
        together = denoiser.predict(x, sigma, conds)
        alone = torch.cat([denoiser.predict(x[i:i + 1], sigma[i:i + 1], [conds[i]]) for i in range(len(conds))])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


def test_hidream_trains_through_the_denoiser_with_its_four_encoder_conditioning(comfyui):
    """HiDream's diffusion model through the trainer's denoiser: conditioning of the shapes its text encoder caches (T5 [128, d], CLIP-L + CLIP-G pooled, `conditioning_llama3` one
    hidden state per Llama layer), a preset LoRA attached, a backward that reaches every adapter layer; its flow
    objective from ComfyUI's model_sampling."""
    from headroom.nodes.bridge import families
    from headroom.nodes.bridge.comfy_model import ComfyDenoiser, model_blocks
    from headroom.nodes.bridge.families.base import TINY_CLIP_G, TINY_CLIP_L, TINY_T5
    from headroom.training.core.adapters import AdapterConfig, AdapterSet

    patcher = _models()["hidream"]
    model = patcher.model
    denoiser = ComfyDenoiser(patcher)
    assert denoiser.sampling.prediction == "flow" and not denoiser.inplace_blocks
    paths = families.lora_targets(model.diffusion_model, "hidream", AdapterConfig(),
                                  [name for name, _ in model_blocks(model.diffusion_model)])
    adapters = AdapterSet(model.diffusion_model, paths, AdapterConfig(rank=4, alpha=4.0))
    generator = torch.Generator().manual_seed(0)
    conds = [{"cross_attn": torch.randn(128, TINY_T5["d_model"], generator=generator),
              "pooled_output": torch.randn(TINY_CLIP_L["projection_dim"] + TINY_CLIP_G["projection_dim"], generator=generator),
              "conditioning_llama3": torch.randn(2, 128, 32, generator=generator)} for _ in range(2)]
    x = torch.randn(2, 16, 4, 4, generator=generator)
    import comfy.model_management

    adapters.attach(model.diffusion_model)
    comfy.model_management.in_training = True  # as the training run sets it (Flux's differentiable RoPE)
    try:
        for layer in adapters.layers.values():  # a LoRA that changes the output (up weights start at zero)
            for name, param in layer.named_parameters():
                if "lora_B" in name:
                    torch.nn.init.normal_(param, std=0.01)
        out = denoiser.predict(x, torch.tensor([0.3, 0.7]), conds)
        assert out.shape == x.shape and torch.isfinite(out).all()
        out.square().mean().backward()
        grads = [p.grad for p in adapters.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    finally:
        comfy.model_management.in_training = False
        adapters.detach()


def test_wan21_is_text_and_image_to_video_and_expects_umt5_width(comfyui):
    """Wan 2.1 T2V (1.3B / 14B, and Wan 2.2 A14B's experts) is wan21, its cross_attn the UMT5-XXL width (4096, the
    class default detection leaves); so is image-to-video (36 input channels: its start image through WanImageToVideo),
    not the other WAN21 classes (VACE)."""
    import comfy.model_detection

    import realsize_models as R
    from headroom.nodes.bridge import families
    from headroom.nodes.bridge.comfy_model import expected_cond_dims

    for arch in ("wan21_1_3b", "wan21_14b"):
        model = comfy.model_detection.model_config_from_unet_config(R.unet_config(arch, 1)).get_model({}, "", device="meta")
        assert families.family_name(model) == "wan21" and expected_cond_dims(model) == {"cross_attn": 4096}
    i2v = comfy.model_detection.model_config_from_unet_config(
        {**R.unet_config("wan21_14b", 1), "model_type": "i2v", "in_dim": 36}).get_model({}, "", device="meta")
    assert type(i2v).__name__ == "WAN21" and i2v.image_to_video and families.family_name(i2v) == "wan21"
    assert families.get("wan21").start_image(i2v) == "WanImageToVideo" and expected_cond_dims(i2v) == {"cross_attn": 4096}
    assert families.get("wan21").start_image(model) is None
    # Wan 2.2 A14B I2V's experts have no CLIP-vision projection: ComfyUI detects them as WAN21_T2V with 36 channels.
    wan22_i2v = comfy.model_detection.model_config_from_unet_config(
        {**R.unet_config("wan21_14b", 1), "in_dim": 36}).get_model({}, "", device="meta")
    assert type(wan22_i2v.model_config).__name__ == "WAN21_T2V" and not wan22_i2v.image_to_video
    assert families.family_name(wan22_i2v) == "wan21" and families.get("wan21").start_image(wan22_i2v) == "WanImageToVideo"
    vace = comfy.model_detection.model_config_from_unet_config(
        {**R.unet_config("wan21_1_3b", 1), "model_type": "vace", "vace_in_dim": 96, "vace_layers": 1}
    ).get_model({}, "", device="meta")
    assert families.family_of(vace) is None


def test_hunyuan_video15_is_the_base_model_not_the_super_resolution_one(comfyui):
    """HunyuanVideo 1.5 as ComfyUI detects the released file (8.3B: 2048 wide, 54 double blocks) is hunyuan_video15,
    its cross_attn Qwen2.5-VL-7B's width, its start image HunyuanVideo15ImageToVideo's (T2V and I2V are one
    architecture); the super-resolution model (98 input channels, another class) is no family."""
    import comfy.model_detection

    import realsize_models as R
    from headroom.nodes.bridge import families
    from headroom.nodes.bridge.comfy_model import expected_cond_dims

    config = R.unet_config("hunyuan_video15", (1, 0))
    model = comfy.model_detection.model_config_from_unet_config(config).get_model({}, "", device="meta")
    assert families.family_name(model) == "hunyuan_video15" and expected_cond_dims(model) == {"cross_attn": 3584}
    assert model.diffusion_model.img_in.proj.weight.shape[1] == 65  # noise, start latent, mask: T2V and I2V alike
    assert families.get("hunyuan_video15").start_image(model) == "HunyuanVideo15ImageToVideo"
    sr = comfy.model_detection.model_config_from_unet_config({**config, "in_channels": 98}).get_model({}, "", device="meta")
    assert type(sr).__name__ == "HunyuanVideo15_SR_Distilled" and families.family_of(sr) is None
