"""Save formats: a kohya-format file is the same LoRA as the ComfyUI-format one, for ComfyUI's stock loader and
for diffusers (tiny models of the families, in-process, CPU)."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors import safe_open

from test_train_lora_nodes import _data, _init

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]


def _side(family: str) -> int:
    """The test images' side: 32 px, two of HiDream-O1's 32-px patches for it (its position ids need more than one)."""
    return 64 if family == "hidream_o1" else 32


def _save_both(family: str, kind: str, **targets):
    """Train 2 steps, save the same adapter in both formats: (model, clip, run, comfyui name, kohya name)."""
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data(family, resolution=_side(family))
    tag = "_".join([family, kind, *(f"{k}{v}" for k, v in targets.items())])
    run = _init(model, latents, texts, f"formats_{tag}", kind=kind, rank=4, lr=2e-2, **targets)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 2)
        comfy_name = T.HeadroomSaveLora.execute(run, "formats", f"{tag}_comfyui", "fp32").args[0]
        kohya_name = T.HeadroomSaveLora.execute(run, "formats", f"{tag}_kohya", "fp32", "kohya").args[0]
    return model, clip, run, comfy_name, kohya_name


def _read(name: str) -> tuple[list[str], dict[str, str]]:
    import folder_paths

    with safe_open(folder_paths.get_full_path_or_raise("loras", name), "pt") as f:
        return list(f.keys()), f.metadata()


def _patched_weights(lora_model) -> dict[str, torch.Tensor]:
    """Each patched weight as the stock loader computes it when the model is loaded."""
    import comfy.lora

    base = lora_model.model.state_dict()
    return {key: comfy.lora.calculate_weight(patches, base[key].float().clone(), key)
            for key, patches in lora_model.patches.items()}


@pytest.mark.parametrize("family,kind", [("sd15", "lora"), ("sd15", "loha"), ("sd15", "dora"), ("sd15", "oft"),
                                         ("sd3", "lora"), ("flux", "lora"), ("flux", "lokr"), ("zimage", "lora"),
                                         ("qwen_image", "lora"), ("sd2", "lora"), ("sdxl", "lora"), ("chroma", "lora"),
                                         ("hidream", "lora"), ("hunyuan_image", "lora"), ("krea2", "lora"),
                                         ("ideogram4", "lora"), ("hidream_o1", "lora"), ("wan21", "lora"), ("hunyuan_video15", "lora"), ("ltx2", "lora")])
def test_kohya_file_is_the_same_lora_for_the_stock_loader(comfyui, family, kind, caplog):
    import nodes

    model, clip, run, comfy_name, kohya_name = _save_both(family, kind)
    keys, metadata = _read(kohya_name)
    assert keys and all(k.startswith("lora_unet_") for k in keys)
    if family in ("sd15", "sd2"):  # sd-scripts names SD1.x / SD2.x modules by diffusers' blocks
        assert any("_down_blocks_" in k for k in keys) and not any("_input_blocks_" in k for k in keys)
    if family == "sdxl":
        assert any(k.startswith("lora_unet_input_blocks_") for k in keys)
    if family in ("flux", "chroma"):
        assert any(k.startswith("lora_unet_double_blocks_") for k in keys)
    if family == "hunyuan_video15":  # musubi-tuner's HunyuanVideo names
        assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in keys
    if family == "ltx2":  # the module paths, as ComfyUI's map for LTX-2 reads them
        assert "lora_unet_transformer_blocks_0_attn1_to_q.lora_down.weight" in keys
        assert "lora_unet_transformer_blocks_1_ff_net_0_proj.alpha" in keys and not any("audio" in k for k in keys)
    if family == "krea2":  # the module paths (musubi-tuner's Krea 2 names: its LoRA wraps the DiT's own modules)
        assert "lora_unet_blocks_0_attn_wq.lora_down.weight" in keys and "lora_unet_blocks_1_mlp_down.alpha" in keys
    if family == "ideogram4":  # the module paths (musubi-tuner's Ideogram 4 names: its LoRA wraps the DiT's modules)
        assert ("lora_unet_layers_0_attention_qkv.lora_down.weight" in keys
                and "lora_unet_layers_1_feed_forward_w2.alpha" in keys and not any("adaln" in k for k in keys))
    if family == "hidream_o1":  # the module paths (musubi-tuner's HiDream-O1 LoRA wraps the model's own modules)
        assert "lora_unet_language_model_layers_0_self_attn_q_proj.lora_down.weight" in keys
        assert "lora_unet_x_embedder_proj1.alpha" in keys and "lora_unet_final_layer2_linear.alpha" in keys
    if family == "wan21":  # musubi-tuner's Wan names
        assert "lora_unet_blocks_0_self_attn_q.lora_down.weight" in keys and "lora_unet_blocks_1_ffn_2.alpha" in keys
    assert metadata["ss_network_dim"] == "4" and float(metadata["ss_network_alpha"]) == 4.0
    assert metadata["ss_steps"] == "2" and metadata["ss_resolution"] == f"({_side(family)}, {_side(family)})"
    assert metadata.get("ss_base_model_version") == {"sd15": "sd_v1", "sd3": "sd3", "flux": "flux1", "zimage": "z_image",
                                                 "qwen_image": "qwen_image", "sd2": "sd_v2_v", "sdxl": "sdxl_base_v1-0",
                                                 "chroma": "chroma", "hidream": "hidream_i1",
                                                 "hunyuan_image": "hunyuan_image_2_1", "krea2": "krea2", "ideogram4": "ideogram4", "hidream_o1": "hidream_o1_image",
                                                 "wan21": "wan",
                                                 "hunyuan_video15": "hunyuan_video_1_5",
                                                 "ltx2": None}[family]  # no sd-scripts base model name for LTX-2
    if family == "sd2":  # the tiny SD2 is v-prediction (SD2.1-768-v): what sd-scripts writes with --v2 --v_parameterization
        assert (metadata["ss_v2"], metadata["modelspec.architecture"]) == ("True", "stable-diffusion-v2-768-v/lora")
    assert metadata["ss_network_module"] == ("networks.lora" if kind == "lora" else "lycoris.kohya")
    if kind != "lora":
        assert json.loads(metadata["ss_network_args"])["algo"] == {"loha": "loha", "lokr": "lokr", "dora": "lora",
                                                                   "oft": "diag-oft"}[kind]
    assert metadata["headroom.format"] == "kohya" and metadata["headroom.steps"] == "2"

    with torch.inference_mode():
        comfy_model, _ = nodes.LoraLoader().load_lora(model, clip, comfy_name, 1.0, 0.0)
        kohya_model, _ = nodes.LoraLoader().load_lora(model, clip, kohya_name, 1.0, 0.0)
        assert "lora key not loaded" not in caplog.text
        assert len(kohya_model.patches) == len(run.adapters.layers)
        assert set(kohya_model.patches) == set(comfy_model.patches)
        from_comfy, from_kohya = _patched_weights(comfy_model), _patched_weights(kohya_model)
    for key, weight in from_comfy.items():
        assert torch.equal(weight, from_kohya[key]), key
    assert any(not torch.equal(w, model.model.state_dict()[k].float()) for k, w in from_comfy.items())


@pytest.mark.parametrize("kind,layer_ranks,layer_alphas,conv_args", [
    ("lora", "in_layers=8 out_layers=8 .op=8 .conv=8", "in_layers=2 out_layers=2 .op=2 .conv=2",
     {"conv_dim": "8", "conv_alpha": "2"}),
    ("loha", "in_layers=8 out_layers=8 .op=8 .conv=8", "", {"conv_dim": "8", "conv_alpha": "4", "algo": "loha"}),
    ("lora", "in_layers=8 .op=8 .conv=8", "", None),  # out_layers at rank 4: no one conv_dim holds
    ("lora", "", "", None)])  # no convolution trained
def test_kohya_file_names_the_locon_conv_dim_it_holds(comfyui, kind, layer_ranks, layer_alphas, conv_args, caplog):
    """kohya's LoCon (conv_dim / conv_alpha, docs/COMING_FROM.md): the 3x3 convolutions at one rank and alpha are
    named in ss_network_args as sd-scripts writes them, and the file holds those ranks and alphas; where the 3x3
    convolutions differ, or none is trained, no conv_dim is written (the file's shapes say what each layer is)."""
    import nodes

    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    include_conv = conv_args is not None or bool(layer_ranks)
    tag = f"locon_{kind}_{len(layer_ranks)}_{len(layer_alphas)}_{include_conv}"
    run = _init(model, latents, texts, f"formats_{tag}", kind=kind, rank=4, include_conv=include_conv,
                layer_ranks=layer_ranks, layer_alphas=layer_alphas)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 1)
        name = T.HeadroomSaveLora.execute(run, "formats", f"{tag}_kohya", "fp32", "kohya").args[0]
    keys, metadata = _read(name)
    args = json.loads(metadata.get("ss_network_args", "{}"))
    assert {k: v for k, v in args.items() if k.startswith("conv_")} == {
        k: v for k, v in (conv_args or {}).items() if k.startswith("conv_")}
    if conv_args:
        assert args == conv_args and metadata["ss_network_dim"] == "4"
        import folder_paths
        from safetensors.torch import load_file

        state = load_file(folder_paths.get_full_path_or_raise("loras", name))
        spatial = [k[: -len(".lora_down.weight")] for k, v in state.items()
                   if k.endswith(".lora_down.weight") and v.ndim == 4 and v.shape[2:] != (1, 1)]
        if kind == "lora":  # each 3x3 convolution's rank and alpha are those the args name
            assert spatial and all(state[k + ".lora_down.weight"].shape[0] == int(args["conv_dim"])
                                   and float(state[k + ".alpha"]) == float(args["conv_alpha"]) for k in spatial)
    with torch.inference_mode():
        loaded, _ = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)
    assert "lora key not loaded" not in caplog.text and len(loaded.patches) == len(run.adapters.layers)


