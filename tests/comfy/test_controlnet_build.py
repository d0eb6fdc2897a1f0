"""ControlNets built from a base MODEL: zero-init is exact, saved files load through the stock nodes and
reproduce the in-memory ControlNet, bad inputs fail clearly. Real ComfyUI, in-process, on CPU."""
import pytest
import torch

pytestmark = pytest.mark.comfyui

FAMILIES = ["sd15", "sd2", "sdxl", "sd3", "flux"]
STEPS, CFG = 4, {"sd15": 4.0, "sd2": 4.0, "sdxl": 4.0, "sd3": 4.0, "flux": 1.0}

# A Flux base with a head geometry the stock loader's detection cannot rebuild (it fixes head dim 128 split
# [16, 56, 56] and mlp_ratio 4; the tiny Flux has exactly that geometry, this one does not).
FLUX_SMALL_HEADS = {"image_model": "flux", "in_channels": 16, "out_channels": 16, "patch_size": 2, "vec_in_dim": 32,
                    "context_in_dim": 32, "depth": 1, "depth_single_blocks": 1, "theta": 10000, "qkv_bias": True,
                    "guidance_embed": True, "txt_ids_dims": [], "hidden_size": 64, "num_heads": 2,
                    "axes_dim": [8, 12, 12], "mlp_ratio": 2.0}


def _patcher(model_config, seed=0):
    """A base MODEL of a given config with seeded weights, built like the tiny models."""
    import comfy.model_patcher
    from headroom.nodes.bridge.tiny_models import init_weights_

    model = model_config.get_model({}, "", device="cpu")
    init_weights_(model.diffusion_model, seed)
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def _control_image(size=64):
    image = torch.zeros(1, size, size, 3)
    image[:, 8:40, 20:52, :] = 1.0  # a white box off-centre
    return image


def _sample(model, clip, vae, family, control=None, strength=1.0):
    """KSampler + VAEDecode under inference mode (as ComfyUI runs nodes); control = a CONTROL_NET or None."""
    import nodes
    from headroom.nodes.bridge.controlnet_build import apply_controlnet

    with torch.inference_mode():
        positive = nodes.CLIPTextEncode().encode(clip, "a white box")[0]
        negative = nodes.CLIPTextEncode().encode(clip, "")[0]
        if control is not None:
            positive, negative = apply_controlnet(positive, negative, control, _control_image(), strength, 0.0, 1.0, vae=vae)
        latent = {"samples": torch.zeros(1, vae.latent_channels, 8, 8)}
        samples = nodes.KSampler().sample(model, 7, STEPS, CFG[family], "euler", "normal", positive, negative, latent)[0]
        return samples["samples"].clone(), nodes.VAEDecode().decode(vae, samples)[0].clone()


@torch.no_grad()
def _simulate_training(controlnet, seed=1, scale=0.05):
    """Give the zero-initialised layers small random values, as a few training steps would."""
    generator = torch.Generator().manual_seed(seed)
    for layer in controlnet.controlnet_type.zero_initialised(controlnet.module):
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * scale)


def _stock_roundtrip(comfyui, controlnet, name):
    """Save into the throw-away base's models/controlnet and load with the stock ControlNetLoader node."""
    import folder_paths
    import nodes
    from headroom.nodes.bridge.controlnet_build import save_controlnet

    folder = folder_paths.get_folder_paths("controlnet")[0]
    exported = save_controlnet(controlnet, f"{folder}/headroom-test/{name}.safetensors", {"steps": 0})
    assert f"headroom-test/{name}.safetensors" in folder_paths.get_filename_list("controlnet")
    return exported, nodes.ControlNetLoader().load_controlnet(f"headroom-test/{name}.safetensors")[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_untrained_controlnet_leaves_sampling_unchanged(comfyui, family):
    from headroom.nodes.bridge.controlnet_build import build_controlnet, comfy_controlnet
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, clip, vae = build_tiny_models(family, seed=0)
    base_before = {k: v.clone() for k, v in model.model.diffusion_model.state_dict().items()}
    controlnet = build_controlnet(model)
    latent_plain, image_plain = _sample(model, clip, vae, family)
    latent_cn, image_cn = _sample(model, clip, vae, family, comfy_controlnet(controlnet))
    assert torch.equal(latent_plain, latent_cn) and torch.equal(image_plain, image_cn)

    # The ControlNet really runs: once its zero layers are not zero, the result changes.
    _simulate_training(controlnet)
    latent_trained, _ = _sample(model, clip, vae, family, comfy_controlnet(controlnet))
    assert (latent_trained - latent_plain).abs().max() > 1e-3
    base_after = model.model.diffusion_model.state_dict()
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before), "the base must not change"


