"""Edit / reference models (Flux.1 Kontext, Flux.2 reference images, Qwen-Image-Edit): LoRA training with each item's
cached control latents passed as ComfyUI's `reference_latents`, validation with reference images, and the stock edit
path (LoraLoader + CLIPTextEncode + VAEEncode + ReferenceLatent + KSampler + VAEDecode) reproducing the validation.

The paired dataset: a reference image (the whole image in one colour) -> the target (the same with a grey square),
caption = the instruction, the same for every item: only the reference tells the targets apart: a model that learnt to use it has a clearly lower loss with its own reference than with
the other item's.
"""
from __future__ import annotations

import logging

import pytest
import torch

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]

SIZE = 32
# The reference is the whole image in one colour; the target is that image with a grey square added. Every item has
# the same instruction, so only its reference tells its target from the others'.
COLOURS = [(0.9, 0.1, 0.1), (0.1, 0.2, 0.9), (0.1, 0.8, 0.2), (0.9, 0.9, 0.1)]
INSTRUCTION = "add a grey square"
SWAPPED = {0: 1, 1: 0, 2: 3, 3: 2}  # another item's reference


def paired_data():
    """(targets [4, H, W, 3], captions, references [4, H, W, 3])."""
    references = torch.tensor(COLOURS)[:, None, None, :].expand(-1, SIZE, SIZE, -1).clone()
    targets = references.clone()
    targets[:, 8:24, 8:24] = 0.5
    return targets, "\n".join(INSTRUCTION for _ in COLOURS), references


def cached(clip, vae, control_encoding="latents", with_references=True, reference_encoding="none"):
    from headroom.nodes import cache as C

    targets, captions, references = paired_data()
    with torch.inference_mode():
        dataset = C.HeadroomDatasetFromImages.execute(targets, captions, SIZE, SIZE, "center", False, 0,
                                                      control_images=references if with_references else None).args[0]
        latents = C.HeadroomCacheLatents.execute(dataset, vae, control_encoding).args[0]
        texts = C.HeadroomCacheText.execute(dataset, clip, None, reference_encoding).args[0]
    return latents, texts


def init(model, latents, texts, name, reference="control latents", rank=16, lr=1e-2, targets="all_layers",
         schedule="cosine", steps=300, timestep_sampling="uniform", caption_dropout=0.0, **extra):
    from headroom.nodes import train_lora as T

    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute("lora", rank, float(rank), targets, False, 0.0, 0).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", lr, 0.0, schedule, 0, steps).args[0]
        return T.HeadroomTrainLoraInit.execute(
            model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt,
            run_name=name, seed=0, batch_size=4, grad_accumulation=1, precision="fp32", max_grad_norm=1.0,
            caption_dropout=caption_dropout, timestep_sampling=timestep_sampling, loss_weighting="none", min_snr_gamma=5.0,
            noise_offset=0.0, gradient_checkpointing=False, checkpoint_depth=1, holdout=0, reference=reference,
            **extra).args[0]


def tiny(family):
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    with torch.inference_mode():
        return build_tiny_models(family, 0)


def validation_latents(run) -> torch.Tensor:
    """The latents the run's last validation sampled (saved next to its grid)."""
    import safetensors.torch

    path = run.run_dir.validation_dir / f"step_{run.step:08d}_latents.safetensors"
    return safetensors.torch.load_file(str(path))["samples"]


def high_noise_error(run, reference_of, sigma=0.9) -> float:
    """Mean squared error of the trained model's x0 estimate of every item at a high noise level (where the noisy
    latent shows little of the target, so the estimate rests on the conditioning), each item given item
    `reference_of[i]`'s cached reference. Fixed noise."""
    from headroom.nodes.bridge.comfy_model import REFERENCE_LATENTS

    trainer, cache = run.trainer, run.latent_cache
    items = list(run.train_items)
    with torch.inference_mode(), run.validating():
        x0 = trainer._latents(items)
        noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0)).to(x0)
        sigmas = torch.full((len(items),), sigma, device=x0.device)
        conds = [{**run.text_cache.conditioning(cache.text_key(i)),
                  REFERENCE_LATENTS: [cache.control(reference_of[i]).float()]} for i in items]
        x0_hat = run.denoiser.predict(trainer.objective.noisy(x0, noise, sigmas), sigmas, conds)
        return (x0_hat.float() - x0.float()).pow(2).mean().item()