def test_unknown_format_is_refused_with_the_choices(comfyui, tmp_path):
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "formats_bad", rank=4)
    with pytest.raises(ValueError, match=r"Save LoRA \(Headroom\): format 'a1111': choose one of comfyui, kohya, diffusers$"):
        T.HeadroomSaveLora.execute(run, "formats", "bad", "fp32", "a1111")


def _diffusers_unet_of(model):
    """A diffusers UNet2DConditionModel with the tiny SD1.5 model's architecture and weights (no download)."""
    import comfy.utils
    from diffusers import UNet2DConditionModel

    config = model.model.model_config.unet_config
    levels = len(config["channel_mult"])
    assert all(d == 1 for d in config["transformer_depth"]), "every level of the tiny UNet has attention"
    unet = UNet2DConditionModel(
        in_channels=config["in_channels"], out_channels=config["out_channels"],
        down_block_types=("CrossAttnDownBlock2D",) * levels, up_block_types=("CrossAttnUpBlock2D",) * levels,
        block_out_channels=tuple(config["model_channels"] * m for m in config["channel_mult"]),
        layers_per_block=config["num_res_blocks"][0], cross_attention_dim=config["context_dim"],
        attention_head_dim=config["num_heads"])
    comfy_state = model.model.diffusion_model.state_dict()
    # {diffusers key: ComfyUI key}, ComfyUI's own table; it lists every layer a config may have (skip
    # connections only exist where the width changes), so only the present ones are taken.
    mapping = comfy.utils.unet_to_diffusers(config)
    state = {k: comfy_state[v].float() for k, v in mapping.items() if v in comfy_state}
    missing, unexpected = unet.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return unet.eval()


@pytest.mark.parametrize("file_format", ["kohya", "diffusers"])
def test_sd15_file_loads_in_diffusers_and_gives_comfyuis_output(comfyui, file_format, caplog):
    """diffusers' own SD reader (`lora_state_dict` + `load_lora_into_unet`) injects every layer of the kohya /
    diffusers file into a diffusers UNet, and the result equals ComfyUI's stock-loader result on the same base
    weights."""
    import comfy.model_management
    import folder_paths
    import nodes
    from diffusers import StableDiffusionPipeline

    model, clip, run, _, kohya_name = _save_both("sd15", "lora")
    name = kohya_name if file_format == "kohya" else _save(run, "sd15_lora_diffusers_output", "diffusers")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 8, 8, generator=generator)
    t = torch.tensor([500.0])
    context = torch.randn(1, 7, model.model.model_config.unet_config["context_dim"], generator=generator)

    with torch.inference_mode(False), torch.no_grad():
        unet = _diffusers_unet_of(model)
        base_out = unet(x, t, encoder_hidden_states=context).sample
        lora_layers = _load_with_diffusers(unet, StableDiffusionPipeline, folder_paths.get_full_path_or_raise("loras", name),
                                           caplog)
        diffusers_out = unet(x, t, encoder_hidden_states=context).sample

        comfy_base_out = model.model.diffusion_model(x, timesteps=t, context=context).float()
        lora_model, _ = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)
        comfy.model_management.load_models_gpu([lora_model])  # as a sampler loads it: the patches applied
        try:
            comfy_out = lora_model.model.diffusion_model(x, timesteps=t, context=context).float()
        finally:
            comfy.model_management.unload_all_models()

    assert (comfy_base_out - base_out).norm() / base_out.norm() < 1e-5  # same base model in both
    assert len(lora_layers) == len(run.adapters.layers)
    change = (diffusers_out - base_out).norm() / base_out.norm()
    difference = (diffusers_out - comfy_out).norm() / comfy_out.norm()
    print(f"diffusers vs ComfyUI with the {file_format} file: relative L2 {difference:.2e} (LoRA effect {change:.2e})")
    assert change > 1e-3  # the LoRA does something ...
    assert difference < 1e-5  # ... and the same thing in both (fp32 throughout)


def _init_from(model, latents, texts, run_name, init_lora, kind="lora", rank=4, alpha=2.0, targets="preset"):
    """A LoRA run whose LoRA config starts from `init_lora` (alpha 2 on purpose: the file's is 4)."""
    from headroom.nodes import train_lora as T

    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute(kind, rank, alpha, targets, False, 0.0, 0, init_lora).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", 1e-2, 0.0, "constant", 0, 1000).args[0]
        return T.HeadroomTrainLoraInit.execute(
            model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt,
            run_name=run_name, seed=0, batch_size=4, grad_accumulation=1, precision="fp32", max_grad_norm=1.0,
            caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0,
            noise_offset=0.0, gradient_checkpointing=False, checkpoint_depth=1, holdout=0).args[0]


@pytest.mark.parametrize("family,file_format,targets", [
    ("sd15", "comfyui", "preset"), ("sd15", "kohya", "preset"), ("sd15", "diffusers", "preset"),
    ("flux", "diffusers", "preset"), ("sd3", "diffusers", "all_linear")])
