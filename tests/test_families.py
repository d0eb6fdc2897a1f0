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

    return {**{family: build_tiny_model_patcher(family, 0) for family in ("sd15", "sd3", "flux", "flux2")},
            "sdxl": _tiny_sdxl()}


def test_one_module_per_family(comfyui):
    import pathlib

    from headroom.nodes import families

    folder = pathlib.Path(families.__file__).parent
    modules = sorted(p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "base"))
    assert list(families.FAMILIES) == ["sd15", "sdxl", "sd3", "flux", "flux2"]
    assert sorted(families.FAMILIES) == modules
    assert list(families.CONTROLNET_TYPES) == ["unet", "sd3", "flux"]  # stored names: never renamed
    assert families.get("sd15").controlnet is families.get("sdxl").controlnet is families.controlnet_type("unet")


def test_recognition_is_the_rule_it_replaced(comfyui):
    from headroom.nodes import families
    from headroom.nodes.comfy_model import ComfyDenoiser, model_family

    for name, patcher in _models().items():
        model = patcher.model
        # Flux.2 is new with the registry: the old rule refused it (None).
        assert families.family_of(model).name == name == model_family(model)
        assert _old_model_family(model) == (None if name == "flux2" else name)
        # Flux.2's blocks are Flux's DoubleStreamBlock / SingleStreamBlock: in place too.
        assert families.inplace_blocks(model) == (name in ("flux", "flux2"))
        assert ComfyDenoiser(patcher).inplace_blocks == (name in ("flux", "flux2"))
        if name == "flux2":  # no ControlNet layout for Flux.2 in ComfyUI's ControlNetLoader
            with pytest.raises(families.ControlNetError, match="no ControlNet support for this MODEL"):
                families.controlnet_type_of(patcher)
        else:
            assert families.controlnet_type_of(patcher).name == {"sd15": "unet", "sdxl": "unet"}.get(name, name)


def test_family_facts_are_the_tables_they_replaced(comfyui):
    from headroom.nodes import families, lora_formats

    assert {f.name: f.text_tokens for f in families.FAMILIES.values()} == {"sd15": 77, "sdxl": 77, "sd3": 154,
                                                                          "flux": 256, "flux2": 512}
    assert {name: lora_formats.diffusers_component(name) for name in families.FAMILIES} == {
        "sd15": "unet", "sdxl": "unet", "sd3": "transformer", "flux": "transformer", "flux2": "transformer"}
    assert lora_formats.diffusers_component(None) is None and families.lora_preset("wan") is None
    assert {f.name: f.kohya_base for f in families.FAMILIES.values()} == {
        "sd15": ("sd_v1", "stable-diffusion-v1/lora"), "sdxl": ("sdxl_base_v1-0", "stable-diffusion-xl-v1-base/lora"),
        "sd3": ("sd3", "stable-diffusion-3/lora"), "flux": ("flux1", "flux-1-dev/lora"), "flux2": ("", "")}
    assert [f.name for f in families.FAMILIES.values() if f.lora_preset.conv is not None] == ["sd15", "sdxl"]
    assert {name: t.hint for name, t in families.CONTROLNET_TYPES.items()} == {"unet": "pixels", "sd3": "latents",
                                                                              "flux": "pixels"}


def test_a_model_of_no_family_trains_with_all_linear_only(comfyui):
    from headroom.nodes import families
    from headroom.training.adapters import AdapterConfig

    model = _models()["sd15"].model
    blocks = ["input_blocks.1"]
    with pytest.raises(ValueError, match=r"this model has no LoRA target preset \(presets: sd15, sdxl, sd3, flux, flux2\); "
                                         "set targets to 'all_linear'"):
        families.lora_targets(model.diffusion_model, None, AdapterConfig(), blocks)
    assert families.lora_targets(model.diffusion_model, None, AdapterConfig(targets="all_linear"), blocks)