# Flux.2's tiny model: its latents (std ~0.5) carry enough of the loss to learn the reference in 300 CPU steps. The
# tiny Flux's random VAE gives latents of std ~0.17 against unit noise: there the conditioning's share of the loss is
# too small to learn it in 300 steps (measured: x0 error 0.086 with the own reference vs 0.092 with another's), so
# the tiny Flux (Kontext) is checked by the stock round trip below, which takes the same reference path.
@pytest.mark.parametrize("family", ["flux2"])
def test_learns_to_use_the_reference(comfyui, family):
    """The loss with references halves within 300 steps, and after 300 steps the model's estimate at high noise is
    better with each item's own reference than with another item's (measured +14%; untrained: equal within 0.01%).
    300 CPU steps teach the random tiny model only part of the reference: more steps widen the gap."""
    from headroom.nodes import train_lora as T

    model, clip, vae = tiny(family)
    latents, texts = cached(clip, vae)
    # Shifted (Flux's) noise levels: more of the steps at high noise, where the estimate rests on the conditioning.
    run = init(model, latents, texts, f"edit_overfit_{family}", rank=32, lr=3e-3, schedule="constant",
               timestep_sampling="shifted")
    own_before = high_noise_error(run, {i: i for i in run.train_items})
    wrong_before = high_noise_error(run, SWAPPED)
    halved_at = None
    with torch.inference_mode():
        initial = run.loss_on(run.train_items)
        for target in (150, 200, 250, 300):
            T.HeadroomTrainSteps.execute(run, target)
            if halved_at is None:
                final = run.loss_on(run.train_items)
                halved_at = target if final <= 0.5 * initial else None
    own = high_noise_error(run, {i: i for i in run.train_items})
    wrong = high_noise_error(run, SWAPPED)
    print(f"{family}: loss {initial:.4f} -> {final:.4f} (halved at step {halved_at}); x0 error at sigma 0.9 after "
          f"{run.step} steps with the own reference {own:.4f}, with another item's {wrong:.4f} "
          f"(+{wrong / own - 1:.0%}; before training {own_before:.4f} / {wrong_before:.4f})")
    assert halved_at is not None
    assert abs(wrong_before / own_before - 1) < 0.01  # untrained: the reference tells nothing
    assert wrong >= 1.1 * own, "the trained LoRA does not use the reference"


# flux: Flux.1 Kontext's path (model_base.Flux); flux2: Flux.2 reference images; qwen_image: Qwen-Image-Edit's latent
# path (model_base.QwenImage; 5-D Wan latents).
@pytest.mark.parametrize("family", ["flux", "flux2", "qwen_image"])
def test_stock_edit_path_reproduces_validation(comfyui, family, caplog):
    import comfy.model_management
    import nodes
    from comfy_extras.nodes_edit_model import ReferenceLatent
    from family_checks import empty_latent
    from headroom.nodes import train_lora as T

    model, clip, vae = tiny(family)
    latents, texts = cached(clip, vae)
    run = init(model, latents, texts, f"edit_roundtrip_{family}", rank=8, lr=2e-2, targets="preset",
               schedule="constant", steps=1000)
    prompt, reference = INSTRUCTION, paired_data()[2][:1]
    seed, steps, cfg, sampler, scheduler = 7, 4, 3.0, "euler", "simple"
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 20)
        images = T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=prompt, negative="", sample_seed=seed,
                                            sample_steps=steps, cfg=cfg, sampler_name=sampler, scheduler=scheduler,
                                            width=SIZE, height=SIZE, loss_timesteps=1,
                                            reference_images=reference).args[0]
        sampled = validation_latents(run)
        T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=prompt, negative="", sample_seed=seed,
                                   sample_steps=steps, cfg=cfg, sampler_name=sampler, scheduler=scheduler, width=SIZE,
                                   height=SIZE, loss_timesteps=1)
        unreferenced = validation_latents(run)
        name = T.HeadroomSaveLora.execute(run, "headroom/edit", "", "fp32").args[0]

    caplog.clear()
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        lora_model, _ = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)
        reference_latent = nodes.VAEEncode().encode(vae, reference)[0]
        positive = ReferenceLatent.execute(nodes.CLIPTextEncode().encode(clip, prompt)[0], reference_latent).args[0]
        negative = ReferenceLatent.execute(nodes.CLIPTextEncode().encode(clip, "")[0], reference_latent).args[0]
        stock_latent = nodes.common_ksampler(lora_model, seed, steps, cfg, sampler, scheduler, positive, negative,
                                             empty_latent(model, SIZE, SIZE))[0]
        stock = nodes.VAEDecode().decode(vae, stock_latent)[0]
    assert "lora key not loaded" not in caplog.text, caplog.text
    assert len(lora_model.patches) == len(run.adapters.layers)
    difference = (images - stock).abs().max().item()
    spread = stock_latent["samples"].std().item()
    latent_difference = (sampled - stock_latent["samples"]).abs().max().item() / spread
    without = (unreferenced - stock_latent["samples"]).abs().max().item() / spread
    print(f"{family}: validation with a reference vs LoraLoader + VAEEncode + ReferenceLatent + KSampler: max abs diff "
          f"{difference:.2e} (image), {latent_difference:.2e} (latents / their std); {len(run.adapters.layers)} "
          f"layers; validated without the reference the latents differ by {without:.2e}")
    assert difference <= 1e-3 and latent_difference <= 1e-3
    # The random tiny models attend little to 4 reference tokens: a small change, but far above the match's.
    assert without > max(1e-5, 10 * latent_difference), "the reference should change the sample"
    comfy.model_management.unload_all_models()