def test_a_saved_lora_continues_exactly_where_the_file_was(comfyui, family, file_format, targets):
    """(diffusers: the split q / k / v / mlp layers of Flux / SD3 are joined back into ComfyUI's fused weights, and
    SD3's last context modulation, stored in diffusers' row order, is put back in ComfyUI's.)"""
    import nodes
    from headroom.nodes import train_lora as T

    model, clip, first, comfy_name, kohya_name = _save_both(family, "lora", **({} if targets == "preset" else {"targets": targets}))
    _, _, _, latents, texts = _data(family)
    name = {"comfyui": comfy_name, "kohya": kohya_name}.get(file_format)
    if file_format == "diffusers":
        name = _save(first, f"{family}_lora_diffusers_continue_{targets}", "diffusers")
    tag = f"{family}_{file_format}_{targets}"
    continued = _init_from(model, latents, texts, f"continued_{tag}", name, targets=targets)
    assert continued.step == 0 and not continued.resumed
    with torch.inference_mode():
        at_start = T.HeadroomSaveLora.execute(continued, "formats", f"continued_{tag}_step0", "fp32").args[0]
        original, _ = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)
        restarted, _ = nodes.LoraLoader().load_lora(model, clip, at_start, 1.0, 0.0)
        expected, got = _patched_weights(original), _patched_weights(restarted)
    assert expected.keys() == got.keys() and len(got) == len(first.adapters.layers)
    for key in expected:  # alpha 2 here against 4 in the file: the up weights were rescaled, rounding only
        torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-7)
    before = continued.adapters.state_dict()
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(continued, 2)
    after = continued.adapters.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_continuing_a_file_that_does_not_fit_is_refused_with_what_to_change(comfyui):
    model, clip, _, comfy_name, _ = _save_both("sd15", "lora")
    _, _, _, latents, texts = _data("sd15")
    with pytest.raises(ValueError, match=r"has rank 4 at .*set the LoRA config's rank to 4"):
        _init_from(model, latents, texts, "continue_rank", comfy_name, rank=8)
    with pytest.raises(ValueError, match=r"needs kind lora .* not loha"):
        _init_from(model, latents, texts, "continue_kind", comfy_name, kind="loha")
    _, _, _, loha_name, _ = _save_both("sd15", "loha")
    with pytest.raises(ValueError, match=r"only plain LoRA files"):
        _init_from(model, latents, texts, "continue_loha", loha_name)
    flux_model, _, _, flux_name, _ = _save_both("flux", "lora")
    with pytest.raises(ValueError, match=r"map to no layer of this model .* another model family"):
        _init_from(model, latents, texts, "continue_family", flux_name)
    with pytest.raises(ValueError, match=r"not in models/loras/"):
        _init_from(model, latents, texts, "continue_missing", "no_such_file.safetensors")


# --- the diffusers format ------------------------------------------------------------------------------------
def _save(run, name: str, file_format: str) -> str:
    from headroom.nodes import train_lora as T

    with torch.inference_mode():
        return T.HeadroomSaveLora.execute(run, "formats", name, "fp32", file_format).args[0]


def _stock_loader_weights(model, clip, name: str, caplog) -> tuple[dict[str, torch.Tensor], object]:
    """The patched weights of a file through ComfyUI's stock LoraLoader; every key of the file must load."""
    import nodes

    caplog.clear()
    with torch.inference_mode():
        lora_model, _ = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)
        weights = _patched_weights(lora_model)
    assert "lora key not loaded" not in caplog.text and "NOT LOADED" not in caplog.text, caplog.text
    return weights, lora_model


def _diffusers_file_checks(name: str, component: str, layer_count: int, rank: int) -> dict:
    keys, metadata = _read(name)
    assert keys and all(k.startswith(component + ".") for k in keys)
    assert len(keys) == 2 * layer_count and not any(k.endswith(".alpha") for k in keys)
    config = json.loads(metadata["lora_adapter_metadata"])
    assert config[f"{component}.r"] == rank and config[f"{component}.lora_alpha"] == rank  # alpha folded in: scale 1
    assert len(config[f"{component}.target_modules"]) == layer_count
    assert metadata["headroom.format"] == "diffusers"
    return config


@pytest.mark.parametrize("family,targets", [("sd15", {}), ("sd3", {}), ("flux", {}), ("flux2", {}), ("sd2", {}), ("chroma", {}),
                                            ("sd15", {"targets": "all_linear", "include_conv": True}),
                                            ("sd3", {"targets": "all_linear"}), ("flux", {"targets": "all_linear"}),
                                            ("zimage", {}), ("qwen_image", {}),
                                            ("hidream", {}), ("krea2", {})])
def test_diffusers_file_is_the_same_lora_for_the_stock_loader(comfyui, family, targets, caplog):
    from headroom.nodes.bridge import lora_formats

    model, clip, run, comfy_name, _ = _save_both(family, "lora", **targets)
    diffusers_name = _save(run, f"{family}_lora_diffusers_{len(run.adapters.layers)}", "diffusers")
    names = lora_formats.diffusers_names(model, run.adapters.layers, family)
    layer_count = sum(len(layers) for layers in names.values())
    component = "unet" if family in ("sd15", "sd2") else "transformer"
    _diffusers_file_checks(diffusers_name, component, layer_count, 4)
    keys, _ = _read(diffusers_name)
    if family in ("sd15", "sd2"):  # attention-processor names: the UNet names both ComfyUI and diffusers map
        assert any(k.startswith("unet.down_blocks.") and ".attn1.processor.to_out_lora.up.weight" in k for k in keys)
    elif family == "zimage":  # diffusers' ZImageTransformer2DModel names; fused qkv split into to_q / to_k / to_v
        assert "transformer.layers.0.attention.to_q.lora_A.weight" in keys
        assert "transformer.layers.0.attention.to_out.0.lora_B.weight" in keys
        assert layer_count > len(run.adapters.layers)
    elif family in ("qwen_image", "hidream"):  # ComfyUI's module paths are diffusers' transformer class's names
        assert ("transformer.transformer_blocks.0.img_mlp.net.0.proj.lora_A.weight" in keys if family == "qwen_image"
                else "transformer.double_stream_blocks.0.block.attn1.to_q.lora_A.weight" in keys)
        assert layer_count == len(run.adapters.layers)
    elif family == "krea2":  # diffusers' Krea2Transformer2DModel names (comfy.utils.krea2_to_diffusers)
        assert "transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in keys
        assert "transformer.transformer_blocks.0.attn.to_out.0.lora_B.weight" in keys
        assert "transformer.transformer_blocks.1.ff.down.lora_A.weight" in keys
        assert layer_count == len(run.adapters.layers)
    else:  # PEFT names; the fused qkv weights are split into diffusers' separate layers
        assert any(k.endswith("transformer_blocks.0.attn.to_q.lora_A.weight") for k in keys)
        assert layer_count > len(run.adapters.layers)
    print(f"{family}: {len(run.adapters.layers)} ComfyUI modules -> {layer_count} diffusers layers")

    from_comfy, comfy_model = _stock_loader_weights(model, clip, comfy_name, caplog)
    from_diffusers, diffusers_model = _stock_loader_weights(model, clip, diffusers_name, caplog)
    assert set(diffusers_model.patches) == set(comfy_model.patches) and len(from_diffusers) == len(run.adapters.layers)
    for key, weight in from_comfy.items():  # alpha == rank here: folding it in multiplies by nothing
        assert torch.equal(weight, from_diffusers[key]), key
    assert any(not torch.equal(w, model.model.state_dict()[k].float()) for k, w in from_comfy.items())


@pytest.mark.parametrize("family", ["wan21", "hidream_o1"])
def test_wan_diffusers_format_is_refused_naming_the_formats_that_load(comfyui, family):
    """ComfyUI's LoRA key map has no diffusers (WanTransformer3DModel) names for Wan, nor any for HiDream-O1 (diffusers
    has no class for it): a file in them would not load through the stock loader, so the save is refused before
    anything is written."""
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data(family, resolution=_side(family))
    run = _init(model, latents, texts, f"formats_{family}_diffusers", rank=4)
    with pytest.raises(ValueError, match=rf"Save LoRA \(Headroom\): the diffusers format covers .*, not family {family} "
                                         r"\(ComfyUI's LoRA loader maps no diffusers names for it\); save in the comfyui or "
                                         r"kohya format"):
        T.HeadroomSaveLora.execute(run, "formats", f"refused_{family}", "fp32", "diffusers")
    assert not any(f"refused_{family}" in k for k in _lora_names())