def test_controlnet_copies_the_base(comfyui):
    from headroom.nodes.bridge.controlnet_build import build_controlnet
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    for family, copied in (("sd15", "input_blocks.1.1.proj_in.weight"), ("sd3", "joint_blocks.0.x_block.attn.qkv.weight"),
                           ("flux", "double_blocks.0.img_attn.qkv.weight")):
        model = build_tiny_models(family)[0]
        controlnet = build_controlnet(model)
        base = model.model.diffusion_model.state_dict()
        assert torch.equal(controlnet.module.state_dict()[copied], base[copied])
        assert all(p.dtype == torch.float32 and p.requires_grad and not p.is_inference() for p in controlnet.parameters())
        assert controlnet.hint == {"sd15": "pixels", "sd3": "latents", "flux": "pixels"}[family]


def test_sd3_controlnet_of_all_joint_blocks_round_trips(comfyui, tmp_path):
    """All joint blocks: the base's last one is "pre-only" (fewer context layers), and ComfyUI's key map
    swaps that block's context modulation halves; the file must still load back weight for weight."""
    import comfy.controlnet
    from headroom.nodes.bridge.controlnet_build import build_controlnet, save_controlnet
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    sd3 = build_controlnet(build_tiny_models("sd3")[0], blocks=2)
    assert sd3.blocks == 2 and len(sd3.module.joint_blocks) == 2
    _simulate_training(sd3)
    with torch.no_grad():
        sd3.module.joint_blocks[1].context_block.adaLN_modulation[1].weight.normal_()  # halves that differ
    save_controlnet(sd3, tmp_path / "sd3_all.safetensors")
    loaded = comfy.controlnet.load_controlnet(str(tmp_path / "sd3_all.safetensors")).control_model.state_dict()
    ours = sd3.module.state_dict()
    assert loaded.keys() == ours.keys() and all(torch.equal(ours[k], loaded[k]) for k in ours)


@pytest.mark.parametrize("case", ["sd15", "sd2", "sdxl", "sd3", "flux", "unet-cldm", "sdxl-bf16", "flux-bf16"])
def test_saved_controlnet_through_stock_nodes_reproduces_in_memory(comfyui, case):
    """`-bf16`: a ControlNet trained in bf16 (controlnet_precision bf16_stochastic), saved in bf16; on a CPU ComfyUI
    computes such weights in fp32, the stock loader's module holding them upcast and the in-memory one casting them
    as it samples: the same numbers."""
    import comfy.controlnet
    import comfy.supported_models_base
    from headroom.nodes.bridge.controlnet_build import build_controlnet, comfy_controlnet
    from headroom.nodes.bridge.families.sd15 import _TINY_UNET as _UNET_SD15
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    family = {"unet-cldm": "sd15"}.get(case, case.removesuffix("-bf16"))
    model, clip, vae = build_tiny_models(family, seed=0)
    if case == "unet-cldm":
        # A UNet whose attention geometry ComfyUI's detection knows (64-channel heads): plain cldm layout.
        model = _patcher(comfy.supported_models_base.BASE(dict(_UNET_SD15, model_channels=64)))
    dtype = torch.bfloat16 if case.endswith("-bf16") else torch.float32
    controlnet = build_controlnet(model, seed=3, dtype=dtype)
    _simulate_training(controlnet)
    latent_memory, image_memory = _sample(model, clip, vae, family, comfy_controlnet(controlnet), strength=0.8)

    exported, loaded = _stock_roundtrip(comfyui, controlnet, case)
    # sd2 / sdxl: the real 64-wide heads, which ComfyUI's detection rebuilds: the plain cldm layout
    expected_layout = {"sd15": "control-lora", "sd2": "cldm", "sdxl": "cldm", "sd3": "sd3-diffusers",
                       "flux": "flux-xlabs", "unet-cldm": "cldm"}[case.removesuffix("-bf16")]
    assert exported.layout == expected_layout and exported.problem is None
    if case == "sd15":
        assert type(loaded) is comfy.controlnet.ControlLora  # built from the MODEL's own config at sampling time
    else:
        theirs = loaded.control_model.state_dict()
        ours = controlnet.module.state_dict()
        assert type(loaded.control_model) is type(controlnet.module) and theirs.keys() == ours.keys()
        assert all(ours[k].dtype == dtype for k in ours)
        assert all(torch.equal(ours[k].to(theirs[k].dtype), theirs[k]) for k in ours)
    latent_file, image_file = _sample(model, clip, vae, family, loaded, strength=0.8)
    latent_plain, _ = _sample(model, clip, vae, family)
    assert (latent_memory - latent_plain).abs().max() > 1e-3, "the test ControlNet must change the result"
    assert (latent_file - latent_memory).abs().max() <= 1e-4
    assert (image_file - image_memory).abs().max() <= 1e-3


def test_saved_file_metadata(comfyui, tmp_path):
    from safetensors import safe_open

    from headroom.nodes.bridge.controlnet_build import build_controlnet, save_controlnet
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    controlnet = build_controlnet(build_tiny_models("sd3")[0])
    path = tmp_path / "cn.safetensors"
    save_controlnet(controlnet, path, {"steps": 12, "base_fingerprint": "abc"})
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
    assert metadata["headroom.family"] == "sd3" and metadata["headroom.blocks"] == "1"
    assert metadata["headroom.steps"] == "12" and metadata["headroom.base_fingerprint"] == "abc"
    assert metadata["headroom.layout"] == "sd3-diffusers" and metadata["headroom.hint"] == "latents"
    assert not [p for p in tmp_path.iterdir() if p.name != "cn.safetensors"], "no temp files left behind"