def test_qwen_image_edit_text_path_is_cached_per_item_and_reproduced_by_the_stock_edit_chain(comfyui, caplog):
    """Qwen-Image-Edit: Cache Text with reference_encoding=TextEncodeQwenImageEdit encodes each caption with its item's
    reference image (vision tokens in the prompt) exactly as that stock node does, one entry per item (the four items
    share one instruction); training passes those and the reference latents; validation with a reference image
    encodes both prompts with the same node, so LoraLoader + TextEncodeQwenImageEdit (with the VAE) + KSampler
    reproduce it. (The node resizes the reference to 1 Mpixel: each of its VAE encodes takes ~20 s here.)"""
    import comfy.model_management
    import nodes
    from comfy_extras.nodes_qwen import TextEncodeQwenImageEdit
    from family_checks import empty_latent
    from headroom.nodes import train_lora as T
    from headroom.training.data.cache_store import item_conditioning

    model, clip, vae = tiny("qwen_image")
    latents, texts = cached(clip, vae, reference_encoding="TextEncodeQwenImageEdit")
    references = paired_data()[2]
    assert texts.per_reference and len(texts) == 1 + len(COLOURS)  # the empty prompt + one entry per item
    with torch.inference_mode():
        for i in range(len(latents)):
            stock = TextEncodeQwenImageEdit.execute(clip, INSTRUCTION, None, references[i:i + 1]).args[0][0][0]
            assert torch.equal(item_conditioning(texts, latents, i)["cross_attn"], stock[0])
    plain = cached(clip, vae)[1].conditioning(latents.text_key(0))["cross_attn"]
    assert item_conditioning(texts, latents, 0)["cross_attn"].shape[0] > plain.shape[0] + 1  # the vision tokens

    run = init(model, latents, texts, "edit_qwen_text", rank=8, lr=2e-2, targets="preset", schedule="constant",
               steps=1000)
    seed, steps, cfg, sampler, scheduler = 7, 2, 3.0, "euler", "simple"
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 10)
        T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=INSTRUCTION, negative="", sample_seed=seed,
                                   sample_steps=steps, cfg=cfg, sampler_name=sampler, scheduler=scheduler, width=SIZE,
                                   height=SIZE, loss_timesteps=1, reference_images=references[:1])
        sampled = validation_latents(run)
        name = T.HeadroomSaveLora.execute(run, "headroom/edit", "", "fp32").args[0]

    caplog.clear()
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        lora_model, _ = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)
        positive = TextEncodeQwenImageEdit.execute(clip, INSTRUCTION, vae, references[:1]).args[0]
        negative = TextEncodeQwenImageEdit.execute(clip, "", vae, references[:1]).args[0]
        stock_latent = nodes.common_ksampler(lora_model, seed, steps, cfg, sampler, scheduler, positive, negative,
                                             empty_latent(model, SIZE, SIZE))[0]["samples"]
    assert "lora key not loaded" not in caplog.text, caplog.text
    difference = (sampled - stock_latent).abs().max().item() / stock_latent.std().item()
    print(f"qwen_image edit text path: validation vs LoraLoader + TextEncodeQwenImageEdit + KSampler: max abs diff "
          f"{difference:.2e} of the latents' std; {len(run.adapters.layers)} layers")
    assert difference <= 1e-3
    comfy.model_management.unload_all_models()