def test_diffusers_format_refuses_other_kinds_naming_the_formats_that_carry_them(comfyui):
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    for kind in ("loha", "lokr", "dora"):
        run = _init(model, latents, texts, f"formats_diffusers_{kind}", kind=kind, rank=4)
        with pytest.raises(ValueError, match=rf"Save LoRA \(Headroom\): kind {kind} cannot be saved in the diffusers "
                                             r"format .*save it in the comfyui or kohya format"):
            T.HeadroomSaveLora.execute(run, "formats", f"refused_{kind}", "fp32", "diffusers")
        assert not any(f"refused_{kind}" in k for k in _lora_names())


@pytest.mark.parametrize("family", ["hunyuan_image", "ideogram4"])
def test_diffusers_format_refuses_a_family_comfyui_maps_no_diffusers_names_for(comfyui, family):
    """HunyuanImage 2.1, Ideogram 4: ComfyUI's LoRA key map has no diffusers names for them (diffusers has an
    Ideogram4Transformer2DModel, but the stock loader would leave its names unloaded), so no file the stock loader
    reads."""
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data(family)
    run = _init(model, latents, texts, f"formats_diffusers_{family}", rank=4)
    with pytest.raises(ValueError, match=r"the diffusers format covers sd15, .*qwen_image, hidream, krea2 models, not family "
                                         rf"{family} .*save in the comfyui or kohya format"):
        T.HeadroomSaveLora.execute(run, "formats", f"refused_{family}", "fp32", "diffusers")
    assert not any(f"refused_{family}" in k for k in _lora_names())


def _lora_names() -> list[str]:
    import folder_paths

    return folder_paths.get_filename_list("loras")



# --- diffusers' own loader on diffusers models built from config (no download) --------------------------------
def _diffusers_state_of(dmodel, comfy_state: dict[str, torch.Tensor], conversion: dict) -> dict[str, torch.Tensor]:
    """The diffusers model's weights from a ComfyUI state dict through ComfyUI's conversion table ({diffusers
    key: ComfyUI key | (key, (dim, offset, size)) | (key, None, function)}); every diffusers weight is found."""
    own = dmodel.state_dict()
    state = {}
    for key, source in conversion.items():
        if key not in own:  # the table also lists other tools' aliases (Flux 2, LyCORIS)
            continue
        if isinstance(source, str):
            state[key] = comfy_state[source]
        elif source[1] is None:
            state[key] = source[2](comfy_state[source[0]])
        else:
            dim, offset, size = source[1]
            state[key] = comfy_state[source[0]].narrow(dim, offset, size)
    missing = sorted(set(own) - set(state))
    assert not missing, missing
    return {k: v.float() for k, v in state.items()}


def _load_with_diffusers(dmodel, pipeline, path: str, caplog, **kwargs) -> dict[str, torch.nn.Module]:
    """A file through the pipeline class's `lora_state_dict` and `load_lora_into_unet / _transformer`, as
    `load_lora_weights` does. Neither diffusers (its log: unexpected / missing keys) nor peft (a RuntimeWarning:
    state dict and config disagree) may report an unmatched key. Returns the injected LoRA layers."""
    import inspect
    import warnings

    import diffusers.utils.logging as diffusers_logging
    from peft.tuners.tuners_utils import BaseTunerLayer

    caplog.clear()
    diffusers_logging.enable_propagation()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if hasattr(pipeline, "load_lora_into_unet"):
                state, alphas, metadata = pipeline.lora_state_dict(path, return_lora_metadata=True, **kwargs)
                pipeline.load_lora_into_unet(state, alphas, dmodel, adapter_name="headroom", metadata=metadata)
            elif "network_alphas" in inspect.signature(pipeline.load_lora_into_transformer).parameters:  # Flux
                state, alphas, metadata = pipeline.lora_state_dict(path, return_alphas=True, return_lora_metadata=True)
                pipeline.load_lora_into_transformer(state, alphas, dmodel, adapter_name="headroom", metadata=metadata)
            else:  # SD3: no alphas in its API
                state, metadata = pipeline.lora_state_dict(path, return_lora_metadata=True)
                pipeline.load_lora_into_transformer(state, dmodel, adapter_name="headroom", metadata=metadata)
    finally:
        diffusers_logging.disable_propagation()
    unmatched = [r.getMessage() for r in caplog.records if r.name.startswith("diffusers")
                 and r.levelname == "WARNING" and ("unexpected" in r.getMessage() or "missing" in r.getMessage())]
    unmatched += [str(w.message) for w in caught if "inconsistency" in str(w.message) or "unexpected" in str(w.message)]
    assert not unmatched, unmatched
    return {name: module for name, module in dmodel.named_modules()
            if isinstance(module, BaseTunerLayer) and "headroom" in getattr(module, "lora_A", {})}


def _fused_against_comfy(dmodel, layers: dict, conversion: dict, comfy_weights: dict[str, torch.Tensor]) -> float:
    """Fuse the LoRA into the diffusers model and compare each fused layer with ComfyUI's patched weight, mapped
    through ComfyUI's conversion table; every patched ComfyUI weight must be covered. Returns the largest
    difference relative to the weight's largest entry."""
    dmodel.fuse_lora(lora_scale=1.0, adapter_names=["headroom"])
    covered, worst = set(), 0.0
    for name, module in layers.items():
        source = conversion[name + ".weight"]
        key = source if isinstance(source, str) else source[0]
        key = key if key.startswith("diffusion_model.") else "diffusion_model." + key
        expected = comfy_weights[key]
        fused = module.get_base_layer().weight.detach()
        if not isinstance(source, str) and source[1] is not None:
            expected = expected.narrow(*source[1])
        elif not isinstance(source, str):  # ComfyUI's weight is function(diffusers' weight)
            fused = source[2](fused)
        worst = max(worst, ((fused - expected).abs().max() / expected.abs().max()).item())
        # fp32 on both sides and the same operations (base + up @ down, alpha / rank 1): rounding order only.
        torch.testing.assert_close(fused, expected, rtol=1e-6, atol=1e-6)
        covered.add(key)
    assert covered == set(comfy_weights)
    return worst


_UNET_SDXL = {  # SDXL's block layout (no attention at the first level, linear projections, label embedding), tiny
    "use_checkpoint": False, "image_size": 32, "in_channels": 4, "out_channels": 4, "model_channels": 64,
    "num_res_blocks": [2, 2, 2], "channel_mult": [1, 2, 2], "transformer_depth": [0, 0, 1, 1, 2, 2],
    "transformer_depth_middle": 2, "transformer_depth_output": [0, 0, 0, 1, 1, 1, 2, 2, 2],
    "use_spatial_transformer": True, "legacy": False, "num_classes": "sequential", "adm_in_channels": 32 + 6 * 8,
    "context_dim": 32, "use_linear_in_transformer": True, "use_temporal_attention": False,
    "use_temporal_resblock": False,
}