def test_flux_geometry_the_stock_loader_cannot_detect_is_reported(comfyui, tmp_path):
    import comfy.supported_models
    from safetensors import safe_open

    from headroom.nodes.bridge.controlnet_build import build_controlnet, save_controlnet

    controlnet = build_controlnet(_patcher(comfy.supported_models.Flux(dict(FLUX_SMALL_HEADS))))
    exported = save_controlnet(controlnet, tmp_path / "flux.safetensors")
    assert exported.layout == "flux-xlabs"
    assert "axes_dim" in exported.problem and "mlp_ratio" in exported.problem
    with safe_open(str(tmp_path / "flux.safetensors"), "pt") as handle:
        assert "axes_dim" in handle.metadata()["headroom.stock_loader_problem"]


@pytest.mark.parametrize("family, blocks, message", [
    ("sd3", 3, "more than the base model's 2 joint blocks"),
    ("flux", 2, "more than the base model's 1 double blocks"),
    ("sd15", 2, "copies the whole encoder"),
    ("sd3", -1, "blocks=-1"),
])
def test_bad_block_counts(comfyui, family, blocks, message):
    from headroom.nodes.bridge.controlnet_build import ControlNetError, build_controlnet
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    with pytest.raises(ControlNetError, match=message):
        build_controlnet(build_tiny_models(family)[0], blocks=blocks)


def test_unsupported_family_lists_the_supported_ones(comfyui):
    import comfy.supported_models
    from headroom.nodes.bridge.controlnet_build import ControlNetError, build_controlnet

    aura = comfy.supported_models.AuraFlow({"max_seq": 16, "cond_seq_dim": 32, "patch_size": 2, "in_channels": 4,
                                             "dim": 32, "global_conddim": 32, "n_layers": 2, "n_double_layers": 1,
                                             "n_heads": 1})
    with pytest.raises(ControlNetError, match=r"family \(none\) \(AuraFlow.*supported family: sd15, sd2, sdxl \(unet: "
                                              r"SD1\.x.*\); sd3 \(sd3: SD3.*\); flux \(flux: Flux"):
        build_controlnet(_patcher(aura))


def test_init_refuses_every_family_without_a_controlnet_layout_naming_it_and_the_supported_ones(comfyui):
    """Every registry family: a ControlNet type where ComfyUI's ControlNetLoader detects a layout Headroom trains
    (cldm for the UNets, SD3's, Flux's XLabs, Qwen-Image's InstantX); the others (Flux.2, Chroma, Z-Image, HiDream,
    HunyuanImage, Wan, HunyuanVideo 1.5: ComfyUI has none, or only model patches) are refused at Init, before any cache is read, naming the
    family."""
    from headroom.nodes import train_controlnet as TC, train_lora as T
    from headroom.nodes.bridge import families
    from headroom.nodes.bridge.controlnet_build import controlnet_type_name
    from headroom.nodes.bridge.tiny_models import build_tiny_model_patcher

    with torch.inference_mode():
        optimizer = T.HeadroomOptimizerConfig.execute("AdamW", 1e-4, 0.0, "constant", 0, 10).args[0]
    refused = []
    for name, family in families.FAMILIES.items():
        model = build_tiny_model_patcher(name, 0)
        if family.controlnet is not None:
            assert controlnet_type_name(model) == family.controlnet.name
            continue
        refused.append(name)
        with pytest.raises(ValueError, match=rf"^Train ControlNet: Init \(Headroom\): no ControlNet support for this MODEL: "
                                             rf"family {name} .*sd15, sd2, sdxl \(unet: .*sd3 \(sd3: .*flux \(flux: "):
            TC.start_controlnet_run(model, None, None, optimizer, f"cn_refused_{name}", 0, 1, 1, "fp32", 1.0, 0.0,
                                    "uniform", "none", 5.0, 0.0, False, 1, 0)
    assert refused == ["flux2", "chroma", "zimage", "hidream", "hunyuan_image", "krea2", "hidream_o1", "ideogram4", "wan21", "hunyuan_video15",
                       "ltx2"]


@pytest.mark.parametrize("family, blocks", [("sd15", 0), ("sd3", 2), ("flux", 0), ("qwen_image", 1)])
def test_the_planned_controlnet_has_the_built_ones_trainable_tensors(comfyui, family, blocks):
    """What the planner counts for a ControlNet run fitted to a card (built on the meta device) is exactly the
    ControlNet the run trains."""
    from headroom.nodes.bridge.controlnet_build import build_controlnet, controlnet_trainable
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model = build_tiny_models(family)[0]
    planned = controlnet_trainable(model, blocks, "AdamW")
    built = build_controlnet(model, blocks=blocks)
    assert planned.shapes == tuple(tuple(p.shape) for p in built.module.parameters())
    assert planned.param_count == sum(p.numel() for p in built.parameters()) > 0
