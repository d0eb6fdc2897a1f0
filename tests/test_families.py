"""The family registry (nodes/families/): one module per family, recognised from ComfyUI's own model classes exactly
as the scattered rules it replaced recognised them, with the names stored in run folders and files unchanged."""
import pytest

pytestmark = pytest.mark.comfyui


def _old_model_family(model):
    """The LoRA family rule before the registry (nodes/comfy_bridge.model_family), kept here as the reference."""
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


def _models():
    """{name: ModelPatcher}: the tiny families and a tiny SDXL."""
    from headroom.nodes.tiny_models import build_tiny_model_patcher
    from test_lora_formats import _tiny_sdxl

    tiny = ("sd15", "sd3", "flux", "flux2", "zimage", "qwen_image")
    return {**{family: build_tiny_model_patcher(family, 0) for family in tiny}, "sdxl": _tiny_sdxl()}


def test_one_module_per_family(comfyui):
    import pathlib

    from headroom.nodes import families

    folder = pathlib.Path(families.__file__).parent
    modules = sorted(p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "base"))
    assert list(families.FAMILIES) == ["sd15", "sdxl", "sd3", "flux", "flux2", "zimage", "qwen_image"]
    assert sorted(families.FAMILIES) == modules
    assert list(families.CONTROLNET_TYPES) == ["unet", "sd3", "flux"]  # stored names: never renamed
    assert families.get("sd15").controlnet is families.get("sdxl").controlnet is families.controlnet_type("unet")


def test_recognition_is_the_rule_it_replaced(comfyui):
    from headroom.nodes import families
    from headroom.nodes.comfy_model import ComfyDenoiser, model_family

    for name, patcher in _models().items():
        model = patcher.model
        assert families.family_of(model).name == name == model_family(model)
        # Families new with the registry: the old rule refused them (None).
        assert _old_model_family(model) == (name if name in ("sd15", "sdxl", "sd3", "flux") else None)
        # Flux.2's blocks are Flux's DoubleStreamBlock / SingleStreamBlock: in place too.
        assert families.inplace_blocks(model) == (name in ("flux", "flux2"))
        assert ComfyDenoiser(patcher).inplace_blocks == (name in ("flux", "flux2"))
        if name in ("sd15", "sdxl", "sd3", "flux"):
            assert families.controlnet_type_of(patcher).name == {"sd15": "unet", "sdxl": "unet"}.get(name, name)
        else:  # no ControlNet layout for these in ComfyUI's ControlNetLoader
            with pytest.raises(families.ControlNetError, match="no ControlNet support for this MODEL"):
                families.controlnet_type_of(patcher)


def test_zimage_is_not_plain_lumina2(comfyui):
    """Lumina 2.0 runs Z-Image's NextDiT class with another config (2304 wide, Gemma encoder, shift 6): not a Z-Image
    model, so no zimage LoRA preset for it. The pixel-space Z-Image is another module class: not zimage either."""
    import comfy.supported_models

    from headroom.nodes import families

    lumina = {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 256, "cap_feat_dim": 32,
              "n_layers": 1, "n_refiner_layers": 1, "qk_norm": True, "n_heads": 2, "n_kv_heads": 1,
              "axes_dims": [32, 48, 48]}
    model = comfy.supported_models.Lumina2(lumina).get_model({}, "", device="meta")
    assert families.family_of(model) is None
    zimage = families.get("zimage").tiny.model_config().get_model({}, "", device="meta")
    assert families.family_of(zimage).name == "zimage"


def test_family_facts_are_the_tables_they_replaced(comfyui):
    from headroom.nodes import families, lora_formats

    assert {f.name: f.text_tokens for f in families.FAMILIES.values()} == {"sd15": 77, "sdxl": 77, "sd3": 154,
                                                                          "flux": 256, "flux2": 512, "zimage": 128,
                                                                          "qwen_image": 128}
    assert {name: lora_formats.diffusers_component(name) for name in families.FAMILIES} == {
        "sd15": "unet", "sdxl": "unet", "sd3": "transformer", "flux": "transformer", "flux2": "transformer",
        "zimage": "transformer", "qwen_image": "transformer"}
    assert lora_formats.diffusers_component(None) is None and families.lora_preset("wan") is None
    assert {f.name: f.kohya_base for f in families.FAMILIES.values()} == {
        "sd15": ("sd_v1", "stable-diffusion-v1/lora"), "sdxl": ("sdxl_base_v1-0", "stable-diffusion-xl-v1-base/lora"),
        "sd3": ("sd3", "stable-diffusion-3/lora"), "flux": ("flux1", "flux-1-dev/lora"), "flux2": ("", ""),
        "zimage": ("z_image", "Z-Image/lora"), "qwen_image": ("qwen_image", "Qwen-Image/lora")}
    assert [f.name for f in families.FAMILIES.values() if f.lora_preset.conv is not None] == ["sd15", "sdxl"]
    assert {name: t.hint for name, t in families.CONTROLNET_TYPES.items()} == {"unet": "pixels", "sd3": "latents",
                                                                              "flux": "pixels"}


def test_a_model_of_no_family_trains_with_all_linear_only(comfyui):
    from headroom.nodes import families
    from headroom.training.adapters import AdapterConfig

    model = _models()["sd15"].model
    blocks = ["input_blocks.1"]
    with pytest.raises(ValueError, match=r"this model has no LoRA target preset \(presets: sd15, sdxl, sd3, flux, flux2, zimage, qwen_image\); "
                                         "set targets to 'all_linear'"):
        families.lora_targets(model.diffusion_model, None, AdapterConfig(), blocks)
    assert families.lora_targets(model.diffusion_model, None, AdapterConfig(targets="all_linear"), blocks)


def test_zimage_and_qwen_image_expect_their_text_encoders_width(comfyui):
    """cross_attn is the text encoder's hidden size (Qwen3-4B 2560, Qwen2.5-VL-7B 3584), no pooled vector: from the
    unet_config ComfyUI detects for the released files (Qwen-Image's leaves the width to the class default), and
    from the tiny models; a text cache of another width is refused naming the fix."""
    import comfy.model_detection
    import torch

    import realsize_models as R
    from headroom.nodes.comfy_model import check_caches, expected_cond_dims
    from headroom.nodes.tiny_models import build_tiny_model_patcher

    for arch, width in (("zimage", 2560), ("qwen_image", 3584)):
        config = comfy.model_detection.model_config_from_unet_config(R.unet_config(arch, 1))
        assert expected_cond_dims(config.get_model({}, "", device="meta")) == {"cross_attn": width}
        tiny = build_tiny_model_patcher(arch, 0).model
        assert expected_cond_dims(tiny) == {"cross_attn": 32}

        class Latents:  # the two things check_caches reads of each cache
            latent_channels = 16

            def __len__(self):
                return 1

            def text_key(self, index):
                return "k"

        class Texts:
            def conditioning(self, key):
                return {"cross_attn": torch.zeros(7, 4096)}

        with pytest.raises(ValueError, match="the TEXT_CACHE 'cross_attn' is 4096 wide but this model expects 32: "
                                             r"cache the captions with this model's text encoder \(CLIP\)"):
            check_caches(tiny, Latents(), Texts())