def _tiny_sdxl():
    """A tiny SDXL MODEL through ComfyUI's own SDXL classes (the tiny-model node has no SDXL family)."""
    import comfy.model_patcher
    import comfy.supported_models
    from headroom.nodes.bridge.tiny_models import init_weights_

    config = comfy.supported_models.SDXL(dict(_UNET_SDXL))
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({}, "", device=torch.device("cpu"))
    init_weights_(model.diffusion_model, 0)
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def _diffusers_sdxl_unet(model):
    """diffusers' UNet2DConditionModel in the tiny SDXL's shape, with its weights."""
    import comfy.utils
    from diffusers import UNet2DConditionModel

    config = model.model.model_config.unet_config
    heads = tuple(config["model_channels"] * m // config["num_head_channels"] for m in config["channel_mult"])
    unet = UNet2DConditionModel(
        in_channels=4, out_channels=4, block_out_channels=tuple(config["model_channels"] * m for m in config["channel_mult"]),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), layers_per_block=2,
        transformer_layers_per_block=(1, 1, 2), attention_head_dim=heads, cross_attention_dim=config["context_dim"],
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=config["adm_in_channels"])
    conversion = comfy.utils.unet_to_diffusers(config)
    unet.load_state_dict(_diffusers_state_of(unet, model.model.diffusion_model.state_dict(), conversion))
    return unet.eval(), conversion


def _write_lora(name: str, state: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    import folder_paths
    from safetensors.torch import save_file

    path = f"{folder_paths.get_folder_paths('loras')[0]}/formats/{name}.safetensors"
    import os

    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(state, path, metadata=metadata)
    folder_paths.filename_list_cache.pop("loras", None)
    return f"formats/{name}.safetensors"


@pytest.mark.parametrize("alpha,layer_ranks,layer_alphas", [
    (4.0, "", ""), (3.0, "", ""), (3.0, "attn2=2 output_blocks=8", ""),
    (3.0, "attn2=2 output_blocks=8", "attn1=6 output_blocks.0.=0.5")])
def test_sdxl_files_are_the_same_lora_for_comfyui_and_diffusers(comfyui, alpha, layer_ranks, layer_alphas, caplog):
    """SDXL (a tiny SDXL built here; no training node run: an adapter of random weights on the SDXL preset layers,
    exported as the save node exports): comfyui / kohya / diffusers files give ComfyUI the same weights, and
    diffusers' SDXL loader injects every layer of the kohya and diffusers files with the same fused weights; with
    layer_ranks and layer_alphas, layers of three ranks and three alphas (the diffusers file's config names the other
    ranks in rank_pattern; each layer's alpha / rank folded into its up; diffusers misreads the kohya file's per-layer
    alphas, see below)."""
    from diffusers import StableDiffusionXLPipeline
    import folder_paths

    from headroom.nodes.bridge import families, lora_formats
    from headroom.training.core.adapters import AdapterConfig, AdapterSet, select_targets

    model = _tiny_sdxl()
    root = model.model.diffusion_model
    adapter_config = AdapterConfig(kind="lora", rank=4, alpha=alpha, layer_ranks=layer_ranks,
                                   layer_alphas=layer_alphas)
    paths = select_targets(root, families.lora_preset("sdxl"), adapter_config, [])
    adapters = AdapterSet(root, paths, adapter_config)
    ranks = {layer.r["default"] for layer in adapters.layers.values()}
    assert ranks == ({2, 4, 8} if layer_ranks else {4})
    assert {layer.lora_alpha["default"] for layer in adapters.layers.values()} == (
        {0.5, 3.0, 6.0} if layer_alphas else {alpha})
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in adapters.layers.values():  # peft starts up at zero: give it an effect
            layer.lora_B["default"].weight.copy_(torch.randn(layer.lora_B["default"].weight.shape, generator=generator) * 0.1)
    state = adapters.comfy_state_dict()
    tag = f"sdxl_alpha{alpha:g}" + ("_ranks" if layer_ranks else "") + ("_alphas" if layer_alphas else "")
    comfy_name = _write_lora(f"{tag}_comfyui", state, {})
    kohya_name = _write_lora(f"{tag}_kohya", lora_formats.to_kohya(state, lora_formats.kohya_names(model, paths, "sdxl")), {})
    names = lora_formats.diffusers_names(model, paths, "sdxl")
    diffusers_state, config = lora_formats.to_diffusers(state, names, "sdxl", torch.float32)
    assert ("unet.rank_pattern" in config) == bool(layer_ranks)
    if layer_ranks:
        pattern, common = config["unet.rank_pattern"], config["unet.r"]  # r: the most common rank
        assert set(pattern.values()) | {common} == {2, 4, 8} and common not in pattern.values()
        assert pattern == config["unet.alpha_pattern"]  # alpha folded into up: each layer's alpha is its rank
    diffusers_name = _write_lora(f"{tag}_diffusers", diffusers_state, lora_formats.diffusers_metadata(config))
    layer_count = sum(len(layers) for layers in names.values())
    assert layer_count == len(paths)  # SDXL's UNet has no fused weights
    keys, _ = _read(diffusers_name)
    assert any(k.startswith("unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.processor.to_q_lora.") for k in keys)

    from_comfy, _ = _stock_loader_weights(model, None, comfy_name, caplog)
    from_kohya, _ = _stock_loader_weights(model, None, kohya_name, caplog)
    from_diffusers, _ = _stock_loader_weights(model, None, diffusers_name, caplog)
    assert set(from_comfy) == set(from_kohya) == set(from_diffusers) and len(from_comfy) == len(paths)
    for key, weight in from_comfy.items():
        assert torch.equal(weight, from_kohya[key]), key
        if alpha == adapter_config.rank:
            assert torch.equal(weight, from_diffusers[key]), key
        else:  # alpha / rank folded into up before the product instead of after it: rounding only
            torch.testing.assert_close(from_diffusers[key], weight, rtol=1e-6, atol=1e-7)

    worst = {}
    # diffusers' SDXL kohya loader gives every layer the most common alpha when they differ (its alpha_pattern names
    # attention processors, "attn1.processor.to_q_lora.down.weight", which no module of its UNet has); ComfyUI, kohya
    # and A1111 read each layer's alpha. The diffusers-format file folds each layer's alpha into its up.
    formats = (("kohya", kohya_name),) if not layer_alphas else ()
    for file_format, name in (*formats, ("diffusers", diffusers_name)):
        with torch.inference_mode(False), torch.no_grad():
            unet, conversion = _diffusers_sdxl_unet(model)
            layers = _load_with_diffusers(unet, StableDiffusionXLPipeline, folder_paths.get_full_path_or_raise("loras", name),
                                          caplog, unet_config=unet.config)
            assert len(layers) == layer_count, (file_format, len(layers), layer_count)
            worst[file_format] = _fused_against_comfy(unet, layers, conversion, from_comfy)
    print(f"sdxl alpha {alpha:g}: {layer_count} layers; diffusers fused vs ComfyUI, max relative difference {worst}")


def _diffusers_flux_transformer(model):
    """diffusers' FluxTransformer2DModel in the tiny Flux's shape, with its weights."""
    import comfy.utils
    from diffusers import FluxTransformer2DModel

    config = model.model.model_config.unet_config
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=config["in_channels"] * config["patch_size"] ** 2, num_layers=config["depth"],
        num_single_layers=config["depth_single_blocks"], attention_head_dim=config["hidden_size"] // config["num_heads"],
        num_attention_heads=config["num_heads"], joint_attention_dim=config["context_in_dim"],
        pooled_projection_dim=config["vec_in_dim"], guidance_embeds=config["guidance_embed"],
        axes_dims_rope=tuple(config["axes_dim"]))
    conversion = comfy.utils.flux_to_diffusers(config, output_prefix="diffusion_model.")
    transformer.load_state_dict(_diffusers_state_of(transformer, model.model.state_dict(), conversion))
    return transformer.eval(), conversion


