"""A ComfyUI model no family module describes (AuraFlow: ComfyUI loads it, Headroom has no preset for it) trains
with generic targets (every linear layer inside its blocks) and round-trips through the stock nodes; `preset`
targets fail before any work with a message listing the families that have one."""
from __future__ import annotations

import pytest
import torch

from family_checks import cached_data, check_stock_round_trip, init_run, overfit

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]

# comfy.ldm.aura.mmdit.MMDiT at a tiny size (the real AuraFlow: dim 3072, 4 double + 32 single layers).
_TINY_AURA = {"in_channels": 4, "out_channels": 4, "patch_size": 2, "dim": 64, "n_layers": 2, "n_double_layers": 1,
              "n_heads": 2, "global_conddim": 64, "cond_seq_dim": 32, "max_seq": 16 * 16}
_TINY_PILE_T5 = {"d_model": 32, "d_ff": 64, "num_layers": 2, "num_heads": 2, "d_kv": 16}


def _tiny_auraflow():
    """(MODEL, CLIP, VAE) of a tiny AuraFlow through ComfyUI's own classes (as nodes/bridge/tiny_models.py builds the
    families), seeded."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.sd
    import comfy.supported_models
    from headroom.nodes.bridge.families.base import autoencoder_kl
    from headroom.nodes.bridge.tiny_models import init_weights_

    with torch.inference_mode(False):
        config = comfy.supported_models.AuraFlow(dict(_TINY_AURA))
        config.set_inference_dtype(torch.float32, None)
        model = config.get_model({}, "")
        init_weights_(model.diffusion_model, 0)
        patcher = comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                                   offload_device=mm.unet_offload_device())
        clip = comfy.sd.CLIP(config.clip_target(), parameters=0,
                             model_options={"pile_t5xl_model_config": dict(_TINY_PILE_T5)})
        init_weights_(clip.cond_stage_model, 1)
        reference, vae_config = autoencoder_kl(4)
        init_weights_(reference, 2)
        vae = comfy.sd.VAE(sd=reference.state_dict(), config=vae_config)
    return patcher, clip, vae


def test_a_model_without_a_family_trains_with_generic_targets(comfyui, caplog):
    from headroom.nodes.bridge import families

    model, clip, vae = _tiny_auraflow()
    assert families.family_of(model.model) is None  # the point of this test: no family module describes it
    latents, texts = cached_data(model, clip, vae)
    with pytest.raises(ValueError, match=r"this model has no LoRA target preset \(presets: sd15, .*flux.*\); set "
                                         r"targets to 'all_linear'"):
        init_run(model, latents, texts, "generic_preset", 8, 1e-2, "preset", False)
    run = init_run(model, latents, texts, "generic_overfit", 16, 1e-2, "all_layers", False, "cosine", 300)
    initial, final = overfit(run)
    print(f"auraflow (no family): {run.step} steps; loss {initial:.4f} -> {final:.4f}")
    assert final <= 0.5 * initial
    run = init_run(model, latents, texts, "generic_roundtrip", 8, 2e-2, "all_linear", False)
    assert run.adapters.layers and all(".double_layers." in f".{p}" or ".single_layers." in f".{p}"
                                       for p in run.adapters.layers)
    check_stock_round_trip(run, model, clip, vae, caplog, label="auraflow (no family)")


def test_unsupported_sampling_fails_before_training_naming_what_is_supported(comfyui):
    """A model whose sampling the objective does not cover (here the tiny SD1.5 given EDM sampling by the stock
    ModelSamplingContinuousEDM node) fails at Init with the supported kinds listed, before any step."""
    from comfy_extras.nodes_model_advanced import ModelSamplingContinuousEDM
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, clip, vae = build_tiny_models("sd15", 0)
    latents, texts = cached_data(model, clip, vae)
    edm = ModelSamplingContinuousEDM().patch(model, "edm", 120.0, 0.002)[0]
    with pytest.raises(ValueError, match=r"not supported for training \(supported: discrete eps / v-prediction, and "
                                         r"flow models"):
        init_run(edm, latents, texts, "generic_edm", 4, 1e-3, "preset", False)


def test_training_uses_the_model_sampling_a_stock_node_patched_in(comfyui):
    """ModelSamplingSD3 / ModelSamplingDiscrete applied before training change the objective as they change sampling
    (they object-patch `model_sampling`; the model's own attribute keeps the default)."""
    from comfy_extras.nodes_model_advanced import ModelSamplingDiscrete, ModelSamplingSD3
    from headroom.nodes.bridge.comfy_model import ComfyDenoiser
    from headroom.nodes.bridge.tiny_models import build_tiny_model_patcher

    sd3 = build_tiny_model_patcher("sd3", 0)
    assert ComfyDenoiser(sd3).sampling.flow_shift == pytest.approx(3.0)  # SD3's default shift
    shifted = ModelSamplingSD3().patch(sd3, 6.0)[0]
    assert ComfyDenoiser(shifted).sampling.flow_shift == pytest.approx(6.0)
    sd15 = build_tiny_model_patcher("sd15", 0)
    assert ComfyDenoiser(sd15).sampling.prediction == "eps"
    v_pred = ModelSamplingDiscrete().patch(sd15, "v_prediction", False)[0]
    assert ComfyDenoiser(v_pred).sampling.prediction == "v"
    # zsnr (kohya's zero_terminal_snr): the rescaled table, its last sigma ~4500 (SNR ~5e-8), is the one trained on
    zsnr = ModelSamplingDiscrete().patch(sd15, "v_prediction", True)[0]
    table = zsnr.get_model_object("model_sampling").sigmas.float().cpu()
    descriptor = ComfyDenoiser(zsnr).sampling
    assert descriptor.prediction == "v" and torch.equal(descriptor.sigmas, table) and table[-1] > 1000
    assert not torch.equal(table, ComfyDenoiser(v_pred).sampling.sigmas)
