"""The built-in tiny models are real ComfyUI objects that stock nodes sample, encode and train with."""
import pytest
import torch

pytestmark = pytest.mark.comfyui

FAMILIES = ["sd15", "sd2", "sdxl", "sd3", "flux", "chroma"]


def _weights(patcher):
    return {k: v.detach().clone() for k, v in patcher.model.diffusion_model.state_dict().items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_samples_with_stock_nodes(comfyui, family):
    import comfy.model_base
    import comfy.sd
    import nodes
    from headroom.nodes.tiny_models import build_tiny_models

    model, clip, vae = build_tiny_models(family, seed=0)
    assert isinstance(model.model, comfy.model_base.BaseModel)
    assert isinstance(clip, comfy.sd.CLIP) and isinstance(vae, comfy.sd.VAE)
    expected_base = {"sd15": comfy.model_base.BaseModel, "sd2": comfy.model_base.BaseModel, "sdxl": comfy.model_base.SDXL,
                     "sd3": comfy.model_base.SD3, "flux": comfy.model_base.Flux, "chroma": comfy.model_base.Chroma}
    assert type(model.model) is expected_base[family]
    n_params = sum(p.numel() for p in model.model.diffusion_model.parameters())
    assert 10_000 < n_params < 5_000_000

    with torch.inference_mode():
        positive = nodes.CLIPTextEncode().encode(clip, "a red circle at the center")[0]
        negative = nodes.CLIPTextEncode().encode(clip, "")[0]
        channels = vae.latent_channels
        latent = {"samples": torch.zeros(1, channels, 8, 8)}
        cfg = 1.0 if family in ("flux", "chroma") else 4.0
        samples = nodes.common_ksampler(model, 0, 4, cfg, "euler", "normal", positive, negative, latent)[0]
        image = nodes.VAEDecode().decode(vae, samples)[0]
        again = nodes.VAEDecode().decode(vae, nodes.common_ksampler(
            model, 0, 4, cfg, "euler", "normal", positive, negative, latent)[0])[0]
    assert samples["samples"].shape == (1, channels, 8, 8)
    assert image.shape == (1, 64, 64, 3)
    assert torch.isfinite(image).all() and image.std() > 0
    assert torch.equal(image, again), "same seed must give the same image"
    assert torch.isfinite(positive[0][0]).all()
    # Chroma's T5-only encoder has no pooled output
    assert (positive[0][1].get("pooled_output") is not None) == (family != "chroma")


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_weights_are_seeded(comfyui, family):
    from headroom.nodes.tiny_models import build_tiny_model_patcher

    a, b, c = (_weights(build_tiny_model_patcher(family, seed)) for seed in (0, 0, 1))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert all(torch.isfinite(v).all() for v in a.values())


def test_deep_clone_goes_through_cached_patcher_init(comfyui):
    from headroom.nodes.tiny_models import build_tiny_models

    model, clip, vae = build_tiny_models("sd15", seed=3)
    clone = model.clone(force_deepcopy=True)
    assert clone.model is not model.model
    original, copied = _weights(model), _weights(clone)
    assert all(torch.equal(original[k], copied[k]) for k in original)
    for patcher in (clip.patcher, vae.patcher):
        assert patcher.cached_patcher_init is not None
        rebuilt = patcher.cached_patcher_init[0](*patcher.cached_patcher_init[1], disable_dynamic=True)
        rebuilt_sd, sd = rebuilt.model.state_dict(), patcher.model.state_dict()
        assert all(torch.equal(rebuilt_sd[k], sd[k]) for k in sd)


def test_comfyui_native_trainer_runs_on_tiny_model(comfyui):
    """ComfyUI's own TrainLoraNode deep-clones the MODEL through cached_patcher_init: it must work."""
    import nodes
    from comfy_extras.nodes_train import TrainLoraNode
    from headroom.nodes.tiny_models import build_tiny_models

    model, clip, vae = build_tiny_models("sd15", seed=0)
    with torch.inference_mode():
        positive = nodes.CLIPTextEncode().encode(clip, "a blue square")[0]
        latent = nodes.VAEEncode().encode(vae, torch.rand(1, 64, 64, 3))[0]
        out = TrainLoraNode.execute(
            model=[model], latents=[latent], positive=[positive], batch_size=[1], steps=[2],
            grad_accumulation_steps=[1], learning_rate=[1e-3], rank=[4], optimizer=["AdamW"],
            loss_function=["MSE"], seed=[0], training_dtype=["fp32"], lora_dtype=["fp32"],
            quantized_backward=[False], algorithm=["LoRA"], gradient_checkpointing=[False],
            checkpoint_depth=[1], offloading=[False], existing_lora=["[None]"], bucket_mode=[False],
            bypass_mode=[False],
        )
    lora, loss_map, steps = out.result
    assert steps == 2 and len(loss_map["loss"]) == 2
    assert any(k.endswith("lora_up.weight") for k in lora)


def test_tiny_model_node_schema(headroom_nodes):
    from headroom.nodes.tiny_models import FAMILIES as families, HeadroomTinyModel

    schema = HeadroomTinyModel.define_schema()
    assert schema.node_id == "HeadroomTinyModel"
    assert [o.io_type for o in schema.outputs] == ["MODEL", "CLIP", "VAE"]
    with pytest.raises(ValueError, match="unknown family 'wan'"):
        HeadroomTinyModel.execute(family="wan", seed=0)
    assert tuple(families) == tuple(FAMILIES)
