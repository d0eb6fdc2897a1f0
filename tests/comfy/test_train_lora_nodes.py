"""LoRA training nodes on real ComfyUI objects (tiny sd15 / sd3 / flux models, in-process, CPU)."""
from __future__ import annotations

import math
import pathlib
import threading

import pytest
import torch

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]

FAMILIES = ["sd15", "sd3", "flux", "zimage", "qwen_image"]
# Settings that overfit 4 images quickly on the tiny random models. The random frozen embedders and output
# layers of the tiny DiTs are not the near-identity paths of trained models, so those train every layer.
OVERFIT = {
    "sd15": dict(targets="preset", include_conv=True),
    "sd3": dict(targets="all_layers", include_conv=False),
    "flux": dict(targets="all_layers", include_conv=False),
    "zimage": dict(targets="all_layers", include_conv=False),
    "qwen_image": dict(targets="all_layers", include_conv=False),
}


def _base_weights(model):
    return {k: v.detach().clone() for k, v in model.model.diffusion_model.state_dict().items()}


def _data(family, count=4, resolution=32, seed=0):
    """(model, clip, vae, latent_cache, text_cache) through the real dataset and caching nodes."""
    from headroom.nodes import cache as cache_nodes, data as data_nodes
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    with torch.inference_mode():  # as ComfyUI runs nodes
        model, clip, vae = build_tiny_models(family, 0)
        images, captions, _ = data_nodes.HeadroomSyntheticDataset.execute(count, resolution, seed).args
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, captions, resolution, resolution, "center",
                                                                False, 0).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
    return model, clip, vae, latents, texts


def _init(model, latents, texts, run_name, kind="lora", rank=8, targets="preset", include_conv=False, lr=1e-2,
          optimizer="AdamW", schedule="constant", schedule_steps=1000, dropout=0.0, full_precision="fp32",
          loraplus_lr_ratio=1.0, layers="", scale_weight_norms=0.0, layer_lr_scales="", layer_ranks="", layer_alphas="",
          **train):
    from headroom.nodes import train_lora as T

    settings = dict(seed=0, batch_size=4, grad_accumulation=1, precision="fp32", max_grad_norm=1.0, caption_dropout=0.0,
                    timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0, noise_offset=0.0,
                    gradient_checkpointing=False, checkpoint_depth=1, holdout=0)
    settings.update(train)
    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute(kind, rank, float(rank), targets, include_conv, dropout, 0,
                                            full_precision=full_precision, layers=layers,
                                            layer_lr_scales=layer_lr_scales, layer_ranks=layer_ranks,
                                            layer_alphas=layer_alphas).args[0]
        opt = T.HeadroomOptimizerConfig.execute(optimizer, lr, 0.0, schedule, 0, schedule_steps,
                                                loraplus_lr_ratio=loraplus_lr_ratio,
                                                scale_weight_norms=scale_weight_norms).args[0]
        return T.HeadroomTrainLoraInit.execute(model=model, latent_cache=latents, text_cache=texts, lora_config=lora,
                                               optimizer_config=opt, run_name=run_name, **settings).args[0]


def _no_adapter_attached(model):
    from headroom.training.core.adapters import adapter_layer_types

    return not any(isinstance(m, adapter_layer_types()) for m in model.model.diffusion_model.modules())


@pytest.mark.parametrize("family", FAMILIES)
def test_overfit_four_images(comfyui, family):
    """4 training images + 1 held out: the loss on the training items halves within 300 steps, and the
    deterministic validation loss (HeadroomValidate, on the held-out item) falls too."""
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data(family, count=5)
    base = _base_weights(model)
    run = _init(model, latents, texts, f"overfit_{family}", rank=16, schedule="cosine", schedule_steps=300, holdout=1,
                **OVERFIT[family])
    assert run.train_items == [0, 1, 2, 3] and run.validation_items == [4]

    def validate():
        return T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts="", negative="", sample_seed=0,
                                          sample_steps=1, cfg=1.0, sampler_name="euler", scheduler="normal", width=32,
                                          height=32, loss_timesteps=4).args[1]

    with torch.inference_mode():
        initial_train, initial_validation = run.loss_on(run.train_items), validate()
        for target in range(100, 301, 50):  # stop as soon as the loss on the training items has halved
            T.HeadroomTrainSteps.execute(run, target)
            final_train = run.loss_on(run.train_items)
            if final_train <= 0.5 * initial_train:
                break
        final_validation = validate()
    print(f"{family}: {run.step} steps; loss on the training items {initial_train:.4f} -> {final_train:.4f} "
          f"({1 - final_train / initial_train:.0%} lower); validation loss (held out) {initial_validation:.4f} -> "
          f"{final_validation:.4f} ({1 - final_validation / initial_validation:.0%} lower)")
    assert run.step <= 300
    assert final_train <= 0.5 * initial_train
    assert final_validation < initial_validation
    assert [step for step, _ in run.trainer.validation_history] == [0, run.step]
    after = _base_weights(model)
    assert all(torch.equal(base[k], after[k]) for k in base), "the shared MODEL's weights changed"
    assert _no_adapter_attached(model)


def test_resume_after_restart_equals_straight_run(comfyui):
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, clip, vae, latents, texts = _data("sd15")
    common = dict(rank=4, lr=5e-3, caption_dropout=0.25, timestep_sampling="logit_normal", noise_offset=0.05,
                  grad_accumulation=2, batch_size=2, schedule="cosine", schedule_steps=20)
    straight = _init(model, latents, texts, "straight", **common)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(straight, 20)

    first = _init(model, latents, texts, "resumed", **common)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(first, 10)
        T.HeadroomTrainSteps.execute(first, 10)  # same N again: no work
    assert first.step == 10 and len(first.trainer.loss_history) == 10
    # "Restart": new MODEL object, new caches objects, a new Init with the same run name resumes from disk.
    del first
    torch.manual_seed(999)
    restarted_model, _, _ = build_tiny_models("sd15", 0)
    _, _, _, latents2, texts2 = _data("sd15")
    second = _init(restarted_model, latents2, texts2, "resumed", **common)
    assert second.step == 10 and second.resumed
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(second, 20)
    a, b = straight.adapters.state_dict(), second.adapters.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the straight run"
    assert second.trainer.loss_history == straight.trainer.loss_history


def test_saved_lora_reproduces_validation_image_through_stock_nodes(comfyui):
    import folder_paths
    import nodes
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    base = _base_weights(model)
    run = _init(model, latents, texts, "roundtrip", rank=8, lr=2e-2, include_conv=True)
    prompt = "a red circle at the center"
    sampling = dict(sample_seed=7, sample_steps=4, cfg=3.0, sampler_name="dpmpp_2m", scheduler="karras", width=32,
                    height=32)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 30)
        validation = T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=prompt, negative="",
                                                loss_timesteps=2, **sampling)
        images = validation.args[0]
        assert validation.ui is not None
        name = T.HeadroomSaveLora.execute(run, "headroom/tests", "", "fp32").args[0]
    assert name == "headroom/tests/roundtrip_step000030.safetensors"
    assert name in folder_paths.get_filename_list("loras")  # listed without a restart
    assert (run.run_dir.validation_dir / "step_00000030.png").is_file()

    with torch.inference_mode():
        lora_model, _ = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)
        positive = nodes.CLIPTextEncode().encode(clip, prompt)[0]
        negative = nodes.CLIPTextEncode().encode(clip, "")[0]
        empty = nodes.EmptyLatentImage().generate(32, 32, 1)[0]
        samples = nodes.common_ksampler(lora_model, 7, 4, 3.0, "dpmpp_2m", "karras", positive, negative, empty)[0]
        stock = nodes.VAEDecode().decode(vae, samples)[0]
        plain = nodes.VAEDecode().decode(vae, nodes.common_ksampler(model, 7, 4, 3.0, "dpmpp_2m", "karras", positive,
                                                                    negative, empty)[0])[0]
        applied_model = T.HeadroomApplyTrainedLora.execute(model, run, 1.0).args[0]
        applied = nodes.VAEDecode().decode(vae, nodes.common_ksampler(applied_model, 7, 4, 3.0, "dpmpp_2m", "karras",
                                                                      positive, negative, empty)[0])[0]
    difference = (images - stock).abs().max().item()
    print(f"validation image vs LoraLoader+KSampler: max abs diff {difference:.2e}")
    assert difference <= 1e-3
    assert (applied - stock).abs().max().item() <= 1e-3
    assert (plain - stock).abs().max().item() > 1e-2, "the LoRA should change the image"
    import comfy.model_management

    comfy.model_management.unload_all_models()  # a loaded LoraLoader clone holds patched weights until unloaded
    after = _base_weights(model)
    assert all(torch.equal(base[k], after[k]) for k in base)


def test_cancel_saves_last_finished_step_and_frees_the_model(comfyui):
    import comfy.model_management as mm
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.model_files import runs_root
    from headroom.training.core.run_dir import RunDir

    model, clip, vae, latents, texts = _data("sd15")
    base = _base_weights(model)
    run = _init(model, latents, texts, "cancelled", rank=4)

    def interrupt_at_step_3():
        while run.step < 3:
            threading.Event().wait(0.01)
        mm.interrupt_current_processing(True)

    watcher = threading.Thread(target=interrupt_at_step_3)
    watcher.start()
    try:
        with torch.inference_mode(), pytest.raises(mm.InterruptProcessingException):
            T.HeadroomTrainSteps.execute(run, 500)
    finally:
        watcher.join()
        mm.interrupt_current_processing(False)
    assert 3 <= run.step < 500
    directory = RunDir(runs_root(), "cancelled")
    assert directory.latest_step() == run.step
    checkpoint = directory.load_checkpoint()
    assert all(torch.equal(checkpoint.adapter[k], v) for k, v in run.adapters.state_dict().items())
    assert not any(m.model is run.patcher.model for m in mm.current_loaded_models), "training model still loaded"
    assert _no_adapter_attached(model)
    after = _base_weights(model)
    assert all(torch.equal(base[k], after[k]) for k in base)


def test_bad_inputs_fail_before_training_with_clear_errors(comfyui):
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    sd3_model, _, _, sd3_latents, sd3_texts = _data("sd3")
    with pytest.raises(ValueError, match="16-channel latents but this model denoises 4-channel"):
        _init(model, sd3_latents, sd3_texts, "wrong_cache")
    with pytest.raises(ValueError, match=r"TEXT_CACHE 'cross_attn' is 32 wide but this model expects 4096"):
        _init(sd3_model, sd3_latents, texts, "wrong_text")
    with pytest.raises(ValueError, match=r"LoRA Config \(Headroom\): rank=0 must be a positive integer"):
        T.HeadroomLoraConfig.execute("lora", 0, 1.0, "preset", False, 0.0, 0)
    with pytest.raises(ValueError, match=r"^Optimizer Config \(Headroom\): learning_rate 0 trains nothing"):
        T.HeadroomOptimizerConfig.execute("AdamW", 0.0, 0.0, "constant", 0, 10)
    with pytest.raises(ValueError, match="unknown optimizer 'SGD'"):
        T.HeadroomOptimizerConfig.execute("SGD", 1e-3, 0.0, "constant", 0, 10)
    for bad_name in ("../escape", "/abs", "a/b", "..", ""):
        with pytest.raises(ValueError, match="run name"):
            _init(model, latents, texts, bad_name)
    with pytest.raises(ValueError, match="loss_weighting='min_snr' is defined for eps / v"):
        _init(sd3_model, sd3_latents, sd3_texts, "flow_min_snr", loss_weighting="min_snr")

    _init(model, latents, texts, "existing", rank=4)
    with pytest.raises(ValueError, match=r"run 'existing' already exists .*adapter.rank: stored 4, now 8"):
        _init(model, latents, texts, "existing", rank=8)

    run = _init(model, latents, texts, "save_checks", rank=4)
    for bad_subfolder in ("../../escape", "/etc", "a/../b"):
        with pytest.raises(ValueError, match="subfolder"):
            T.HeadroomSaveLora.execute(run, bad_subfolder, "", "fp32")
    assert _no_adapter_attached(model)