def test_flux_files_load_in_diffusers_with_comfyuis_weights(comfyui, caplog):
    """Flux: diffusers' Flux loader injects every layer of the diffusers file (fused qkv / linear1 as diffusers'
    separate to_q / to_k / to_v / proj_mlp layers) and of the kohya file into a FluxTransformer2DModel carrying the
    tiny Flux's weights, and the fused weights are ComfyUI's stock-loader weights.

    diffusers' kohya-Flux converter splits a single block's linear1 at Flux.1's fixed widths (3072 x 3 + 12288),
    so for the tiny Flux (width 128) only the kohya file's double-block layers can go through it: those are
    checked (its single blocks are the same code path as the comfyui file's, checked by the stock-loader test)."""
    import folder_paths
    from diffusers import FluxPipeline
    from safetensors.torch import load_file

    from headroom.nodes.bridge import lora_formats

    model, clip, run, comfy_name, kohya_name = _save_both("flux", "lora")
    diffusers_name = _save(run, "flux_lora_diffusers_loader", "diffusers")
    names = lora_formats.diffusers_names(model, run.adapters.layers, "flux")
    from_comfy, _ = _stock_loader_weights(model, clip, comfy_name, caplog)
    kohya_state = load_file(folder_paths.get_full_path_or_raise("loras", kohya_name))
    kohya_double = _write_lora("flux_lora_kohya_double_blocks",
                               {k: v for k, v in kohya_state.items() if k.startswith("lora_unet_double_blocks_")}, {})
    double = [p for p in names if p.startswith("double_blocks.")]
    cases = (("diffusers", diffusers_name, list(names)), ("kohya double blocks", kohya_double, double))
    worst, counts = {}, {}
    for file_format, name, paths in cases:
        expected_layers = sum(len(names[p]) for p in paths)
        expected_weights = {f"diffusion_model.{p}.weight": from_comfy[f"diffusion_model.{p}.weight"] for p in paths}
        with torch.inference_mode(False), torch.no_grad():
            transformer, conversion = _diffusers_flux_transformer(model)
            layers = _load_with_diffusers(transformer, FluxPipeline, folder_paths.get_full_path_or_raise("loras", name), caplog)
            assert len(layers) == expected_layers, (file_format, len(layers), expected_layers)
            worst[file_format] = _fused_against_comfy(transformer, layers, conversion, expected_weights)
        counts[file_format] = expected_layers
    print(f"flux: {len(run.adapters.layers)} ComfyUI modules, diffusers layers {counts}; fused vs ComfyUI, "
          f"max relative difference {worst}")


def _diffusers_flux2_transformer(model):
    """diffusers' Flux2Transformer2DModel in the tiny Flux.2's shape, with ComfyUI's weights wherever ComfyUI's table
    (comfy.utils.flux_to_diffusers, Flux.1's, with Flux.2 aliases) names them: every block layer a LoRA can train.
    Flux.2's shared modulation / time embedders are not in that table; they keep diffusers' init (the LoRA check
    below compares the adapted layers only)."""
    import comfy.utils
    from diffusers import Flux2Transformer2DModel

    config = model.model.model_config.unet_config
    transformer = Flux2Transformer2DModel(
        patch_size=config["patch_size"], in_channels=config["in_channels"], out_channels=config["out_channels"],
        num_layers=config["depth"], num_single_layers=config["depth_single_blocks"],
        attention_head_dim=config["hidden_size"] // config["num_heads"], num_attention_heads=config["num_heads"],
        joint_attention_dim=config["context_in_dim"], mlp_ratio=config["mlp_ratio"],
        axes_dims_rope=tuple(config["axes_dim"]), guidance_embeds=config["guidance_embed"])
    conversion = comfy.utils.flux_to_diffusers(config, output_prefix="diffusion_model.")
    comfy_state, own = model.model.state_dict(), transformer.state_dict()
    state = {}
    for key, source in conversion.items():
        if key in own and (isinstance(source, str) or source[1] is not None):
            weight = comfy_state[source] if isinstance(source, str) else comfy_state[source[0]].narrow(*source[1])
            state[key] = weight.float()
    blocks = [k for k in own if k.startswith(("transformer_blocks.", "single_transformer_blocks.")) and "norm" not in k]
    assert set(blocks) <= set(state), sorted(set(blocks) - set(state))
    transformer.load_state_dict(state, strict=False)
    return transformer.eval(), conversion


def test_flux2_diffusers_file_loads_in_diffusers_with_comfyuis_weights(comfyui, caplog):
    """Flux.2: the diffusers file carries diffusers' Flux.2 layer names (qkv split into to_q / to_k / to_v and
    add_*_proj, `ff.linear_in` / `ff.linear_out`, the single blocks' fused `attn.to_qkv_mlp_proj` / `attn.to_out`),
    and diffusers' Flux2 loader injects every layer into a Flux2Transformer2DModel carrying the tiny Flux.2's weights,
    with ComfyUI's stock-loader weights once fused."""
    import folder_paths
    from diffusers import Flux2Pipeline

    from headroom.nodes.bridge import lora_formats

    model, clip, run, comfy_name, _ = _save_both("flux2", "lora")
    diffusers_name = _save(run, "flux2_lora_diffusers_loader", "diffusers")
    names = lora_formats.diffusers_names(model, run.adapters.layers, "flux2")
    layer_names = sorted(name for layers in names.values() for name, _ in layers)
    assert "transformer.transformer_blocks.0.ff.linear_in" in layer_names
    assert "transformer.single_transformer_blocks.1.attn.to_qkv_mlp_proj" in layer_names
    assert "transformer.single_transformer_blocks.1.attn.to_out" in layer_names
    assert not any(".ff.net." in n or n.endswith(".proj_out") for n in layer_names), layer_names
    from_comfy, _ = _stock_loader_weights(model, clip, comfy_name, caplog)
    with torch.inference_mode(False), torch.no_grad():
        transformer, conversion = _diffusers_flux2_transformer(model)
        layers = _load_with_diffusers(transformer, Flux2Pipeline, folder_paths.get_full_path_or_raise("loras", diffusers_name),
                                      caplog)
        assert sorted("transformer." + name for name in layers) == layer_names
        worst = _fused_against_comfy(transformer, layers, conversion, from_comfy)
    print(f"flux2: {len(run.adapters.layers)} ComfyUI modules -> {len(layer_names)} diffusers layers; fused vs ComfyUI, "
          f"max relative difference {worst:.1e}")


def _diffusers_sd3_transformer(model):
    """diffusers' SD3Transformer2DModel in the tiny SD3's shape, with its weights."""
    import comfy.utils
    from diffusers import SD3Transformer2DModel

    config = model.model.model_config.unet_config
    hidden = 64 * config["depth"]  # MMDiT's width is 64 per block of depth, one 64-wide head per block
    transformer = SD3Transformer2DModel(
        sample_size=config["pos_embed_max_size"], patch_size=config["patch_size"], in_channels=config["in_channels"],
        num_layers=config["depth"], attention_head_dim=64, num_attention_heads=config["depth"],
        joint_attention_dim=config["context_embedder_config"]["params"]["in_features"], caption_projection_dim=hidden,
        pooled_projection_dim=config["adm_in_channels"], out_channels=config["out_channels"],
        pos_embed_max_size=config["pos_embed_max_size"])
    conversion = comfy.utils.mmdit_to_diffusers(config, output_prefix="diffusion_model.")
    transformer.load_state_dict(_diffusers_state_of(transformer, model.model.state_dict(), conversion))
    return transformer.eval(), conversion