def test_bad_inputs_fail_clearly(comfyui):
    from headroom.nodes import train_lora as T

    model, clip, vae = tiny("flux")
    latents, texts = cached(clip, vae)
    with pytest.raises(ValueError, match=r"Train LoRA: Init \(Headroom\): reference='control latents': the LATENT_CACHE has "
                                         r"no control images.*control_encoding 'latents'"):
        init(model, *cached(clip, vae, with_references=False), "edit_bad_none")
    with pytest.raises(ValueError, match=r"Train LoRA: Init \(Headroom\): reference='control latents': .*control images as "
                                         r"pixels.*control_encoding to 'latents'"):
        init(model, *cached(clip, vae, control_encoding="pixels"), "edit_bad_pixels")
    with pytest.raises(ValueError, match=r"Train LoRA: Init \(Headroom\): reference='sideways': choose one of"):
        init(model, latents, texts, "edit_bad_value", reference="sideways")
    with pytest.raises(ValueError, match=r"Train LoRA: Init \(Headroom\): reference='control latents' with prior images"):
        init(model, latents, texts, "edit_bad_prior", prior_latent_cache=latents, prior_text_cache=texts)
    # A model whose extra_conds ignores reference_latents (SD1.5), asked of the model, not of a family list.
    sd15, sd15_clip, sd15_vae = tiny("sd15")
    with pytest.raises(ValueError, match=r"reference='control latents': this MODEL \(BaseModel\) takes no reference "
                                         r"latents.*set reference to 'none'"):
        init(sd15, *cached(sd15_clip, sd15_vae), "edit_bad_model")
    # Captions encoded with reference images need a control image per item.
    with pytest.raises(ValueError, match=r"Cache Text \(Headroom\): reference_encoding=TextEncodeQwenImageEdit encodes each "
                                         r"caption with its item's control image, but the dataset has none"):
        cached(clip, vae, with_references=False, reference_encoding="TextEncodeQwenImageEdit")
    # The reference is part of the run: resuming with another setting is refused, as for other settings.
    run = init(model, latents, texts, "edit_resume", steps=10)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 1)
    with pytest.raises(ValueError, match=r"session.reference: stored 'control latents', now 'none'"):
        init(model, latents, texts, "edit_resume", reference="none", steps=10)
    # Validation: reference images that fit neither one-for-all nor one-per-prompt.
    with pytest.raises(ValueError, match=r"Validate LoRA \(Headroom\): reference_images holds 3 image batch for 2 prompt"):
        with torch.inference_mode():
            T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=f"{INSTRUCTION}\n{INSTRUCTION}", negative="",
                                       sample_seed=0, sample_steps=1, cfg=1.0, sampler_name="euler",
                                       scheduler="simple", width=SIZE, height=SIZE, loss_timesteps=1,
                                       reference_images=paired_data()[2][:3])


def test_caption_dropout_keeps_the_reference(comfyui):
    """An item whose prompt is dropped still carries its own reference (as a ControlNet run keeps its control)."""
    from headroom.nodes.bridge.comfy_model import REFERENCE_LATENTS

    model, clip, vae = tiny("flux")
    latents, texts = cached(clip, vae)
    run = init(model, latents, texts, "edit_dropout", caption_dropout=1.0, steps=10)
    conds = run.trainer._conds([2, 3], dropout=torch.tensor([True, False]))
    assert torch.equal(conds[0]["cross_attn"], texts.empty_conditioning()["cross_attn"])
    assert not torch.equal(conds[1]["cross_attn"], texts.empty_conditioning()["cross_attn"])
    for cond, item in zip(conds, (2, 3)):
        assert len(cond[REFERENCE_LATENTS]) == 1
        assert torch.equal(cond[REFERENCE_LATENTS][0], latents.control(item).float())


def test_all_in_one_node_trains_with_references_and_validates_with_reference_images(comfyui):
    """HeadroomTrainLora: `reference` opens the run with references, `reference_images` reach its validation (the
    same samples as Validate gives with them)."""
    from headroom.nodes import train_lora as T

    model, clip, vae = tiny("flux")
    latents, texts = cached(clip, vae)
    reference = paired_data()[2][:1]
    settings = dict(clip=clip, vae=vae, prompts=INSTRUCTION, negative="", sample_seed=3, sample_steps=2, cfg=2.0,
                    sampler_name="euler", scheduler="simple", width=SIZE, height=SIZE, loss_timesteps=1)
    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute("lora", 4, 4.0, "preset", False, 0.0, 0).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", 1e-2, 0.0, "constant", 0, 100).args[0]
        output = T.HeadroomTrainLora.execute(
            model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt,
            run_name="edit_all_in_one", seed=0, batch_size=2, grad_accumulation=1, precision="fp32",
            max_grad_norm=1.0, caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none",
            min_snr_gamma=5.0, noise_offset=0.0, gradient_checkpointing=False, checkpoint_depth=1, holdout=0, steps=3,
            validate_every=0, save_every=0, lora_subfolder="headroom", reference="control latents",
            reference_images=reference, **settings)
        run = output.args[1]
        sampled = validation_latents(run)
        T.HeadroomValidate.execute(run, reference_images=reference, **settings)
    assert run.config.reference == "control latents" and run.trainer.item_extras is not None
    assert torch.equal(sampled, validation_latents(run))