def test_loraplus_ratio_is_part_of_the_run_and_refused_where_it_cannot_apply(comfyui):
    """Optimizer Config loraplus_lr_ratio reaches the run (the up matrices' optimizer group at 4x, the chart's rate
    the 1x one) and its config.json: resuming with another ratio is refused like any other setting. Kinds without up
    matrices and Prodigy are refused by the nodes, by name."""
    from headroom.nodes import train_lora as T

    model, _, _, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "loraplus", rank=4, lr=1e-3, loraplus_lr_ratio=4.0)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 1)
    assert [group["lr"] for group in run.trainer.optimizer.param_groups] == [1e-3, 4e-3]
    ups = {id(p) for layer in run.adapters.layers.values() for name, p in layer.named_parameters()
           if name.startswith("lora_B")}
    assert ups and {id(p) for p in run.trainer.optimizer.param_groups[1]["params"]} == ups
    assert run.config.optimizer.loraplus_lr_ratio == 4.0
    with pytest.raises(ValueError, match=r"optimizer.loraplus_lr_ratio: stored 4.0, now 1.0"):
        _init(model, latents, texts, "loraplus", rank=4, lr=1e-3)
    with pytest.raises(ValueError, match=r"kind loha has none"):
        _init(model, latents, texts, "loraplus_loha", kind="loha", rank=4, loraplus_lr_ratio=4.0)
    with pytest.raises(ValueError, match=r"^Optimizer Config \(Headroom\): Prodigy finds one step size"):
        T.HeadroomOptimizerConfig.execute("Prodigy", 1.0, 0.0, "constant", 0, 10, loraplus_lr_ratio=4.0)
    assert _no_adapter_attached(model)


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_layers_trains_and_saves_only_the_chosen_layers(comfyui, kind, caplog):
    """LoRA Config layers on Flux: the run trains the targets the patterns keep, the saved file holds those and
    stock Load LoRA applies every key of it; the filter is part of the run (another one does not resume it); the
    Memory Plan node plans the smaller set; a name of diffusers' scheme is refused naming ComfyUI's."""
    import json

    import comfy.utils
    import folder_paths
    import nodes
    from headroom.nodes import train_lora as T
    from headroom.nodes.memory import HeadroomMemoryPlan

    model, clip, _, latents, texts = _data("flux")
    layers = "single_blocks !linear2" if kind == "lora" else "double_blocks.0.img_attn"
    run = _init(model, latents, texts, f"layers_{kind}", kind=kind, rank=4, lr=1e-3, layers=layers)
    trained = sorted(run.adapters.layers)
    if kind == "lora":  # every single block's linear1, no linear2, nothing of the double blocks
        blocks = len(model.model.diffusion_model.single_blocks)
        assert trained == sorted(f"single_blocks.{i}.linear1" for i in range(blocks))
    else:
        assert trained == ["double_blocks.0.img_attn.proj", "double_blocks.0.img_attn.qkv"]
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 2)
        name = T.HeadroomSaveLora.execute(run, "headroom", "", "fp32").args[0]
        lora_model = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)[0]
    saved = comfy.utils.load_torch_file(folder_paths.get_full_path("loras", name), safe_load=True)
    assert {key.rsplit(".", 2 if ".lora_" in key else 1)[0].removeprefix("diffusion_model.") for key in saved} == set(
        trained)
    assert "lora key not loaded" not in caplog.text
    assert sorted(k.removeprefix("diffusion_model.").rsplit(".", 1)[0] for k in lora_model.patches
                  if k.endswith(".weight")) == trained
    with pytest.raises(ValueError, match=r"adapter.layers: stored '.+', now ''"):
        _init(model, latents, texts, f"layers_{kind}", kind=kind, rank=4, lr=1e-3)
    with pytest.raises(ValueError, match=r"LoRA Config layers: 'transformer_blocks' matches none of the \d+ layers "
                                         r"targets=preset selects \(named like double_blocks.0.img_attn.qkv, "):
        _init(model, latents, texts, "layers_diffusers", rank=4, layers="transformer_blocks")
    assert _no_adapter_attached(model)
    plan_inputs = dict(mode="estimate", batch_size=1, width=64, height=64, rank=4, targets="preset",
                       optimizer="AdamW", precision="fp32", text_tokens=0)

    def trainable(**layers):
        plan = json.loads(HeadroomMemoryPlan.execute(model, **plan_inputs, **layers).result[1])
        return next(p for p in plan["phases"] if p["phase"] == "training step")["items"]["trainable weights (fp32)"]

    some = trainable(layers="single_blocks !linear2")
    assert 0 < some < trainable() == trainable(layers="")
    with pytest.raises(ValueError, match=r"^Memory Plan \(Headroom\): .*'!norm' matches none"):
        trainable(layers="!norm")


def test_layer_ranks_and_alphas_train_and_save_each_layers_rank_and_alpha(comfyui, caplog):
    """LoRA Config layer_ranks and layer_alphas on Flux: each layer trains at the rank and alpha of the first pattern
    matching it (rank / alpha where none), the saved file (ComfyUI and kohya names) holds each at that rank with its
    alpha, stock Load LoRA applies every key and its patched weights are the run's (alpha / rank as trained); the ranks
    and alphas are part of the run; the Memory Plan node counts the trainable weights at those ranks."""
    import json

    import comfy.lora
    import comfy.utils
    import folder_paths
    import nodes
    from headroom.nodes import train_lora as T
    from headroom.nodes.memory import HeadroomMemoryPlan

    model, clip, _, latents, texts = _data("flux")
    ranks = "single_blocks=2 img_attn=8"
    alphas = "single_blocks=1 txt_mlp=0.5"
    run = _init(model, latents, texts, "layer_ranks", rank=4, lr=1e-3, layer_ranks=ranks, layer_alphas=alphas)
    expected = {path: 2 if path.startswith("single_blocks.") else 8 if ".img_attn." in path else 4
                for path in run.adapters.layers}
    expected_alphas = {path: 1.0 if path.startswith("single_blocks.") else 0.5 if ".txt_mlp." in path else 4.0
                       for path in run.adapters.layers}
    assert {path: layer.r["default"] for path, layer in run.adapters.layers.items()} == expected
    assert {path: layer.lora_alpha["default"] for path, layer in run.adapters.layers.items()} == expected_alphas
    assert set(expected.values()) == {2, 4, 8} and set(expected_alphas.values()) == {0.5, 1.0, 4.0}
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 2)
        names = [T.HeadroomSaveLora.execute(run, f"ranks_{f}", "", "fp32", format=f).args[0] for f in ("comfyui", "kohya")]
        for name in names:
            caplog.clear()
            lora_model = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)[0]
            assert "lora key not loaded" not in caplog.text
            assert len([k for k in lora_model.patches if k.endswith(".weight")]) == len(expected)
            for path, layer in run.adapters.layers.items():  # the weight stock Load LoRA patches in: the run's
                key, base = f"diffusion_model.{path}.weight", layer.get_base_layer().weight.float()
                merged = comfy.lora.calculate_weight(lora_model.patches[key], base.clone(), key)
                delta = layer.scaling["default"] * (layer.lora_B["default"].weight @ layer.lora_A["default"].weight)
                torch.testing.assert_close(merged - base, delta, rtol=1e-4, atol=1e-6)
    saved = comfy.utils.load_torch_file(folder_paths.get_full_path("loras", names[0]), safe_load=True)
    assert {key[len("diffusion_model."):-len(".lora_down.weight")]: int(value.shape[0]) for key, value in saved.items()
            if key.endswith(".lora_down.weight")} == expected
    assert {key[len("diffusion_model."):-len(".alpha")]: float(value) for key, value in saved.items()
            if key.endswith(".alpha")} == expected_alphas
    kohya = comfy.utils.load_torch_file(folder_paths.get_full_path("loras", names[1]), safe_load=True)
    assert sorted(int(v.shape[0]) for k, v in kohya.items() if k.endswith(".lora_down.weight")) == sorted(
        expected.values())
    with pytest.raises(ValueError, match=r"adapter.layer_ranks: stored 'single_blocks=2 img_attn=8', now ''"):
        _init(model, latents, texts, "layer_ranks", rank=4, lr=1e-3, layer_alphas=alphas)
    with pytest.raises(ValueError, match=r"adapter.layer_alphas: stored 'single_blocks=1 txt_mlp=0.5', now ''"):
        _init(model, latents, texts, "layer_ranks", rank=4, lr=1e-3, layer_ranks=ranks)
    with pytest.raises(ValueError, match=r"^LoRA Config \(Headroom\): layer_alphas: 'img_attn=0': the alpha must be"):
        _init(model, latents, texts, "layer_alphas_zero", rank=4, layer_alphas="img_attn=0")
    with pytest.raises(ValueError, match=r"^LoRA Config \(Headroom\): layer_ranks sets a low-rank size per layer, "
                                         r"and kind full has none"):
        _init(model, latents, texts, "layer_ranks_full", kind="full", rank=4, layer_ranks=ranks)
    plan_inputs = dict(mode="estimate", batch_size=1, width=64, height=64, rank=4, targets="preset",
                       optimizer="AdamW", precision="fp32", text_tokens=0)

    def trainable(**inputs):
        plan = json.loads(HeadroomMemoryPlan.execute(model, **plan_inputs, **inputs).result[1])
        return next(p for p in plan["phases"] if p["phase"] == "training step")["items"]["trainable weights (fp32)"]

    assert trainable(layer_ranks=ranks) == 4 * run.adapters.parameter_count() != trainable()
    with pytest.raises(ValueError, match=r"^Memory Plan \(Headroom\): .*layer_ranks: 'attn=0': the rank must be"):
        trainable(layer_ranks="attn=0")
    run.release()
    assert _no_adapter_attached(model)


def test_extra_noise_and_debiased_weighting_are_part_of_the_run(comfyui):
    """Init ip_noise_gamma, multires_noise_iterations / _discount, the random strengths of the noise offset and the
    perturbation and loss_weighting debiased reach the run's objective, change what it trains, are part of its
    config.json (a run resumes only with the same values) and of a kohya-format file's ss_* metadata."""
    from safetensors import safe_open

    import folder_paths
    from headroom.nodes import train_lora as T

    model, _, _, latents, texts = _data("sd15")
    extra = dict(ip_noise_gamma=0.1, multires_noise_iterations=6, multires_noise_discount=0.3, noise_offset=0.05,
                 noise_offset_random_strength=True, ip_noise_gamma_random_strength=True)
    run = _init(model, latents, texts, "perturbed", rank=4, lr=1e-3, loss_weighting="debiased", **extra)
    plain = _init(model, latents, texts, "unperturbed", rank=4, lr=1e-3)
    objective = run.trainer.config.objective
    assert (objective.ip_noise_gamma, objective.multires_noise_iterations, objective.multires_noise_discount,
            objective.loss_weighting) == (0.1, 6, 0.3, "debiased")
    assert objective.noise_offset_random_strength and objective.ip_noise_gamma_random_strength
    with torch.inference_mode():
        losses = [T.HeadroomTrainSteps.execute(r, 1).args[1] for r in (run, plain)]
        name = T.HeadroomSaveLora.execute(run, "headroom", "", "fp32", format="kohya").args[0]
    assert all(math.isfinite(loss) for loss in losses) and losses[0] != losses[1]
    with safe_open(folder_paths.get_full_path_or_raise("loras", name), "pt") as f:
        metadata = f.metadata()
    assert metadata["ss_ip_noise_gamma"] == "0.1" and metadata["ss_debiased_estimation"] == "True"
    assert (metadata["ss_multires_noise_iterations"], metadata["ss_multires_noise_discount"]) == ("6", "0.3")
    assert metadata["ss_ip_noise_gamma_random_strength"] == metadata["ss_noise_offset_random_strength"] == "True"
    with pytest.raises(ValueError, match=r"objective.ip_noise_gamma: stored 0.1, now 0.0"):
        _init(model, latents, texts, "perturbed", rank=4, lr=1e-3, loss_weighting="debiased",
              **{**extra, "ip_noise_gamma": 0.0})
    with pytest.raises(ValueError, match=r"objective.multires_noise_iterations: stored 6, now 0"):
        _init(model, latents, texts, "perturbed", rank=4, lr=1e-3, loss_weighting="debiased",
              **{**extra, "multires_noise_iterations": 0})
    with pytest.raises(ValueError, match=r"objective.ip_noise_gamma_random_strength: stored True, now False"):
        _init(model, latents, texts, "perturbed", rank=4, lr=1e-3, loss_weighting="debiased",
              **{**extra, "ip_noise_gamma_random_strength": False})
    with pytest.raises(ValueError, match=r"^Train LoRA: Init \(Headroom\): .*noise_offset_random_strength draws"):
        _init(model, latents, texts, "offset_random_alone", rank=4, noise_offset_random_strength=True)
    for r in (run, plain):
        r.release()