@pytest.mark.parametrize("targets", ["preset", "all_linear"])
def test_sd3_diffusers_file_loads_in_diffusers_with_comfyuis_weights(comfyui, targets, caplog):
    """SD3: diffusers' SD3 loader injects every layer of the diffusers file (the fused qkv of both streams as
    diffusers' to_q / to_k / to_v and add_q_proj / add_k_proj / add_v_proj) into an SD3Transformer2DModel carrying
    the tiny SD3's weights, with ComfyUI's stock-loader weights; all_linear adds the modulation layers, the last
    context one through ComfyUI's swap_scale_shift. (diffusers' SD3 reader converts no kohya names.)"""
    import folder_paths
    from diffusers import StableDiffusion3Pipeline

    from headroom.nodes.bridge import lora_formats

    model, clip, run, comfy_name, _ = _save_both("sd3", "lora", **({} if targets == "preset" else {"targets": targets}))
    diffusers_name = _save(run, f"sd3_lora_diffusers_loader_{targets}", "diffusers")
    layer_count = sum(len(v) for v in lora_formats.diffusers_names(model, run.adapters.layers, "sd3").values())
    from_comfy, _ = _stock_loader_weights(model, clip, comfy_name, caplog)
    with torch.inference_mode(False), torch.no_grad():
        transformer, conversion = _diffusers_sd3_transformer(model)
        layers = _load_with_diffusers(transformer, StableDiffusion3Pipeline,
                                      folder_paths.get_full_path_or_raise("loras", diffusers_name), caplog)
        assert len(layers) == layer_count
        worst = _fused_against_comfy(transformer, layers, conversion, from_comfy)
    print(f"sd3 {targets}: {len(run.adapters.layers)} ComfyUI modules, {layer_count} diffusers layers; fused vs ComfyUI, "
          f"max relative difference {worst}")


def test_continuing_a_diffusers_file_with_separate_qkv_adapters_is_refused(comfyui):
    """A Flux file trained in diffusers on to_q / to_k / to_v separately (own down weights) is one rank-r LoRA per
    projection, which no rank-r LoRA on ComfyUI's fused qkv holds: refused, saying why."""
    import folder_paths
    from safetensors.torch import load_file

    model, _, run, _, _ = _save_both("flux", "lora")
    _, _, _, latents, texts = _data("flux")
    state = load_file(folder_paths.get_full_path_or_raise("loras", _save(run, "flux_lora_diffusers_qkv", "diffusers")))
    key = "transformer.transformer_blocks.0.attn.to_k.lora_A.weight"
    state[key] = state[key] + 0.01
    name = _write_lora("flux_lora_diffusers_separate_qkv", state, {})
    with pytest.raises(ValueError, match=r"double_blocks\.0\.img_attn\.qkv .*different down weights"):
        _init_from(model, latents, texts, "continue_separate_qkv", name)


def test_flux2_kohya_metadata_names_the_variant_as_musubi_tuner_does(comfyui, caplog):
    """Flux.2's kohya files carry musubi-tuner's modelspec.architecture of the variant, read from the model's width
    (real widths on the meta device: no memory); the tiny model's width is no released variant: none written. The
    saved kohya file of the tiny Flux.2 loads through the stock loader with every key."""
    import comfy.model_detection
    import comfy.model_patcher
    from realsize_models import unet_config

    from headroom.nodes.bridge import lora_formats

    for arch, expected in (("flux2_dev", "Flux.2-dev/lora"), ("flux2_klein_4b", "Flux.2-klein-4b/lora"),
                           ("flux2_klein_9b", "Flux.2-klein-9b/lora")):
        config = comfy.model_detection.model_config_from_unet_config(unet_config(arch, (0, 0)))
        model = comfy.model_patcher.ModelPatcher(config.get_model({}, "", device=torch.device("meta")), "cpu", "cpu")
        metadata = lora_formats.kohya_metadata("flux2", "lora", 16, 16.0, 10, "x", (1024, 1024), model=model)
        assert metadata["modelspec.architecture"] == expected and "ss_base_model_version" not in metadata
    model, clip, run, comfy_name, kohya_name = _save_both("flux2", "lora")
    keys, metadata = _read(kohya_name)
    assert all(k.startswith("lora_unet_") for k in keys) and any(k.startswith("lora_unet_single_blocks_") for k in keys)
    assert "modelspec.architecture" not in metadata and metadata["ss_network_dim"] == "4"
    _stock_loader_weights(model, clip, kohya_name, caplog)


def _diffusers_transformer_of(family: str, model):
    """diffusers' own transformer class for a tiny zimage / qwen_image / krea2 model, in its shape, carrying the tiny model's
    weights where ComfyUI's conversion maps them (its embedders too where it does). Returns (transformer, conversion:
    {diffusers key: ComfyUI key | (key, (dim, offset, size))})."""
    import comfy.utils
    from diffusers import QwenImageTransformer2DModel, ZImageTransformer2DModel

    config = model.model.model_config.unet_config
    if family == "zimage":
        transformer = ZImageTransformer2DModel(
            in_channels=config["in_channels"], dim=config["dim"], n_layers=config["n_layers"],
            n_refiner_layers=config["n_refiner_layers"], n_heads=config["n_heads"], n_kv_heads=config["n_kv_heads"],
            cap_feat_dim=config["cap_feat_dim"], rope_theta=config["rope_theta"], axes_dims=config["axes_dims"],
            axes_lens=config["axes_lens"])
        conversion = comfy.utils.z_image_to_diffusers(config, output_prefix="diffusion_model.")
    elif family == "krea2":
        from diffusers import Krea2Transformer2DModel

        dm = model.model.diffusion_model
        block, text_block = dm.blocks[0], dm.txtfusion.layerwise_blocks[0]
        transformer = Krea2Transformer2DModel(
            in_channels=config["channels"] * config["patch"] ** 2, num_layers=config["layers"],
            attention_head_dim=config["features"] // config["heads"], num_attention_heads=config["heads"],
            num_key_value_heads=config["kvheads"], intermediate_size=block.mlp.gate.out_features,
            text_hidden_dim=config["txtdim"], num_text_layers=config["txtlayers"],
            text_num_attention_heads=config["txtheads"], text_num_key_value_heads=config["txtkvheads"],
            text_intermediate_size=text_block.mlp.gate.out_features)
        conversion = comfy.utils.krea2_to_diffusers(config, output_prefix="diffusion_model.")
    else:  # ComfyUI's Qwen-Image module paths are diffusers' names
        transformer = QwenImageTransformer2DModel(
            in_channels=config["in_channels"], out_channels=config["out_channels"], num_layers=config["num_layers"],
            attention_head_dim=config["attention_head_dim"], num_attention_heads=config["num_attention_heads"],
            joint_attention_dim=config["joint_attention_dim"], axes_dims_rope=tuple(config["axes_dims_rope"]))
        conversion = {k[len("diffusion_model."):]: k for k in model.model.state_dict() if k.startswith("diffusion_model.")}
    comfy_state = model.model.state_dict()
    own = transformer.state_dict()
    state = {}
    for key, source in conversion.items():
        if key in own:
            tensor = comfy_state[source] if isinstance(source, str) else comfy_state[source[0]].narrow(*source[1])
            if tensor.shape == own[key].shape:
                state[key] = tensor.float()
    transformer.load_state_dict(state, strict=False)
    return transformer.eval(), conversion


@pytest.mark.parametrize("family", ["zimage", "qwen_image", "krea2"])
def test_new_family_diffusers_files_load_in_diffusers_with_comfyuis_weights(comfyui, family, caplog):
    """Z-Image / Qwen-Image: diffusers' pipeline loader injects every layer of the diffusers-format file into the
    family's diffusers transformer (Z-Image's fused qkv as to_q / to_k / to_v) with no unmatched key, and the fused
    weights are the stock LoraLoader's patched weights."""
    import folder_paths
    from diffusers import QwenImagePipeline, ZImagePipeline

    from headroom.nodes.bridge import lora_formats

    model, clip, run, comfy_name, _ = _save_both(family, "lora")
    diffusers_name = _save(run, f"{family}_lora_diffusers_loader", "diffusers")
    names = lora_formats.diffusers_names(model, run.adapters.layers, family)
    from_comfy, _ = _stock_loader_weights(model, clip, comfy_name, caplog)
    from diffusers import Krea2Pipeline

    pipeline = {"zimage": ZImagePipeline, "qwen_image": QwenImagePipeline, "krea2": Krea2Pipeline}[family]
    with torch.inference_mode(False), torch.no_grad():
        transformer, conversion = _diffusers_transformer_of(family, model)
        layers = _load_with_diffusers(transformer, pipeline, folder_paths.get_full_path_or_raise("loras", diffusers_name),
                                      caplog)
        assert len(layers) == sum(len(v) for v in names.values())
        worst = _fused_against_comfy(transformer, layers, conversion, from_comfy)
    print(f"{family}: {len(run.adapters.layers)} ComfyUI modules -> {len(layers)} diffusers layers; fused vs "
          f"ComfyUI, max relative difference {worst:.1e}")


