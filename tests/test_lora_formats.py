"""Save formats: a kohya-format file is the same LoRA as the ComfyUI-format one, for ComfyUI's stock loader and
for diffusers (tiny sd15 / sd3 / flux models, in-process, CPU)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from test_train_lora_nodes import _data, _init, one_thread  # noqa: F401  (one_thread: autouse fixture)

pytestmark = pytest.mark.comfyui


def _save_both(family: str, kind: str):
    """Train 2 steps, save the same adapter in both formats: (model, clip, run, comfyui name, kohya name)."""
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data(family)
    run = _init(model, latents, texts, f"formats_{family}_{kind}", kind=kind, rank=4, lr=2e-2)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 2)
        comfy_name = T.HeadroomSaveLora.execute(run, "formats", f"{family}_{kind}_comfyui", "fp32").args[0]
        kohya_name = T.HeadroomSaveLora.execute(run, "formats", f"{family}_{kind}_kohya", "fp32", "kohya").args[0]
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
                                         ("sd3", "lora"), ("flux", "lora"), ("flux", "lokr")])
def test_kohya_file_is_the_same_lora_for_the_stock_loader(comfyui, family, kind, caplog):
    import nodes

    model, clip, run, comfy_name, kohya_name = _save_both(family, kind)
    keys, metadata = _read(kohya_name)
    assert keys and all(k.startswith("lora_unet_") for k in keys)
    if family == "sd15":  # sd-scripts names SD1.x modules by diffusers' blocks
        assert any("_down_blocks_" in k for k in keys) and not any("_input_blocks_" in k for k in keys)
    if family == "flux":
        assert any(k.startswith("lora_unet_double_blocks_") for k in keys)
    assert metadata["ss_network_dim"] == "4" and float(metadata["ss_network_alpha"]) == 4.0
    assert metadata["ss_steps"] == "2" and metadata["ss_resolution"] == "(32, 32)"
    assert metadata["ss_base_model_version"] == {"sd15": "sd_v1", "sd3": "sd3", "flux": "flux1"}[family]
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


def test_unknown_format_is_refused_with_the_choices(comfyui, tmp_path):
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "formats_bad", rank=4)
    with pytest.raises(ValueError, match=r"HeadroomSaveLora: format 'a1111': choose one of comfyui, kohya"):
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


def test_kohya_sd15_file_loads_in_diffusers_and_gives_comfyuis_output(comfyui):
    """diffusers' own kohya reader (`lora_state_dict` + `load_lora_adapter`) injects every layer of the file into a
    diffusers UNet, and the result equals ComfyUI's stock-loader result on the same base weights."""
    import comfy.model_management
    import folder_paths
    import nodes
    from diffusers import StableDiffusionPipeline

    model, clip, run, _, kohya_name = _save_both("sd15", "lora")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 8, 8, generator=generator)
    t = torch.tensor([500.0])
    context = torch.randn(1, 7, model.model.model_config.unet_config["context_dim"], generator=generator)

    with torch.inference_mode(False), torch.no_grad():
        unet = _diffusers_unet_of(model)
        base_out = unet(x, t, encoder_hidden_states=context).sample
        state, alphas = StableDiffusionPipeline.lora_state_dict(folder_paths.get_full_path_or_raise("loras", kohya_name))
        unet.load_lora_adapter(state, network_alphas=alphas, prefix="unet", adapter_name="headroom")
        lora_layers = [name for name, module in unet.named_modules() if hasattr(module, "lora_A") and module.lora_A]
        diffusers_out = unet(x, t, encoder_hidden_states=context).sample

        comfy_base_out = model.model.diffusion_model(x, timesteps=t, context=context).float()
        kohya_model, _ = nodes.LoraLoader().load_lora(model, clip, kohya_name, 1.0, 0.0)
        comfy.model_management.load_models_gpu([kohya_model])  # as a sampler loads it: the patches applied
        try:
            comfy_out = kohya_model.model.diffusion_model(x, timesteps=t, context=context).float()
        finally:
            comfy.model_management.unload_all_models()

    assert (comfy_base_out - base_out).norm() / base_out.norm() < 1e-5  # same base model in both
    assert len(lora_layers) == len(run.adapters.layers)
    change = (diffusers_out - base_out).norm() / base_out.norm()
    difference = (diffusers_out - comfy_out).norm() / comfy_out.norm()
    print(f"diffusers vs ComfyUI with the kohya file: relative L2 {difference:.2e} (LoRA effect {change:.2e})")
    assert change > 1e-3  # the LoRA does something ...
    assert difference < 1e-5  # ... and the same thing in both (fp32 throughout)


def _init_from(model, latents, texts, run_name, init_lora, kind="lora", rank=4, alpha=2.0):
    """A LoRA run whose LoRA config starts from `init_lora` (alpha 2 on purpose: the file's is 4)."""
    from headroom.nodes import train_lora as T

    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute(kind, rank, alpha, "preset", False, 0.0, 0, init_lora).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", 1e-2, 0.0, "constant", 0, 1000).args[0]
        return T.HeadroomTrainLoraInit.execute(
            model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt,
            run_name=run_name, seed=0, batch_size=4, grad_accumulation=1, precision="fp32", max_grad_norm=1.0,
            caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0,
            noise_offset=0.0, gradient_checkpointing=False, checkpoint_depth=1, holdout=0).args[0]


@pytest.mark.parametrize("file_format", ["comfyui", "kohya"])
def test_a_saved_lora_continues_exactly_where_the_file_was(comfyui, file_format):
    import nodes
    from headroom.nodes import train_lora as T

    model, clip, first, comfy_name, kohya_name = _save_both("sd15", "lora")
    _, _, _, latents, texts = _data("sd15")
    name = comfy_name if file_format == "comfyui" else kohya_name
    continued = _init_from(model, latents, texts, f"continued_{file_format}", name)
    assert continued.step == 0 and not continued.resumed
    with torch.inference_mode():
        at_start = T.HeadroomSaveLora.execute(continued, "formats", f"continued_{file_format}_step0", "fp32").args[0]
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