def test_layer_lr_scales_set_each_layers_rate_and_are_part_of_the_run(comfyui):
    """LoRA Config layer_lr_scales: the cross-attention layers' tensors train in an optimizer group at half the rate,
    the rest at the rate; with LoRA+ the up matrices at its ratio times their layer's; the scales are part of the run;
    Prodigy (one step size for all) is refused, by name."""
    from headroom.nodes import train_lora as T

    model, _, _, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "layer_rates", rank=4, lr=1e-3, layer_lr_scales="attn2=0.5")
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 1)
    groups = run.trainer.optimizer.param_groups
    assert [group["lr"] for group in groups] == [1e-3, 5e-4]
    cross = {id(p) for path, layer in run.adapters.layers.items() if ".attn2." in path
             for name, p in layer.named_parameters() if name.startswith("lora_")}
    assert cross and {id(p) for p in groups[1]["params"]} == cross
    with pytest.raises(ValueError, match=r"adapter.layer_lr_scales: stored 'attn2=0.5', now ''"):
        _init(model, latents, texts, "layer_rates", rank=4, lr=1e-3)
    both = _init(model, latents, texts, "layer_rates_plus", rank=4, lr=1e-3, layer_lr_scales="attn2=0.5",
                 loraplus_lr_ratio=4.0)
    assert sorted(group["lr"] for group in both.trainer.optimizer.param_groups) == pytest.approx(
        [5e-4, 1e-3, 2e-3, 4e-3])
    with pytest.raises(ValueError, match=r"Prodigy finds one step size for all trained weights, and LoRA Config "
                                         r"layer_lr_scales asks for several"):
        _init(model, latents, texts, "layer_rates_prodigy", rank=4, lr=1.0, optimizer="Prodigy",
              layer_lr_scales="attn2=0.5")
    # the chart's rate is the optimizer's even where the first group / tensor is a scaled one (fused backward: one
    # optimizer per tensor, the first the first layer's)
    from headroom.training.core.optimizers import current_lr

    for fused in (False, True):
        first = _init(model, latents, texts, f"layer_rates_first_{fused}", rank=4, lr=1e-3,
                      layer_lr_scales="input_blocks=0.5", policy=_policy(fused_backward=fused))
        assert next(iter(first.adapters.layers)).startswith("input_blocks.")
        with torch.inference_mode():
            T.HeadroomTrainSteps.execute(first, 1)
        assert first.trainer.optimizer.param_groups[0]["lr"] == (5e-4 if fused else 1e-3)
        assert current_lr(first.trainer.optimizer) == pytest.approx(1e-3, rel=1e-12)
        first.release()
    for r in (run, both):
        r.release()
    assert _no_adapter_attached(model)


def test_all_in_one_node_validates_and_saves(comfyui):
    import folder_paths
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd3")
    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute("lora", 4, 4.0, "preset", False, 0.0, 0).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", 1e-3, 0.0, "constant", 0, 100).args[0]
        output = T.HeadroomTrainLora.execute(
            model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt,
            run_name="all_in_one", seed=0, batch_size=2, grad_accumulation=1, precision="bf16", max_grad_norm=1.0,
            caption_dropout=0.1, timestep_sampling="shifted", loss_weighting="none", min_snr_gamma=5.0,
            noise_offset=0.0, gradient_checkpointing=True, checkpoint_depth=1, holdout=1, steps=6, validate_every=3,
            save_every=4, lora_subfolder="headroom", clip=clip, vae=vae, prompts="a blue square", negative="",
            sample_seed=0, sample_steps=2, cfg=1.0, sampler_name="euler", scheduler="simple", width=32, height=32,
            loss_timesteps=2)
    patched, run, lora_name, validation_loss, _ = output.args
    assert run.step == 6 and lora_name == "headroom/all_in_one_step000006.safetensors"
    assert "headroom/all_in_one_step000004.safetensors" in folder_paths.get_filename_list("loras")
    assert [step for step, _ in run.trainer.validation_history] == [3, 6]
    assert sorted(p.name for p in run.run_dir.validation_dir.iterdir()) == [
        "step_00000003.png", "step_00000003_latents.safetensors", "step_00000006.png", "step_00000006_latents.safetensors"]
    assert validation_loss == run.trainer.validation_history[-1][1]
    assert patched is not model and len(patched.patches) > 0

    # The run's memory record: caching, then training / validation / save in the order they ran, kept on disk.
    from headroom.nodes.monitor import HeadroomMemoryReport
    from headroom.training.memory.memory_stats import PhaseRecorder

    phases = [record["phase"] for record in run.memory.phases]
    assert phases == ["caching latents", "caching text", "training", "validation", "training", "save", "training",
                      "validation", "save"]
    assert all(record["completed"] and record["seconds"] > 0 and record["peak_rss_bytes"] > 0
               for record in run.memory.phases)
    on_disk = PhaseRecorder.from_json(run.run_dir.memory_record_path.read_text())
    assert on_disk.phases == run.memory.phases
    # the measured s/step beside the plan's prediction (none here: a CPU run with its own policy makes no plan)
    assert on_disk.step_time["measured_s_per_step"] > 0 and on_disk.step_time["predicted_s_per_step"] is None
    text, record_json, chart = HeadroomMemoryReport.execute(run=run).args
    assert "validation" in text and "caching latents" in text and chart.shape[-1] == 3
    assert "step time: measured" in text
    assert PhaseRecorder.from_json(record_json).phases == run.memory.phases


def test_flux_gradient_checkpointing_gives_the_same_weights(comfyui):
    """Flux blocks add into their inputs in place; checkpointed or not, training must give identical weights."""
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("flux")
    plain = _init(model, latents, texts, "flux_plain", rank=4)
    checkpointed = _init(model, latents, texts, "flux_checkpointed", rank=4, gradient_checkpointing=True)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(plain, 3)
        T.HeadroomTrainSteps.execute(checkpointed, 3)
    a, b = plain.adapters.state_dict(), checkpointed.adapters.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in a.items() if "lora_B" in k)
    with pytest.raises(ValueError, match="update their inputs in place"):
        _init(model, latents, texts, "flux_depth2", rank=4, gradient_checkpointing=True, checkpoint_depth=2)


@pytest.mark.parametrize("kind", ["dora", "loha", "lokr", "oft"])
def test_other_adapter_kinds_round_trip_through_the_stock_loader(comfyui, kind, caplog):
    import nodes
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    run = _init(model, latents, texts, f"kind_{kind}", kind=kind, rank=4, lr=2e-2)
    sampling = dict(sample_seed=3, sample_steps=3, cfg=2.0, sampler_name="euler", scheduler="normal", width=32,
                    height=32)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 5)
        images = T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts="a green cross", negative="",
                                            loss_timesteps=1, **sampling).args[0]
        name = T.HeadroomSaveLora.execute(run, "headroom", "", "fp32").args[0]
        lora_model, _ = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)
        positive = nodes.CLIPTextEncode().encode(clip, "a green cross")[0]
        negative = nodes.CLIPTextEncode().encode(clip, "")[0]
        empty = nodes.EmptyLatentImage().generate(32, 32, 1)[0]
        stock = nodes.VAEDecode().decode(vae, nodes.common_ksampler(lora_model, 3, 3, 2.0, "euler", "normal", positive,
                                                                    negative, empty)[0])[0]
    assert "lora key not loaded" not in caplog.text
    assert len(lora_model.patches) == len(run.adapters.layers)
    assert (images - stock).abs().max().item() <= 1e-3


def test_validating_mid_run_does_not_change_training(comfyui):
    """Sampling reseeds torch's global RNG (comfy.sample.prepare_noise), which peft's dropout draws from."""
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    straight = _init(model, latents, texts, "no_validation", rank=4, dropout=0.2)
    validated = _init(model, latents, texts, "with_validation", rank=4, dropout=0.2)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(straight, 6)
        T.HeadroomTrainSteps.execute(validated, 3)
        T.HeadroomValidate.execute(validated, clip=clip, vae=vae, prompts="a red circle", negative="", sample_seed=5,
                                   sample_steps=2, cfg=1.0, sampler_name="euler_ancestral", scheduler="normal",
                                   width=32, height=32, loss_timesteps=2)
        T.HeadroomTrainSteps.execute(validated, 6)
    a, b = straight.adapters.state_dict(), validated.adapters.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _policy(**fields):
    from headroom.nodes.memory import HeadroomOffloadPolicy

    settings = dict(vram_budget_gb=0.0, reserve_gb=1.0, base_placement="resident", base_storage="as_loaded",
                    checkpointing="off", checkpoint_depth=1, optimizer_state="gpu",
                    park_optimizer_during_validation=True, vae_tiled_decode="auto", encoders="unload_after_use")
    settings.update(fields)
    return HeadroomOffloadPolicy.execute(**settings).args[0]


def test_offload_policy_is_applied_by_the_training_nodes_and_keeps_the_weights(comfyui):
    """A run with streamed blocks, offloaded checkpoints, optimizer state in host RAM and parking during
    validation trains exactly the weights of the plain run (CPU: streaming is a no-op, the rest runs)."""
    from headroom.nodes import train_lora as T
    from headroom.training.memory.optimizer_parking import HostOptimizer

    model, clip, vae, latents, texts = _data("sd15")
    plain = _init(model, latents, texts, "policy_plain", rank=4)
    policy = _policy(base_placement="streamed", checkpointing="blocks_cpu_offload", optimizer_state="cpu")
    offloaded = _init(model, latents, texts, "policy_offloaded", rank=4, policy=policy)
    assert isinstance(offloaded.trainer.optimizer, HostOptimizer) and offloaded.trainer.policy == policy
    settings = dict(clip=clip, vae=vae, prompts="a red circle", negative="", sample_seed=1, sample_steps=2, cfg=2.0,
                    sampler_name="euler", scheduler="normal", width=32, height=32, loss_timesteps=2)
    results = []
    for run in (plain, offloaded):
        T.HeadroomTrainSteps.execute(run, 3)
        images, loss, _ = T.HeadroomValidate.execute(run, **settings).args
        T.HeadroomTrainSteps.execute(run, 4)  # after validation: the parked state came back intact
        results.append((run.adapters.state_dict(), images, loss))
    (a, images_a, loss_a), (b, images_b, loss_b) = results
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(images_a, images_b) and loss_a == loss_b
    assert _no_adapter_attached(model)


def _update_norms(run) -> list[float]:
    """Each trained layer's update scale * up @ down, formed in full, its Frobenius norm (kohya's product; a conv
    layer's 3x3 down and 1x1 up composed by a convolution, as sd-scripts composes them)."""
    norms = []
    for layer in run.adapters.layers.values():
        up, down = layer.lora_B["default"].weight.detach(), layer.lora_A["default"].weight.detach()
        if down.ndim == 4:
            product = torch.nn.functional.conv2d(down.permute(1, 0, 2, 3), up).permute(1, 0, 2, 3)
        else:
            product = up @ down
        norms.append(float((product * layer.scaling["default"]).norm()))
    return norms