# --- files other trainers write -------------------------------------------------------------------------------
def test_a_file_of_comfyuis_own_train_lora_is_refused_naming_its_diff_patches(comfyui, tmp_path):
    """ComfyUI's stock Train LoRA + Save LoRA Weights (comfy_extras/nodes_train.py, run for real on the tiny SD1.5)
    write bias / norm 'diff' entries next to the LoRA layers; continuing such a file says so (it said 'holds a tuple
    update')."""
    import shutil

    import folder_paths
    import nodes
    from comfy_extras.nodes_train import SaveLoRA, TrainLoraNode

    model, clip, _, latents, texts = _data("sd15", count=1)
    with torch.inference_mode():
        positive = nodes.CLIPTextEncode().encode(clip, "a red square")[0]
        samples = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    lora = TrainLoraNode.execute(
        model=[model], latents=[{"samples": samples}], positive=[positive], batch_size=[1], steps=[1],
        grad_accumulation_steps=[1], learning_rate=[1e-3], rank=[2], optimizer=["AdamW"], loss_function=["MSE"],
        seed=[0], training_dtype=["fp32"], lora_dtype=["fp32"], quantized_backward=[False], algorithm=["LoRA"],
        gradient_checkpointing=[False], checkpoint_depth=[1], offloading=[False], existing_lora=["[None]"],
        bucket_mode=[False], bypass_mode=[False]).result[0]
    SaveLoRA.execute(lora, "stock_train_lora/file")
    saved = next((pathlib.Path(folder_paths.get_output_directory()) / "stock_train_lora").glob("*.safetensors"))
    assert any(key.endswith((".diff", ".diff_b")) for key in _keys_of(saved))  # what makes the file special
    target = pathlib.Path(folder_paths.get_folder_paths("loras")[0]) / "formats" / "stock_train_lora.safetensors"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(saved, target)
    folder_paths.filename_list_cache.pop("loras", None)
    with pytest.raises(ValueError) as error:
        _init_from(model, latents, texts, "continue_stock_train_lora", "formats/stock_train_lora.safetensors")
    message = str(error.value)
    assert "whole-tensor 'diff' patches" in message and "ComfyUI's Train LoRA" in message and "tuple" not in message
    assert "Load LoRA" in message, message


def _keys_of(path) -> list[str]:
    with safe_open(str(path), "pt") as f:
        return list(f.keys())


def test_a_peft_named_sd15_file_from_diffusers_continues_exactly(comfyui, caplog):
    """An SD1.5 LoRA as diffusers' `save_lora_weights` writes it from a PEFT-injected UNet (what its training scripts
    save: `unet.<block>.attn1.to_k.lora_A.weight`): the attention layers, which ComfyUI's key map names only in the
    attention-processor form, are mapped too; the run starts exactly where the file is."""
    import folder_paths
    import nodes
    from diffusers import StableDiffusionPipeline
    from peft.utils import get_peft_model_state_dict

    model, clip, first, _, _ = _save_both("sd15", "lora")
    _, _, _, latents, texts = _data("sd15")
    source = _save(first, "sd15_peft_source", "diffusers")
    with torch.inference_mode(False), torch.no_grad():
        unet = _diffusers_unet_of(model)
        _load_with_diffusers(unet, StableDiffusionPipeline, folder_paths.get_full_path_or_raise("loras", source), caplog)
        folder = pathlib.Path(folder_paths.get_folder_paths("loras")[0]) / "formats" / "sd15_peft"
        StableDiffusionPipeline.save_lora_weights(folder, unet_lora_layers=get_peft_model_state_dict(
            unet, adapter_name="headroom"), safe_serialization=True)
    folder_paths.filename_list_cache.pop("loras", None)
    name = "formats/sd15_peft/pytorch_lora_weights.safetensors"
    keys = _keys_of(folder_paths.get_full_path_or_raise("loras", name))
    assert any(k.endswith(".attn1.to_k.lora_A.weight") for k in keys) and not any("processor" in k for k in keys)

    continued = _init_from(model, latents, texts, "continued_sd15_peft", name)
    with torch.inference_mode():
        at_start = _save(continued, "continued_sd15_peft_step0", "comfyui")
        original, _ = nodes.LoraLoader().load_lora(model, clip, source, 1.0, 0.0)
        restarted, _ = nodes.LoraLoader().load_lora(model, clip, at_start, 1.0, 0.0)
        expected, got = _patched_weights(original), _patched_weights(restarted)
    assert expected.keys() == got.keys() and len(got) == len(first.adapters.layers)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-7)



def test_saved_files_carry_the_captions_tag_counts_and_kohyas_training_keys(comfyui):
    """Every format holds ss_tag_frequency over the training images (each image once, though flip caches it twice;
    the held-out item left out), the trigger word first, and ss_num_train_images; caption_tags off writes no caption
    text. The kohya format adds sd-scripts' training keys."""
    from headroom.nodes import cache as cache_nodes, data as data_nodes, train_lora as T
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    captions = ["red, circle, top left", "blue, circle", "red, square, {small|large}", "green, triangle"]
    with torch.inference_mode():
        model, clip, vae = build_tiny_models("sd15", 0)
        images = data_nodes.HeadroomSyntheticDataset.execute(4, 32, 0).args[0]
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, "\n".join(captions), 32, 32, "center", True, 0,
                                                                trigger_word="ohwx").args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
    assert len(latents) == 8  # each image and its mirror
    run = _init(model, latents, texts, "tag_counts", rank=4, holdout=2, loraplus_lr_ratio=2.0)  # the last image out
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 1)
        names = {fmt: T.HeadroomSaveLora.execute(run, "formats", f"tags_{fmt}", "fp32", fmt).args[0]
                 for fmt in ("comfyui", "kohya", "diffusers")}
        private = T.HeadroomSaveLora.execute(run, "formats", "tags_off", "fp32", caption_tags=False).args[0]
    expected = {"ohwx": 3, "red": 2, "circle": 2, "top left": 1, "blue": 1, "square": 1, "{small|large}": 1}
    for fmt, name in names.items():
        metadata = _read(name)[1]
        counts = json.loads(metadata["ss_tag_frequency"])
        assert counts == {"tag_counts": expected} and next(iter(counts["tag_counts"])) == "ohwx", fmt
        assert metadata["ss_num_train_images"] == "3", fmt
    assert {key for key in _read(names["comfyui"])[1] if key.startswith("ss_")} == {"ss_tag_frequency",
                                                                                   "ss_num_train_images"}
    kohya = _read(names["kohya"])[1]
    assert (kohya["ss_optimizer"], float(kohya["ss_learning_rate"]), kohya["ss_lr_scheduler"], kohya["ss_seed"],
            kohya["ss_loraplus_lr_ratio"]) == ("AdamW", 1e-2, "constant", "0", "2.0")
    assert not any("ohwx" in value or "circle" in value for value in _read(private)[1].values())