def test_scale_weight_norms_caps_each_layers_update_and_the_host_optimizer_follows(comfyui):
    """Optimizer Config scale_weight_norms: after every step no layer's update norm exceeds the cap (those above it
    are at it exactly), Train Steps says how many were scaled; with the optimizer state in host RAM the host copies
    follow the capped weights (the run equals the plain one); other kinds and ControlNet runs are refused."""
    from safetensors import safe_open

    import folder_paths
    from headroom.nodes import train_lora as T
    from headroom.training.memory.optimizer_parking import HostOptimizer

    model, _, _, latents, texts = _data("sd15")
    free = _init(model, latents, texts, "norms_free", rank=4, lr=2e-2, include_conv=True)
    T.HeadroomTrainSteps.execute(free, 3)
    cap = sorted(_update_norms(free))[len(free.adapters.layers) // 2]  # half the layers grow past it
    plain = _init(model, latents, texts, "norms_plain", rank=4, lr=2e-2, include_conv=True, scale_weight_norms=cap)
    host = _init(model, latents, texts, "norms_host", rank=4, lr=2e-2, include_conv=True, scale_weight_norms=cap,
                 policy=_policy(optimizer_state="cpu"))
    assert isinstance(host.trainer.optimizer, HostOptimizer)
    texts_shown = [T.HeadroomTrainSteps.execute(run, 3).ui["text"] for run in (plain, host)]
    norms = _update_norms(plain)
    assert max(norms) <= cap * (1 + 1e-5) and sum(abs(n - cap) < cap * 1e-5 for n in norms) >= 2
    scaled = int(plain.trainer.last_norms[0])
    assert scaled >= 2 and texts_shown[0] == texts_shown[1] == [
        f"scale_weight_norms {cap:g}: {scaled} of {len(norms)} layers scaled back at step 3; update norms mean "
        f"{sum(norms) / len(norms):.3g}, largest {max(norms):.3g}"]
    a, b = plain.adapters.state_dict(), host.adapters.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with torch.inference_mode():
        name = T.HeadroomSaveLora.execute(plain, "headroom", "", "fp32", format="kohya").args[0]
    with safe_open(folder_paths.get_full_path_or_raise("loras", name), "pt") as f:
        assert f.metadata()["ss_scale_weight_norms"] == str(cap)
    with pytest.raises(ValueError, match=r"scale_weight_norms 0.5 \(Optimizer Config\) caps the norm of a LoRA's up "
                                         r"@ down product, and this run trains kind loha: set it to 0"):
        _init(model, latents, texts, "norms_loha", kind="loha", rank=4, scale_weight_norms=0.5)
    for run in (free, plain, host):
        run.release()
    assert _no_adapter_attached(model)


def test_the_streamer_pins_within_what_comfyuis_pinned_memory_share_leaves(comfyui, monkeypatch):
    """ComfyUI keeps its pins within MAX_PINNED_MEMORY (40 % of the RAM on Windows, which lets a process lock about
    half; 0 with --disable-pinned-memory): the run's WeightStreamer is given what that share leaves at each training
    load, so it never pins past it (weight_streaming: the rest streams pageable); with --disable-pinned-memory the run
    pins nothing anywhere (pinned_host: staging buffers, offloaded block inputs too)."""
    import comfy.model_management as mm
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.planning import pinnable_host_bytes
    from headroom.training.memory import pinned_host
    from headroom.training.memory import policy as policy_module

    given = []

    class Spy(policy_module.WeightStreamer):
        def __init__(self, *args, **options):
            given.append((options.get("pin_limit_bytes"), pinned_host.allowed()))
            super().__init__(*args, **options)

    monkeypatch.setattr(policy_module, "WeightStreamer", Spy)
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 12 * 2 ** 30, raising=False)
    monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", 5 * 2 ** 30, raising=False)
    assert pinnable_host_bytes() == 7 * 2 ** 30
    model, _, _, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "pin_share", rank=4,
                policy=_policy(base_placement="streamed", checkpointing="blocks"))
    T.HeadroomTrainSteps.execute(run, 1)
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", -1, raising=False)  # ComfyUI pins nothing: neither does the run
    T.HeadroomTrainSteps.execute(run, 2)
    assert given == [(7 * 2 ** 30, True), (0, False)]
    assert pinned_host.allowed()  # the switch as it was after the run's steps
    # The plan, made before the run's training load, counts ComfyUI's pins of the model's block weights as freed
    # (that load unpins them: the streamer pins its own packed buffers); other pins stay counted.
    from headroom.nodes.bridge.comfy_model import comfy_pinned_block_bytes, training_blocks

    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 12 * 2 ** 30, raising=False)
    assert pinnable_host_bytes(2 * 2 ** 30) == 9 * 2 ** 30 and pinnable_host_bytes(10 * 2 ** 30) == 12 * 2 ** 30
    patcher = run.placement.patcher
    name, block = training_blocks(patcher.model.diffusion_model)[0]
    inner, weight = next(iter(block.named_parameters()))
    outside = next(key for key, _ in patcher.model.diffusion_model.named_parameters() if not key.startswith(name))
    monkeypatch.setattr(patcher, "pinned", {f"diffusion_model.{name}.{inner}", f"diffusion_model.{outside}"})
    assert comfy_pinned_block_bytes(patcher) == weight.nbytes > 0
    monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", 20 * 2 ** 30, raising=False)
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 12 * 2 ** 30, raising=False)
    assert pinnable_host_bytes() == 0  # ComfyUI's own pins past its share: nothing left
    monkeypatch.delattr(mm, "MAX_PINNED_MEMORY")
    assert pinnable_host_bytes() is None  # a ComfyUI without the account: no limit of ours


def test_a_run_whose_host_ram_does_not_fit_stops_before_it_opens(comfyui):
    """The policy's host RAM budget is checked when the run opens: over it, the Init node names itself, the host
    RAM in use and added, and what to change, and no run folder is made; within it, the run opens."""
    from headroom.nodes.bridge.model_files import runs_root

    model, _, _, latents, texts = _data("sd15")
    tight = _policy(optimizer_state="cpu", host_ram_budget_gb=0.001)
    with pytest.raises(ValueError, match=r"Train LoRA: Init \(Headroom\): host RAM: [\d.]+ GiB in use \+ [\d.]+ GiB added by "
                       r"the run, limit budget 0.00 GiB - DOES NOT FIT; .* keep the optimizer state on the device"):
        _init(model, latents, texts, "host_tight", rank=4, policy=tight)
    assert not (runs_root() / "host_tight").exists()
    run = _init(model, latents, texts, "host_roomy", rank=4, policy=_policy(optimizer_state="cpu"))
    assert (runs_root() / "host_roomy").is_dir() and not any("host RAM" in note for note in run.notes)
    assert _no_adapter_attached(model)


def test_out_of_memory_in_training_saves_frees_and_names_the_phase(comfyui, monkeypatch):
    import comfy.model_management
    from headroom.nodes import train_lora as T
    from headroom.training.memory.oom import PhaseOutOfMemoryError

    model, clip, vae, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "oom_run", rank=4)
    T.HeadroomTrainSteps.execute(run, 2)
    predict = run.denoiser.predict
    calls = []

    def runs_out_at_the_second_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return predict(*args, **kwargs)

    monkeypatch.setattr(run.denoiser, "predict", runs_out_at_the_second_step)
    with pytest.raises(PhaseOutOfMemoryError, match="Out of memory during training step") as raised:
        T.HeadroomTrainSteps.execute(run, 5)
    assert raised.value.phase == "training step" and "The last completed step is saved" in str(raised.value)
    assert run.run_dir.latest_step() == 3  # the step before the failed one
    assert not any(loaded.model is run.patcher for loaded in comfy.model_management.current_loaded_models)
    assert _no_adapter_attached(model)
    assert run.memory.phases[-1]["phase"] == "training" and not run.memory.phases[-1]["completed"]


@pytest.mark.parametrize("storage", ["fp8", "int8"])
def test_low_bit_base_storage_trains_on_low_bit_layers_and_leaves_the_shared_model_intact(comfyui, storage):
    import comfy.model_management
    from headroom.nodes import train_lora as T
    from headroom.training.memory.lowbit import LowBitLinear

    def low_bit_layers(model):
        return sum(isinstance(m, LowBitLinear) for m in model.model.diffusion_model.modules())

    model, clip, vae, latents, texts = _data("sd15")
    base = _base_weights(model)
    plain = _init(model, latents, texts, f"lowbit_plain_{storage}", rank=4)
    T.HeadroomTrainSteps.execute(plain, 3)
    run = _init(model, latents, texts, f"lowbit_{storage}", rank=4, policy=_policy(base_storage=storage))
    start = {k: v.clone() for k, v in run.adapters.state_dict().items()}
    assert low_bit_layers(model) == 0  # built, then handed to ComfyUI as object patches of the training clone
    T.HeadroomTrainSteps.execute(run, 3)
    assert low_bit_layers(run.patcher) > 0  # the clone is still loaded: ComfyUI swapped the low-bit layers in
    packed, original = run.low_bit_bytes
    assert packed < original / 2 + 4096  # 8-bit weights (plus scales) instead of fp32
    # The numerics change, but little: the same run's losses and weights stay close to the full-precision run's.
    losses, plain_losses = [v for _, v in run.trainer.loss_history], [v for _, v in plain.trainer.loss_history]
    assert all(abs(a - b) <= 0.05 * abs(b) for a, b in zip(losses, plain_losses, strict=True))
    # Adapters start equal (same init seed); training moves them the same way (Adam's per-element normalisation
    # turns small gradient differences into sign flips on near-zero gradients, so compare directions).
    a, b = run.adapters.state_dict(), plain.adapters.state_dict()
    moved_a = torch.cat([(a[k] - start[k]).flatten() for k in a])
    moved_b = torch.cat([(b[k] - start[k]).flatten() for k in b])
    assert not torch.equal(moved_a, moved_b)
    assert torch.nn.functional.cosine_similarity(moved_a, moved_b, dim=0) >= 0.8

    # A stock load of the MODEL (here: unloading the clone) puts the full-precision layers back, unchanged.
    comfy.model_management.unload_model_and_clones(run.patcher)
    assert low_bit_layers(model) == 0 and _no_adapter_attached(model)
    assert all(torch.equal(base[k], v) for k, v in _base_weights(model).items())
    T.HeadroomTrainSteps.execute(run, 4)  # and the next queue loads the low-bit layers again
    assert low_bit_layers(run.patcher) > 0
    run.release()
    assert low_bit_layers(model) == 0


@pytest.mark.parametrize("encoders", ["unload_after_use", "keep_loaded"])
def test_policy_encoders_unloads_or_keeps_text_encoder_and_vae(comfyui, encoders):
    """The policy's `encoders` choice, in caching and in validation: unloaded after use, or left to ComfyUI."""
    from headroom.nodes import cache as cache_nodes, train_lora as T
    from headroom.nodes.bridge.encoders import is_loaded
    from headroom.training.data.synthetic import generate_shapes

    model, clip, vae, latents, texts = _data("sd15", count=2)
    policy = _policy(encoders=encoders)
    kept = encoders == "keep_loaded"
    with torch.inference_mode():
        # Items no cache holds yet (a seed of this case's own): the encoders really load and run.
        data = generate_shapes(2, 32, seed=100 + kept)
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(data.images, "\n".join(data.captions), 32, 32,
                                                                "center", False, 0).args[0]
        cache_nodes.HeadroomCacheLatents.execute(dataset, vae, policy=policy)
        cache_nodes.HeadroomCacheText.execute(dataset, clip, policy=policy)
    assert is_loaded(vae.patcher) == kept and is_loaded(clip.patcher) == kept
    comfy_unload(vae, clip)
    run = _init(model, latents, texts, f"encoders_{encoders}", rank=4, policy=policy)
    T.HeadroomTrainSteps.execute(run, 1)
    T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts="a red circle", negative="", sample_seed=0,
                               sample_steps=1, cfg=1.0, sampler_name="euler", scheduler="normal", width=32, height=32,
                               loss_timesteps=1)
    assert is_loaded(vae.patcher) == kept and is_loaded(clip.patcher) == kept
    comfy_unload(vae, clip)


def comfy_unload(*encoders):
    import comfy.model_management

    for encoder in encoders:
        comfy.model_management.unload_model_and_clones(encoder.patcher)


def test_history_output_carries_lr_memory_and_validation_images(comfyui):
    """What the chart restores from after a page reload: per step loss, lr and memory (MiB; RSS on a CPU), the
    speed, and the last validation's images, in the training node's UI output; the Validate node's own output
    names its run, step, loss and images."""
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15", count=2)
    run = _init(model, latents, texts, "history_extras", rank=4, schedule="linear", schedule_steps=4)
    with torch.inference_mode():
        history = T.HeadroomTrainSteps.execute(run, 3).ui[T.HISTORY_KEY][0]
        validate = T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts="a red circle\na blue square",
                                              negative="", sample_seed=0, sample_steps=1, cfg=1.0,
                                              sampler_name="euler", scheduler="normal", width=32, height=32,
                                              loss_timesteps=1)
        later = T.HeadroomTrainSteps.execute(run, 4).ui[T.HISTORY_KEY][0]
    assert history["steps"] == [1, 2, 3] and len(history["loss"]) == 3
    assert history["lr"] == [pytest.approx(1e-2 * (1 - s / 4), rel=1e-3) for s in (1, 2, 3)]  # linear decay, as reported after each step
    assert set(history["memory_mib"]) == {"rss"} and all(v > 10 for v in history["memory_mib"]["rss"])
    assert history["s_per_step"] > 0 and "images" not in history

    [validation] = validate.ui[T.VALIDATION_KEY]
    assert validation["run"] == "history_extras" and validation["step"] == 3
    assert validation["val_loss"] == validate.args[1] and len(validation["images"]) == 2  # one per prompt
    assert validate.ui["images"] == validation["images"]
    assert later["steps"] == [1, 2, 3, 4] and len(later["lr"]) == len(later["memory_mib"]["rss"]) == 4
    assert later["images"] == validation["images"] and later["images_step"] == 3
    assert later["val_steps"] == [3]


def test_train_steps_at_or_below_the_run_step_says_so(comfyui, caplog):
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15", count=2)
    run = _init(model, latents, texts, "lowered_steps", rank=4)
    with torch.inference_mode():
        assert "text" not in T.HeadroomTrainSteps.execute(run, 3).ui
        with caplog.at_level("WARNING"):
            lowered = T.HeadroomTrainSteps.execute(run, 2)
        same = T.HeadroomTrainSteps.execute(run, 3)
    assert run.step == 3 and lowered.args[2] == 3
    [note] = lowered.ui["text"]
    assert "at step 3, past steps=2: nothing trained" in note and "above 3" in note
    assert lowered.ui[T.HISTORY_KEY][0]["note"] == note and note in caplog.text
    assert "at step 3 already: nothing to train" in same.ui["text"][0]


def test_compare_base_writes_a_before_after_grid_of_the_untouched_base(comfyui):
    """Validate with compare_base: the top row is the MODEL alone (stock KSampler on it, bit for bit), the bottom
    row the run's validation images; after training the top row stays the base, the bottom row moves."""
    import nodes
    import numpy as np

    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.validation import sample_images
    from headroom.training.core.validation_grid import grid_cells, grid_layout

    model, clip, vae, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "compare_base", rank=8, lr=2e-2, include_conv=True)
    prompts = "a red circle at the center\na blue square at the top left"
    sampling = dict(negative="", sample_seed=3, sample_steps=4, cfg=3.0, sampler_name="euler", scheduler="normal",
                    width=32, height=32, loss_timesteps=2, compare_base=True)

    def grid_rows(step):
        path = run.run_dir.validation_dir / f"step_{step:08d}_before_after.png"
        cells = grid_cells(path).astype(np.int16)
        assert cells.shape == (2, 2, 32, 32, 3)  # 2 rows (base, trained) x 2 prompts of 32 x 32
        return np.concatenate(list(cells[0]), axis=1), np.concatenate(list(cells[1]), axis=1)

    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 1)
        first = T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=prompts, **sampling)
        positive = nodes.CLIPTextEncode().encode(clip, "a red circle at the center")[0]
        negative = nodes.CLIPTextEncode().encode(clip, "")[0]
        empty = nodes.EmptyLatentImage().generate(32, 32, 1)[0]
        stock = nodes.VAEDecode().decode(vae, nodes.common_ksampler(model, 3, 4, 3.0, "euler", "normal", positive,
                                                                    negative, empty)[0])[0]
        T.HeadroomTrainSteps.execute(run, 20)
        cached_base = run._base_samples[3]
        T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=prompts, **sampling)
        assert run._base_samples[3] is cached_base, "the base samples are sampled once per run and settings"
        # Sampled afresh after training, the base is still what was cached: the adapter is out of the base MODEL.
        fresh_base, _ = sample_images(run, clip, vae, prompts.splitlines(), "", 3, 4, 3.0, "euler", "normal", 32, 32,
                                      base=True)
        assert torch.equal(fresh_base, cached_base), "training must not change the base samples"
    saved = [entry for entry in first.ui["headroom_saved"] if entry["kind"] == "before/after grid"]
    assert saved and saved[0]["name"].endswith("step_00000001_before_after.png")
    layout = grid_layout(run.run_dir.validation_dir / "step_00000001_before_after.png")  # what the labels say
    assert layout["title"] == f"step 1 \u00b7 {run.run_dir.name} \u00b7 before / after, same seeds", layout
    assert layout["column_labels"] == prompts.splitlines()
    assert layout["row_labels"] == ["before: base model", f"after: {run.run_dir.name} step 1"]
    base_1, trained_1 = grid_rows(1)
    base_20, trained_20 = grid_rows(20)
    stock_pixels = (stock[0].clamp(0, 1) * 255).round().to(torch.int16).numpy()
    assert np.abs(base_1[:, :32] - stock_pixels).max() <= 1, "the top row is the base MODEL as KSampler samples it"
    assert np.array_equal(base_1, base_20), "training must not change the base samples"
    assert np.abs(trained_20 - base_20).max() > 10, "the trained row should differ from the base after training"


def test_validation_png_has_the_pixels_of_the_stock_save_image(comfyui):
    """The validation grid's cells are the pixels ComfyUI's SaveImage writes for the same images (it truncates: a
    rounded grid differed by one level in about half of them)."""
    import folder_paths
    import nodes
    import numpy as np
    from PIL import Image

    from headroom.nodes import train_lora as T
    from headroom.training.core.validation_grid import grid_cells, grid_layout

    model, clip, vae, latents, texts = _data("sd15", count=2)
    run = _init(model, latents, texts, "png_like_save_image", rank=4, batch_size=2)
    with torch.inference_mode():
        images = T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts="a red square\na blue square",
                                            negative="", sample_seed=0, sample_steps=1, cfg=1.0, sampler_name="euler",
                                            scheduler="normal", width=32, height=32, loss_timesteps=1).args[0]
        saved = nodes.SaveImage().save_images(images, "png_like_save_image")["ui"]["images"]
    stock = np.stack([np.asarray(Image.open(pathlib.Path(folder_paths.get_output_directory()) / s["subfolder"]
                                         / s["filename"])) for s in saved])
    path = run.run_dir.validation_dir / "step_00000000.png"
    ours = grid_cells(path)[0]  # the grid's one row of samples, without the labels
    assert ours.shape == stock.shape == (2, 32, 32, 3)
    assert np.array_equal(ours, stock), f"{int((ours != stock).sum())} values differ"
    layout = grid_layout(path)  # each prompt over its sample, the step and run in the title
    assert layout["column_labels"] == ["a red square", "a blue square"] and layout["row_labels"] == []
    assert layout["title"] == f"step 0 \u00b7 {run.run_dir.name}" and layout["top"] > 0


def test_a_card_resolves_to_the_fastest_policy_whose_planned_peak_fits_it(comfyui, monkeypatch):
    """A policy with a card: the Init node lets the planner choose placement, checkpointing (which blocks) and
    optimizer state; the chosen policy's planned peak fits the card less the reserve, it is the fastest predicted of
    those that fit, and the node says what it chose. A policy without the card input (a workflow saved before it) is
    used exactly as given."""
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge import planning
    from headroom.training.memory import planner
    from headroom.training.memory.policy import GIB

    # Block times fixed: the same in the node's plan and in this test's (measured milliseconds of a tiny model on a
    # shared CPU differ from run to run).
    monkeypatch.setattr(planner, "fit_times", lambda samples: ([planner.ActivationLaw()] * len(samples[0].block_saved),
                                                               planner.ActivationLaw()))
    timed_areas = []  # and so are the times at the run's size (planning.time_at_run_size): the area is the run's

    def fixed_times(run_forward, blocks, latent_area, synchronize=None, repeats=1, **options):
        timed_areas.append(latent_area)
        return planner.BlockTimes(latent_area, tuple(1e-3 * (i + 1) for i in range(len(blocks))), 1e-3)

    monkeypatch.setattr(planner, "time_blocks", fixed_times)

    model, clip, vae, latents, texts = _data("sd15")
    old = _policy(base_placement="streamed", checkpointing="blocks")  # no card: as saved before it existed
    assert old.card == "custom"
    assert _init(model, latents, texts, "card_old", rank=4, policy=old).trainer.policy == old

    lora = T.HeadroomLoraConfig.execute("lora", 4, 4.0, "preset", False, 0.0, 0).args[0]
    shape = planning.cache_run_shape(model, latents, texts, 4, "test")
    description = planning.describe_comfy_model(model, lora, "fp32", timing=shape)
    assert description.timed_at_area == shape.latent_area(description) and description.timed
    # as the node plans: its optimizer's host step timed on this machine (once per process: the same figure)
    trainable = planning.with_host_step(planning.lora_trainable(model, lora, "AdamW"))
    peaks = [planner.estimate(description, trainable, shape, p).peak_bytes
             for p in planner.candidate_policies(_policy())]
    # The tiny model fits any real card: a reserve that leaves a budget between the fastest candidate's peak and the
    # smallest makes the choice a real one.
    budget = (peaks[0] + min(peaks)) // 2
    card = _policy(card="8 GB", reserve_gb=8 - budget / GIB)
    output = T.HeadroomTrainLoraInit.execute(
        model=model, latent_cache=latents, text_cache=texts, lora_config=lora,
        optimizer_config=T.HeadroomOptimizerConfig.execute("AdamW", 1e-2, 0.0, "constant", 0, 1000).args[0],
        run_name="card_8gb", seed=0, batch_size=4, grad_accumulation=1, precision="fp32", max_grad_norm=1.0,
        caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0, noise_offset=0.0,
        gradient_checkpointing=False, checkpoint_depth=1, holdout=0, policy=card)
    run = output.args[0]
    assert set(timed_areas) == {shape.latent_area(description)}  # the Init node timed its largest bucket too
    chosen = run.trainer.policy
    assert chosen.card == "custom" and abs(chosen.vram_budget_gb * GIB - card.budget_bytes()) < GIB / 1000
    assert (chosen.base_placement, chosen.checkpointing) != ("resident", "off")
    # Under the card's budget ("partial" fills what the budget leaves, so its peak depends on it): the chosen plan
    # fits, and none that fits is predicted faster (whole policies, and those checkpointing only some blocks).
    base = _policy(card="8 GB", reserve_gb=card.reserve_gb)
    expected = planner.plan_auto(description, trainable, shape, base, card.budget_bytes())
    assert chosen == expected.policy.replace(card="custom", vram_budget_gb=chosen.vram_budget_gb)
    assert expected.fits and run.predicted_s_per_step == expected.predicted_s_per_step
    fitting = []
    for policy in planner.candidate_policies(base, ["as_loaded"]):
        plan = planner.estimate(description, trainable, shape, policy, card.budget_bytes())
        if plan.fits:
            fitting += [plan, *planner.selective_plans(description, trainable, shape, policy, card.budget_bytes())]
    assert expected.predicted_s_per_step == min(p.predicted_s_per_step for p in fitting)
    text = output.ui.as_dict()["text"][0]
    assert "Train LoRA: Init (Headroom): 8 GB: base " in text and "planned peak" in text and "DOES NOT FIT" not in text
    assert "s/step" in text  # the predicted step time, with the plan


def test_a_run_measures_its_model_once_for_its_card_and_its_own_plans(comfyui, monkeypatch):
    """The Init node's card plan measures the MODEL (calibration forwards, times at the run's size: on a GPU also
    ComfyUI's load) for the run it opens; the run's own plans (run_plan as it places its base, next_plan_for after an
    out-of-memory error) use that measurement, and a run without a card plan measures once, at its first plan. What
    it was measured for differing (here the run's shape, or another adapter), it is measured again (a ControlNet run's:
    tests/comfy/test_controlnet_training.py)."""
    import dataclasses

    from headroom.nodes.bridge import planning
    from headroom.training.memory import planner

    measured = []
    measure = planning.measure_and_time
    monkeypatch.setattr(planning, "measure_and_time", lambda *a, **k: measured.append(a[0]) or measure(*a, **k))
    model, clip, vae, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "measured_once_card", rank=4, policy=_policy(card="8 GB"))
    assert len(measured) == 1 and run.measured.patcher is model and run.measured.adapter == run.config.adapter
    with torch.inference_mode():
        plan = planning.run_plan(run)
        planning.next_plan_for(run)
        assert len(measured) == 1  # neither measured the model again
        # the plan from the Init node's measurement is the plan from a new one (its memory figures; the times of a
        # tiny model on a shared CPU differ from one measurement to the next)
        description, trainable, shape, budget = planning._run_inputs(run)
        again = planning.describe_comfy_model(model, run.config.adapter, run.config.train.precision, timing=shape)
        fresh = planner.estimate(again, trainable, shape, run.policy, budget)
        assert [p.total for p in plan.phases] == [p.total for p in fresh.phases]
        measured.clear()
        run.measured = dataclasses.replace(run.measured, shape=dataclasses.replace(shape, width=shape.width * 2))
        planning.run_plan(run)
        assert len(measured) == 1 and run.measured.shape == shape  # measured for another shape: measured again

        own = _init(model, latents, texts, "measured_once_custom", rank=4, policy=_policy())
        assert len(measured) == 1 and own.measured is None  # a custom policy: no card plan at the Init node
        planning.run_plan(own)
        planning.run_plan(own)
        planning.next_plan_for(own)
        assert len(measured) == 2 and own.measured.description is not None
    other = dataclasses.replace(own.config.adapter, rank=8)  # another adapter: measured again
    assert own.measured.is_for(model, own.config.adapter, own.config.train.precision, own.measured.shape, None)
    assert not own.measured.is_for(model, other, own.config.train.precision, own.measured.shape, None)


def _plan_and_train_after_loads(monkeypatch, after_load, run_name: str):
    """Plan, open and train 2 steps on a tiny Flux whose every Headroom load of the diffusion model ends with
    `after_load(patcher)` (what a GPU load does that a CPU one does not); the shared MODEL keeps its values.
    Returns the MODEL and the run."""
    import comfy.model_management as mm

    from headroom.nodes import memory as M, train_lora as T

    load = mm.load_models_gpu

    def load_then(models, *args, **kwargs):
        result = load(models, *args, **kwargs)
        for patcher in models:
            if getattr(patcher.model, "diffusion_model", None) is None or torch.is_inference_mode_enabled():
                continue  # text encoders; ComfyUI's own loads
            after_load(patcher)
        return result

    monkeypatch.setattr(mm, "load_models_gpu", load_then)
    model, _, _, latents, texts = _data("flux", count=2)
    base = _base_weights(model)
    with torch.inference_mode():
        M.HeadroomMemoryPlan.execute(model, "estimate", 2, 32, 32, 8, "preset", "AdamW", "fp32", 8)
    run = _init(model, latents, texts, run_name, batch_size=2)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 2)
    assert run.step == 2 and torch.isfinite(torch.tensor(run.trainer.last_loss))
    after = _base_weights(model)
    assert all(torch.equal(base[k], after[k]) for k in base)
    return model, run


def test_trains_on_weights_a_load_moved_outside_inference_mode(comfyui, monkeypatch):
    """On a GPU, ComfyUI's load moves the loader's weights with Module.to, and Headroom loads outside inference mode:
    the Parameter objects made under inference mode stay and get new data, so is_inference() is False but autograd
    still refuses them ("Inference tensors do not track version counter": every Headroom run failed so on an H200).
    On the CPU nothing moves, so the load is made to move here, with a dtype round trip that takes the same set_data
    path (same values). The plan and the run load, train, and the shared MODEL keeps its values."""
    from headroom.nodes.bridge.comfy_model import made_in_inference_mode

    moved = []

    def move(patcher):
        diffusion = patcher.model.diffusion_model
        diffusion.to(torch.float64).to(torch.float32)  # what a CPU -> GPU move does to the Parameter objects
        moved.append(any(made_in_inference_mode(param) for param in diffusion.parameters()))

    _plan_and_train_after_loads(monkeypatch, move, "moved_weights")
    assert moved and moved[0], "the emulated first move did not leave Parameters made under inference mode"


def test_weights_comfyui_pinned_stay_registered_through_the_clone(comfyui, monkeypatch):
    """ComfyUI's partial load pins the weights it leaves in host RAM (cudaHostRegister on their memory). Headroom
    clones weights made under inference mode after the load; cloning a pinned one freed memory still registered,
    and every later CUDA call of the process failed ("resource already mapped": all the rest of a GPU kit run).
    The CPU cannot pin, so registration is kept in a table here, with CUDA's rules (a range registers once; an
    unregister names a registered pointer); ComfyUI's load pins every other weight. Whatever stays registered
    through a plan and a run is the memory of a live weight."""
    import comfy.model_management as mm

    registered: dict[int, int] = {}
    unknown: list[int] = []

    def pin_memory(tensor):
        assert tensor.data_ptr() not in registered, "memory registered twice"
        registered[tensor.data_ptr()] = tensor.nbytes
        return True

    def unpin_memory(tensor):
        if registered.pop(tensor.data_ptr(), None) is None:
            unknown.append(tensor.data_ptr())
            return False
        return True

    pinned_by_load = []

    def pin(patcher):
        with patcher.use_ejected():  # as ComfyUI pins: in its load, before it injects (the run's adapters)
            keys = [f"diffusion_model.{name}" for name, _ in patcher.model.diffusion_model.named_parameters()]
            for key in keys[::2]:
                if key not in patcher.pinned:
                    patcher.pin_weight_to_device(key)
                    pinned_by_load.append(key)

    monkeypatch.setattr(mm, "pin_memory", pin_memory)
    monkeypatch.setattr(mm, "unpin_memory", unpin_memory)
    model, run = _plan_and_train_after_loads(monkeypatch, pin, "pinned_weights")  # run: its clone holds its pins
    assert pinned_by_load
    live = {t.data_ptr() for t in [*model.model.diffusion_model.parameters(), *model.model.diffusion_model.buffers()]}
    assert registered and set(registered) <= live, "registered host memory outlived its weight"
    assert not unknown, "an unpin named memory that was never registered"


def test_the_plans_measurement_keeps_room_for_its_forwards(comfyui, monkeypatch):
    """ComfyUI's load fills the card; measuring a base larger than the card then had no room left for the
    calibration forwards (Flux-dev at 6 to 24 GiB on an H200 capped to them: out of memory, no plan). The
    measurement asks ComfyUI to keep half of the device free (nothing on the CPU, where the weights are used as
    they are kept)."""
    import types

    import comfy.model_management as mm

    from headroom.nodes import memory as M
    from headroom.nodes.bridge import planning

    monkeypatch.setattr(planning, "available_device_bytes", lambda device=None: 10 * 2 ** 30)
    on_gpu = types.SimpleNamespace(load_device=torch.device("cuda", 0), offload_device=torch.device("cpu"))
    on_cpu = types.SimpleNamespace(load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    assert planning.calibration_room(on_gpu) == 5 * 2 ** 30 and planning.calibration_room(on_cpu) == 0

    asked = []
    load = mm.load_models_gpu

    def recording_load(models, memory_required=0, **kwargs):
        asked.append(memory_required)
        return load(models, memory_required=memory_required, **kwargs)

    monkeypatch.setattr(mm, "load_models_gpu", recording_load)
    monkeypatch.setattr(planning, "calibration_room", lambda patcher: 123 * 2 ** 20)
    model, *_ = _data("flux", count=2)
    with torch.inference_mode():
        M.HeadroomMemoryPlan.execute(model, "estimate", 2, 32, 32, 8, "preset", "AdamW", "fp32", 8)
    assert 123 * 2 ** 20 in asked


def test_partial_placement_keeps_the_planned_share_of_the_base(comfyui, monkeypatch):
    """A "partial" run on a device plans, once, the share of the base its load may leave there (ComfyUI's load
    fills its free memory; the run trims back to the plan: nodes/bridge/comfy_bridge.Placement.load). On the CPU
    nothing is loaded apart, so the device check is made to pass and only the planned share is asked for."""
    from headroom.nodes.bridge import comfy_bridge, planning
    from headroom.training.memory import planner
    from headroom.training.memory.policy import OffloadPolicy

    model, _, _, latents, texts = _data("flux", count=2)
    policy = OffloadPolicy(vram_budget_gb=0.05, base_placement="partial", checkpointing="blocks")
    run = _init(model, latents, texts, "partial_share", batch_size=2, policy=policy)
    assert run._base_device_share() is None  # load device == offload device: nothing to trim
    monkeypatch.setattr(run.placement.patcher, "offload_device", torch.device("meta"))
    with torch.inference_mode():  # a budget a fifth below the resident plan's peak: part of the blocks streams
        peak = planning.run_plan(run).phase("training step").total
    run.policy = run.policy.replace(vram_budget_gb=0.8 * peak / 2**30)
    calls = []
    monkeypatch.setattr(comfy_bridge, "run_plan", lambda r: calls.append(r) or planning.run_plan(r))
    with torch.inference_mode():
        share = run._base_device_share()
        assert run._base_device_share() == share and len(calls) == 1  # planned once
    total = planner.frozen_bytes(model.model.diffusion_model)
    with torch.inference_mode():
        plan = planning.run_plan(run)
    blocks = plan.phase("training step").items["resident block weights (as_loaded, partial)"]
    assert share == plan.base_device_bytes and 0 < share < total and share == total - plan.host_bytes[
        "streamed block weights"]
    assert blocks < total
    assert comfy_bridge.partial_excess(total, share) == total - share
    assert comfy_bridge.partial_excess(share // 2, share) == 0 and comfy_bridge.partial_excess(total, None) == 0
    # Validation's own share comes from the same plan (issue 28 item 3), planned in the same single call.
    assert run._validation_device_share() == plan.validation_base_device_bytes and len(calls) == 1
    validation = plan.phase("validation")
    assert plan.validation_base_device_bytes == (plan.base_device_bytes - blocks
                                                 + validation.items["resident block weights (as_loaded, partial)"])
    # The streamer placed as planned: the plan's resident whole blocks and the non-block layers kept on the device,
    # the rest through the ring (issue 41 item 2); from the same single plan.
    assert run._plan_streamer() and len(calls) == 1
    options = run.trainer.stream_options
    assert options["resident"] == plan.resident_blocks and options["slots"] == plan.stream_slots == 2
    assert options["keep"] == [run.placement.patcher.model.diffusion_model]
    # ComfyUI's pins of block weights are undone (the streamer pins its packed buffers); others are left
    patcher = run.placement.patcher
    first_block = comfy_bridge.training_blocks(patcher.model.diffusion_model)[0][0]
    unpinned = []
    monkeypatch.setattr(patcher, "pinned", {f"diffusion_model.{first_block}.x.weight", "diffusion_model.final.weight"})
    monkeypatch.setattr(patcher, "unpin_weight", unpinned.append)
    assert comfy_bridge.unpin_block_weights(patcher) == unpinned == [f"diffusion_model.{first_block}.x.weight"]
    # The training load with whole blocks: everything ComfyUI loaded goes to host RAM (its smallest-first unload would
    # leave slices of blocks); the streamer brings the non-block layers and the resident blocks back whole.
    freed, pins = [], []
    monkeypatch.setattr(type(patcher), "pin_weight_to_device", lambda self, key: pins.append(key))
    management = comfy_bridge.comfy.model_management

    fills = []  # what each load of the weights was let fill (comfy_fills_at_most: tests/comfy/test_comfy_load.py)
    monkeypatch.setattr(type(patcher), "load", lambda self, device, lowvram_model_memory, force_patch_weights, full_load:
                        fills.append((lowvram_model_memory, full_load)))

    def comfy_load(patchers, **kwargs):  # ComfyUI's load pins each weight it leaves in host RAM
        patchers[0].pin_weight_to_device("diffusion_model.final.weight")
        patchers[0].load(patchers[0].load_device, lowvram_model_memory=10 ** 15, full_load=True)  # and fills memory

    def comfy_unload(device, memory_to_free=0):  # its partial unload each weight it moves there
        freed.append(memory_to_free)
        patcher.pin_weight_to_device(f"diffusion_model.{first_block}.x.weight")

    monkeypatch.setattr(management, "load_models_gpu", comfy_load)
    monkeypatch.setattr(comfy_bridge, "keep_to_share", lambda patcher, share: 0)
    monkeypatch.setattr(patcher, "partially_unload", comfy_unload)
    monkeypatch.setattr(patcher, "loaded_size", lambda: 10 * total)
    run.placement.load([patcher], 0, share, whole_blocks=True)
    assert freed == [10 * total] and len(unpinned) == 2  # ComfyUI's pins of block weights undone on the way
    # ... and none made in the first place: this patcher's pins suspended through that load, as they were after;
    # no weight loaded only to be sent back
    assert pins == [] and "pin_weight_to_device" not in vars(patcher)
    assert fills == [(0, False)] and "load" not in vars(patcher)
    run.placement.load([patcher], 0, share)  # a load that keeps ComfyUI's placement: its pins stand, it fills the share
    assert pins == ["diffusion_model.final.weight"] and fills == [(0, False), (share, False)]
    with pytest.raises(RuntimeError), comfy_bridge.comfy_pins_suspended(patcher):
        raise RuntimeError("a load failing")
    assert "pin_weight_to_device" not in vars(patcher)
    run.policy = run.policy.replace(base_placement="resident")
    assert not run._plan_streamer()
    assert run._base_device_share() is None and run._validation_device_share() is None  # everything loads


def test_prompt_lines_with_kohyas_sample_options_sample_as_the_stock_nodes_would(comfyui):
    """A prompt line from an sd-scripts / musubi-tuner prompt file (`text --n negative --d seed --s steps --l cfg
    --g guidance --w W --h H`) samples as CLIP Text Encode (+ FluxGuidance) + KSampler with those settings, the
    options not encoded as text; the grid names what they changed. Lines of different sizes, and options no line sets
    here, are refused by name."""
    import nodes
    from comfy_extras import nodes_flux

    from headroom.nodes import train_lora as T
    from headroom.training.core.validation_grid import grid_layout

    model, clip, vae, latents, texts = _data("sd15", count=2)
    run = _init(model, latents, texts, "sample_options", rank=4, batch_size=2)
    prompts = "a red circle --n blurry, dark --d 7 --s 3 --l 2.5 --w 48 --h 32\n\na blue square --w 48 --h 32"
    settings = dict(negative="", sample_seed=5, sample_steps=2, cfg=1.0, sampler_name="euler", scheduler="normal",
                    width=32, height=32, loss_timesteps=1)
    with torch.inference_mode():
        images = T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=prompts, **settings).args[0]
        stock = []
        for text, negative, seed, steps, cfg in (("a red circle", "blurry, dark", 7, 3, 2.5),
                                                 ("a blue square", "", 5, 2, 1.0)):
            positive = nodes.CLIPTextEncode().encode(clip, text)[0]
            negative = nodes.CLIPTextEncode().encode(clip, negative)[0]
            empty = nodes.EmptyLatentImage().generate(48, 32, 1)[0]
            stock.append(nodes.VAEDecode().decode(vae, nodes.common_ksampler(
                model, seed, steps, cfg, "euler", "normal", positive, negative, empty)[0])[0])
    assert images.shape == (2, 32, 48, 3)
    # the run's zero-initialised LoRA applied as the saved file: the base model's samples
    assert (images - torch.cat(stock)).abs().max() <= 1 / 255
    layout = grid_layout(run.run_dir.validation_dir / "step_00000000.png")
    assert layout["column_labels"] == ["a red circle (seed 7, steps 3, cfg 2.5)", "a blue square"]

    # --g on Flux: the prompt's embedded guidance, as the stock FluxGuidance node sets it
    flux_model, flux_clip, flux_vae, flux_latents, flux_texts = _data("flux", count=2)
    flux_run = _init(flux_model, flux_latents, flux_texts, "sample_guidance", rank=4, batch_size=2)
    with torch.inference_mode():
        guided = T.HeadroomValidate.execute(flux_run, clip=flux_clip, vae=flux_vae, prompts="a red circle --g 7.5",
                                            **settings).args[0]
        unguided = T.HeadroomValidate.execute(flux_run, clip=flux_clip, vae=flux_vae, prompts="a red circle",
                                              **settings).args[0]
        positive = nodes_flux.FluxGuidance.execute(nodes.CLIPTextEncode().encode(flux_clip, "a red circle")[0],
                                                   7.5).args[0]
        negative = nodes.CLIPTextEncode().encode(flux_clip, "")[0]
        stock = nodes.VAEDecode().decode(flux_vae, nodes.common_ksampler(
            flux_model, 5, 2, 1.0, "euler", "normal", positive, negative,
            nodes.EmptyLatentImage().generate(32, 32, 1)[0])[0])[0]
    assert (guided - stock).abs().max() <= 1 / 255 and (unguided - stock).abs().max() > 1 / 255

    for bad, message in (("a cat --w 64\na dog", r"several sizes \(32x32, 64x32\)"),
                         ("a cat --ss euler_a", r"--ss .* use the sampler_name input"),
                         ("a cat --q 9", r"--q is not a sample option")):
        with pytest.raises(ValueError, match=r"^Validate LoRA \(Headroom\): .*" + message):
            T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=bad, **settings)
        with pytest.raises(ValueError, match=r"^Train LoRA \(Headroom\): .*" + message):  # before any step
            T.HeadroomTrainLora.execute(model=model, latent_cache=latents, text_cache=texts, lora_config=None,
                                        optimizer_config=None, run_name="never", seed=0, batch_size=1,
                                        grad_accumulation=1, precision="fp32", max_grad_norm=1.0, caption_dropout=0.0,
                                        timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0,
                                        noise_offset=0.0, gradient_checkpointing=False, checkpoint_depth=1, holdout=0,
                                        steps=2, validate_every=0, save_every=0, lora_subfolder="headroom",
                                        prompts=bad, width=32, height=32)
    assert run.step == 0


def _saving_every_step(model, latents, texts, run_name: str, subfolder: str, **more) -> dict:
    """Train LoRA's inputs for a LoRA of rank 4 saved every step to models/loras/`subfolder`."""
    from headroom.nodes import train_lora as T

    lora = T.HeadroomLoraConfig.execute("lora", 4, 4.0, "preset", False, 0.0, 0).args[0]
    opt = T.HeadroomOptimizerConfig.execute("AdamW", 1e-3, 0.0, "constant", 0, 100).args[0]
    return dict(model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt,
                run_name=run_name, seed=0, batch_size=2, grad_accumulation=1, precision="fp32", max_grad_norm=1.0,
                caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0,
                noise_offset=0.0, gradient_checkpointing=False, checkpoint_depth=1, holdout=0, validate_every=0,
                save_every=1, lora_subfolder=subfolder, **more)


def test_keep_saves_removes_only_the_runs_own_older_step_saves(comfyui, monkeypatch):
    """Train LoRA keep_saves 2, saving every step to 4 and then continuing to 5: the newest two step saves stay after
    each save; the older ones this run wrote are removed, and the node says which. A file of the same name that
    another run wrote (its metadata says so), and one that is no safetensors file, stay where they are."""
    import folder_paths

    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    folder = pathlib.Path(folder_paths.get_folder_paths("loras")[0]) / "pruned"
    folder.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(folder / "keep_two_step000000.safetensors"),
              metadata={"headroom.run": "keep_two", "headroom.base_fingerprint": "another model"})
    (folder / "keep_two_step000001.safetensors.txt").write_text("not a save")
    with torch.inference_mode():
        inputs = _saving_every_step(model, latents, texts, "keep_two", "pruned", keep_saves=2)
        first = T.HeadroomTrainLora.execute(steps=4, **inputs)
        assert sorted(p.name for p in folder.iterdir()) == [
            "keep_two_step000000.safetensors", "keep_two_step000001.safetensors.txt",
            "keep_two_step000003.safetensors", "keep_two_step000004.safetensors"]
        assert ("2 older save(s) removed (keep_saves 2): keep_two_step000001.safetensors, "
                "keep_two_step000002.safetensors") in first.ui["text"]
        assert "pruned/keep_two_step000001.safetensors" not in folder_paths.get_filename_list("loras")
        T.HeadroomTrainLora.execute(steps=5, **inputs)
        assert sorted(p.name for p in folder.iterdir()) == [
            "keep_two_step000000.safetensors", "keep_two_step000001.safetensors.txt",
            "keep_two_step000004.safetensors", "keep_two_step000005.safetensors"]
        # Windows refuses to remove a file a loader holds open: the save stays, the node says so, the run goes on
        from headroom.nodes.bridge import model_files

        def held_open(path):
            raise PermissionError(13, "The process cannot access the file because it is being used by another "
                                      "process")

        monkeypatch.setattr(model_files.os, "remove", held_open)
        last = T.HeadroomTrainLora.execute(steps=6, **inputs)
    assert (folder / "keep_two_step000004.safetensors").exists() and last.args[1].step == 6
    assert any(line.startswith("Warning: older save keep_two_step000004.safetensors not removed (The process cannot "
                               "access the file") for line in last.ui["text"])


def test_step_saves_make_room_on_a_short_disk_and_say_when_they_will_not_fit(comfyui, monkeypatch):
    """keep_saves 2 on a disk with room for no third save: before the next save the older one goes first (the prune
    after the save would remove it anyway), and the node says so; where removing would not make the room, nothing
    is removed. keep_saves 0 with room for fewer saves than are to come: the node says so before the first step."""
    import folder_paths

    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge import model_files
    from headroom.training.data.files import format_bytes

    assert [model_files.saves_to_come(*case) for case in ((0, 10, 4), (0, 8, 4), (0, 5, 0), (5, 5, 2), (3, 10, 3),
                                                           (4, 9, 4))] == [3, 2, 1, 0, 3, 2]
    model, _, _, latents, texts = _data("sd15")
    folder = pathlib.Path(folder_paths.get_folder_paths("loras")[0]) / "roomy"
    with torch.inference_mode():
        inputs = _saving_every_step(model, latents, texts, "keep_room", "roomy")
        first = T.HeadroomTrainLora.execute(steps=2, keep_saves=2, **inputs)
        assert not [line for line in first.ui["text"] if line.startswith(("disk: each save", "disk: the older save"))]
        one = (folder / "keep_room_step000002.safetensors").stat().st_size
        run = first.args[1]
        # what an all-in-one save writes, estimated before any is on disk: the trained tensors in fp32
        assert one - 64 * 1024 < run.trained.save_bytes(run) <= one
        # removing the older would not make the room: nothing removed (the save then says disk full)
        monkeypatch.setattr(model_files, "free_bytes", lambda path: 0)
        assert model_files.make_room_for_step_save(run, "loras", "roomy", 2, one) == ("", [])
        assert len(list(folder.iterdir())) == 2
        # room for one save, not with the margin a save asks for (1 % + 64 KiB): the older goes first
        monkeypatch.setattr(model_files, "free_bytes", lambda path: one)
        third = T.HeadroomTrainLora.execute(steps=3, keep_saves=2, **inputs)
    assert sorted(p.name for p in folder.iterdir()) == ["keep_room_step000002.safetensors",
                                                        "keep_room_step000003.safetensors"]
    notes = [line for line in third.ui["text"] if line.startswith(("disk: each save", "disk: the older save"))]
    assert notes == [f"disk: the older save keep_room_step000001.safetensors was removed before step 3 was saved, to "
                     f"make room ({format_bytes(one)} was free in models/loras/roomy, a save takes about "
                     f"{format_bytes(one)}); keep_saves 2 keeps the newest 2"], third.ui["text"]
    # Windows refuses to remove a save a loader holds open: no room made, the node says which file, the save goes on
    # (the real disk has room) and the prune after it names the same file once
    def held_open(path):
        raise PermissionError(13, "The process cannot access the file because it is being used by another process")

    with monkeypatch.context() as held, torch.inference_mode():
        held.setattr(model_files.os, "remove", held_open)
        fourth = T.HeadroomTrainLora.execute(steps=4, keep_saves=2, **inputs)
    assert sorted(p.name for p in folder.iterdir())[-3:] == ["keep_room_step000002.safetensors",
                                                             "keep_room_step000003.safetensors",
                                                             "keep_room_step000004.safetensors"]
    assert not [line for line in fourth.ui["text"] if line.startswith("disk: the older save")]
    assert [line for line in fourth.ui["text"] if line.startswith("Warning: older save")] == [
        "Warning: older save keep_room_step000002.safetensors not removed (The process cannot access the file because "
        "it is being used by another process; open in a loader or another program? Once it is closed, the run's next "
        "save removes it)"], fourth.ui["text"]
    # keep_saves 0, two saves to come and room for one: said before the first step, and the saves go on
    with torch.inference_mode():
        fifth = T.HeadroomTrainLora.execute(steps=6, keep_saves=0, **inputs)
    assert [line for line in fifth.ui["text"] if line.startswith("disk: each save")] == [
        f"disk: each save of run 'keep_room' takes about {format_bytes(one)}; the 2 still to come need about "
        f"{format_bytes(2 * one)} more, and {format_bytes(one)} is free on the disk of models/loras/roomy: a "
        "later save will find it full. Free space there, or set keep_saves (the newest that many are kept: 2 needs "
        "room for two), or save less often (save_every)"]
    assert len(list(folder.iterdir())) == 5
    # what the note advises: keeping fewer, down to the two a save needs beside the newest (a folder with no saves)
    run = fifth.args[1]
    advice = {keep: model_files.saves_room_note(run, "loras", "roomless", keep, 4, one).split("Free space there")[-1]
              for keep in (1, 2, 3)}
    assert advice == {1: " (the next save is written beside the newest: room for two is the least)",
                      2: " (the next save is written beside the newest: room for two is the least)",
                      3: ", or lower keep_saves (2 needs room for two)"}


@pytest.mark.parametrize("batch_size,grad_accumulation,expected", [(2, 1, "2 steps"), (2, 2, "1 step"),
                                                                  (3, 1, "2 steps"), (4, 2, "about 0.5 steps")])
def test_init_says_how_many_steps_an_epoch_is(comfyui, batch_size, grad_accumulation, expected):
    """For those who count in epochs (kohya's max_train_epochs, save_every_n_epochs; docs/COMING_FROM.md): 4
    training items (one of 5 held out) in one bucket are 2 batches of 2 (or of 3: 3 + 1), a step takes
    `grad_accumulation` of them."""
    from headroom.nodes.train_lora import opened_text

    model, _, _, latents, texts = _data("sd15", count=5)
    run = _init(model, latents, texts, f"epoch_{batch_size}_{grad_accumulation}", rank=4, holdout=1,
                batch_size=batch_size, grad_accumulation=grad_accumulation)
    assert len(run.train_items) == 4
    assert f"an epoch (each training item once, repeat folders counted) is {expected}" in opened_text(run).splitlines()


@pytest.mark.parametrize("family, targets, checkpointing", [
    ("sd15", "preset", False), ("sdxl", "preset", False), ("sdxl", "preset", True), ("sdxl", "all_linear", False),
    ("flux", "preset", True)])
def test_the_plan_knows_which_blocks_backward_skips(comfyui, family, targets, checkpointing):
    """The planner's `without_backward` (the first blocks with no trained layer in or before them: the time model
    leaves out their backward) is what a training step does: the leading blocks whose outputs need no gradient, for
    the node's plan (lora_trainable) and for an open run's (planning._run_inputs); never more."""
    from family_checks import blocks_backward_skips
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge import planning

    model, clip, vae, latents, texts = _data(family)
    run = _init(model, latents, texts, f"skips_{family}_{targets}_{checkpointing}", targets=targets,
                gradient_checkpointing=checkpointing)
    _, skipped = blocks_backward_skips(model, run)
    if (family, targets) == ("sdxl", "preset"):
        assert skipped > 0  # the UNet's first layers, before its first attention: conv_in, ResBlocks, a downsample
    if family == "flux":
        assert skipped == 0
    if (family, targets) == ("sdxl", "all_linear"):
        assert skipped == 1  # conv_in, a convolution: the first ResBlock has Linear layers
    # Every target here lies inside the blocks (one outside may feed any block: the plan then says 0, test_time_model)
    assert planning._run_inputs(run)[1].without_backward == skipped
    lora = T.HeadroomLoraConfig.execute("lora", 8, 8.0, targets, False, 0.0, 0).args[0]
    assert planning.lora_trainable(model, lora, "AdamW").without_backward == skipped
    run.release()
    # The memory plan needs no count of its own: its calibration forward (a latent needing no gradient, the adapter
    # attached) saves nothing in those blocks for backward, as training does
    with torch.inference_mode():
        description = planning.describe_comfy_model(model, lora, "fp32")
    saved = [b.saved.at(64, 77) for b in description.blocks]
    assert all(value == 0 for value in saved[:skipped]) and all(value > 0 for value in saved[skipped:])


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_train_lora_saves_in_save_dtype_and_validates_that_file_as_the_stock_loader_reads_it(comfyui, kind):
    """Train LoRA's save_dtype bf16 (kohya's save_precision): the file holds bf16 tensors (a full fine-tune's
    differences too), half the fp32 save, sized so beforehand; its as_saved_file validation sample is exactly what the
    stock LoraLoader + KSampler make of that file, and not what they make of the same run saved in fp32 (the rounding
    is in the sample), as is the node's MODEL output; a save_dtype no one offers is refused."""
    import folder_paths
    import nodes
    from safetensors.torch import load_file
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    prompt = "a red circle at the center"
    with torch.inference_mode():
        inputs = _saving_every_step(model, latents, texts, f"save_bf16_{kind}", "dtypes", save_dtype="bf16",
                                    clip=clip, vae=vae, prompts=prompt, negative="", sample_seed=3, sample_steps=3,
                                    cfg=2.0, sampler_name="euler", scheduler="normal", width=32, height=32,
                                    loss_timesteps=1)
        inputs.update(save_every=0, optimizer_config=T.HeadroomOptimizerConfig.execute(
            "AdamW", 2e-2, 0.0, "constant", 0, 100).args[0])
        if kind == "full":
            inputs["lora_config"] = T.HeadroomLoraConfig.execute("full", 4, 4.0, "preset", False, 0.0, 0).args[0]
        patched, run, name, _, same_clip = T.HeadroomTrainLora.execute(steps=3, **inputs).args
        assert same_clip is clip  # no text encoder trained: the clip as given
        validated = load_file(str(run.run_dir.validation_dir / "step_00000003_latents.safetensors"))["samples"]
        path = folder_paths.get_full_path("loras", name)
        saved = load_file(path)
        fp32_name = T.HeadroomSaveLora.execute(run, "dtypes", f"save_fp32_{kind}", "fp32").args[0]
        positive = nodes.CLIPTextEncode().encode(clip, prompt)[0]
        negative = nodes.CLIPTextEncode().encode(clip, "")[0]
        empty = nodes.EmptyLatentImage().generate(32, 32, 1)[0]
        stock = {}
        for file, lora_model in ((name, None), (fp32_name, None), ("output", patched)):
            lora_model = lora_model or nodes.LoraLoader().load_lora(model, clip, file, 1.0, 0.0)[0]
            stock[file] = nodes.common_ksampler(lora_model, 3, 3, 2.0, "euler", "normal", positive, negative,
                                                empty)[0]["samples"].float()
            import comfy.model_management

            comfy.model_management.unload_all_models()
        with pytest.raises(ValueError, match=r"^Train LoRA \(Headroom\): save_dtype='fp8': choose one of fp32, bf16, "
                           r"fp16$"):
            T.HeadroomTrainLora.execute(steps=3, **{**inputs, "save_dtype": "fp8"})
    assert {tensor.dtype for tensor in saved.values()} == {torch.bfloat16}
    if kind == "full":
        assert any(key.endswith(".diff") for key in saved)
    estimate = run.trained.save_bytes(run, "bf16")
    assert 2 * estimate == run.trained.save_bytes(run)
    assert estimate <= pathlib.Path(path).stat().st_size <= estimate + 64 * 1024
    assert torch.equal(validated, stock[name]) and torch.equal(stock["output"], stock[name])  # the MODEL output too
    assert not torch.equal(validated, stock[fp32_name])


def test_validate_refuses_a_clip_whose_prompts_the_model_cannot_take(comfyui):
    """Another family's CLIP on Validate (prompts 4096 wide for a UNet that takes 32): refused before sampling, naming
    both widths and the CLIP to connect, not the sampler's "shapes cannot be multiplied"; the right one then samples."""
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, clip, vae, latents, texts = _data("sd15")
    _, other_clip, _ = build_tiny_models("sd3", 1)
    run = _init(model, latents, texts, "wrong_clip", rank=4)
    sampling = dict(prompts="a red circle", negative="", sample_seed=0, sample_steps=1, cfg=1.0, sampler_name="euler",
                    scheduler="normal", width=32, height=32, loss_timesteps=1)
    with torch.inference_mode():
        with pytest.raises(ValueError, match=r"^run 'wrong_clip': the clip input encodes prompts 4096 wide, but the "
                           r"run's captions were cached 32 wide, as its MODEL takes them: connect the CLIP the "
                           r"captions were cached with \(Cache Text's clip\)"):
            T.HeadroomValidate.execute(run, clip=other_clip, vae=vae, **sampling)
        images = T.HeadroomValidate.execute(run, clip=clip, vae=vae, **sampling).args[0]
    assert images.shape[0] == 1


def test_validation_history_shows_the_runs_validations_as_rows_and_leaves_out_what_it_cannot_read(comfyui):
    """Three validations of two prompts through Validate, then Validation History: a row per step, the samples the
    grids hold (the sheet as history_sheet makes it of the grids read back), `last` rows only when set; a PNG that is
    no grid and a symlink among the grids are left out, named; before any validation the node says so (no error: it
    ends the templates' graphs, which may train without prompts)."""
    import os

    import numpy

    from headroom.nodes import train_lora as T
    from headroom.training.core import validation_grid as G

    model, clip, vae, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "history", rank=4)
    sampling = dict(prompts="a red circle\na blue square", negative="", sample_seed=0, sample_steps=1, cfg=1.0,
                    sampler_name="euler", scheduler="normal", width=32, height=32, loss_timesteps=1)
    with torch.inference_mode():
        before = T.HeadroomValidationHistory.execute(run)  # no validation yet: said, a black image
        assert before.ui == {"text": ["run 'history' has no validation grid yet: validate it with prompts (Validate "
                                      "LoRA, or the Train node's prompts and validate_every)"]}
        assert torch.equal(before.args[0], torch.zeros(1, 64, 64, 3))
        for steps in (1, 2, 3):
            T.HeadroomTrainSteps.execute(run, steps)
            T.HeadroomValidate.execute(run, clip=clip, vae=vae, **sampling)
    folder = run.run_dir.validation_dir
    from PIL import Image

    Image.new("RGB", (8, 8)).save(folder / "step_00000009.png")  # no grid record
    os.symlink(folder / "step_00000001.png", folder / "step_00000010.png")
    output = T.HeadroomValidationHistory.execute(run, 0)
    sheet = output.args[0]
    grids = [G.grid_samples(folder / f"step_{step:08d}.png") for step in (1, 2, 3)]
    expected, _ = G.history_sheet([(step, *grid) for step, grid in zip((1, 2, 3), grids)], "history \u00b7 steps 1-3",
                                  256)
    assert torch.equal(sheet, torch.from_numpy(numpy.array(expected)).float().div(255).unsqueeze(0))
    assert G.grid_layout(expected)["row_labels"] == ["step 1", "step 2", "step 3"]
    text = output.ui["text"]
    assert text[0].startswith("run 'history', step 3: validation history, ") and len(text) == 3
    assert text[1].startswith("step 9: step_00000009.png is not a readable validation grid (not a Headroom "
                              "validation grid") and text[1].endswith("; left out")
    assert text[2].startswith("step 10: step_00000010.png is not a readable validation grid (") and "symlink" in text[2]
    two = T.HeadroomValidationHistory.execute(run, 2)  # the newest 2 that can be read: steps 2 and 3
    assert two.args[0].shape[1] < sheet.shape[1] and two.args[0].shape[2] == sheet.shape[2]
    assert two.ui["text"][1:] == text[1:]
    assert T.HeadroomValidationHistory.fingerprint_inputs(run, 0) != (run.step, (), 0, 256)
