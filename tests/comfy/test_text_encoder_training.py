"""Training the CLIP's text encoders too (Train LoRA's text_encoder_lr; nodes/bridge/text_encoder_lora.py), through the
nodes on the tiny families' real ComfyUI models (in-process, CPU): each step encodes its captions through the trained
encoder exactly as the text cache holds them untrained, Validate samples what the stock Load LoRA (strength_clip 1)
+ CLIP Text Encode + KSampler make of the saved file, a kohya file maps onto the CLIP too, a resumed run continues
exactly, and what it cannot train is refused naming the input."""
from __future__ import annotations

import json
import logging
import time

import pytest
import torch

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]

PROMPT = "a red circle at the center"


def _data(family: str, captions: str | None = None, tag_shuffles: int = 0, clip=None):
    """(model, clip, vae, latent cache, text cache) of 4 synthetic images at 32 px through the caching nodes;
    `captions`: theirs instead of the synthetic ones; `clip`: that CLIP instead of the family's."""
    from headroom.nodes import cache as cache_nodes, data as data_nodes
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    with torch.inference_mode():  # as ComfyUI runs nodes
        model, tiny_clip, vae = build_tiny_models(family, 0)
        clip = clip or tiny_clip
        images, synthetic, _ = data_nodes.HeadroomSyntheticDataset.execute(4, 32, 0).args
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, captions or synthetic, 32, 32, "center",
                                                                False, 0).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip, tag_shuffles=tag_shuffles, keep_tags=1).args[0]
    return model, clip, vae, latents, texts


def _init(model, clip, latents, texts, name: str, text_encoder_lr=5e-3, kind="lora", optimizer="AdamW", lr=1e-2,
          init_lora="none", caption_dropout=0.25, scale_weight_norms=0.0, alpha=4.0, **inputs):
    from family_checks import init_inputs
    from headroom.nodes import train_lora as T

    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute(kind, 4, alpha, "preset", False, 0.0, 0, init_lora=init_lora).args[0]
        common = {**init_inputs(model, latents, texts, batch_size=2, lr=lr), "caption_dropout": caption_dropout}
        common["optimizer_config"] = T.HeadroomOptimizerConfig.execute(
            optimizer, lr, 0.0, "constant", 0, 100, scale_weight_norms=scale_weight_norms).args[0]
        return T.HeadroomTrainLoraInit.execute(**{**common, **inputs}, lora_config=lora, run_name=name, clip=clip,
                                               text_encoder_lr=text_encoder_lr).args[0]


def _unique(name: str) -> str:
    return f"{name}_{time.time_ns()}"


def _clip_weights(clip) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in clip.cond_stage_model.state_dict().items()}


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_validation_is_what_the_stock_loader_makes_of_the_saved_text_encoder_and_model(comfyui, caplog, family):
    """20 steps training the text encoder beside the model; Validate's image (as_saved_file) equals the stock
    LoraLoader (strength_model 1, strength_clip 1) + CLIPTextEncode + KSampler + VAEDecode of the saved file, which
    patches every trained layer of both (no "lora key not loaded"); the text encoder's part changes the image; the
    shared MODEL's and CLIP's weights are as loaded and the stock CLIP Text Encode of the run's CLIP is unchanged."""
    import comfy.model_management
    import nodes
    from family_checks import base_weights
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data(family)
    base, clip_base = base_weights(model), _clip_weights(clip)
    with torch.inference_mode():
        before = nodes.CLIPTextEncode().encode(clip, PROMPT)[0][0][0].clone()
    run = _init(model, clip, latents, texts, _unique(f"te_{family}"))
    layers = run.trained.text_encoder.paths
    sampling = dict(sample_seed=7, sample_steps=4, cfg=3.0, sampler_name="euler", scheduler="simple", width=32,
                    height=32)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 20)
        images = T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=PROMPT, negative="", loss_timesteps=1,
                                            **sampling).args[0]
        name = T.HeadroomSaveLora.execute(run, "headroom/text_encoder", "", "fp32").args[0]
    assert "text encoder" in repr(run) and len(run.trainer.params) > len(run.adapters.parameters())
    said = f"text encoder trained too: {len(layers)} layers of {'clip_g, clip_l' if family == 'sdxl' else 'clip_l'}"
    assert said in T.opened_text(run), T.opened_text(run)

    def stock(strength_clip: float):
        lora_model, lora_clip = nodes.LoraLoader().load_lora(model, clip, name, 1.0, strength_clip)
        positive = nodes.CLIPTextEncode().encode(lora_clip, PROMPT)[0]
        negative = nodes.CLIPTextEncode().encode(lora_clip, "")[0]
        empty = {"samples": torch.zeros(1, 4, 4, 4)}
        image = nodes.VAEDecode().decode(vae, nodes.common_ksampler(
            lora_model, 7, 4, 3.0, "euler", "simple", positive, negative, empty)[0])[0]
        return image, lora_model, lora_clip

    caplog.clear()
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        with_encoder, lora_model, lora_clip = stock(1.0)
        model_only, _, _ = stock(0.0)
        # Apply Trained LoRA's clip output: what Load LoRA makes of the saved file's text-encoder layers, at its
        # strength (strength_clip), so prompts encoded with it are Validate's
        for strength in (1.0, 0.5):
            applied = T.HeadroomApplyTrainedLora.execute(model, run, strength, clip=clip).args[1]
            loaded = nodes.LoraLoader().load_lora(model, clip, name, 1.0, strength)[1]
            assert applied is not clip and torch.equal(nodes.CLIPTextEncode().encode(applied, PROMPT)[0][0][0],
                                                       nodes.CLIPTextEncode().encode(loaded, PROMPT)[0][0][0])
        assert T.HeadroomApplyTrainedLora.execute(model, run, 1.0).args[1] is None  # no clip connected
    assert "lora key not loaded" not in caplog.text, caplog.text
    assert len(lora_model.patches) == len(run.adapters.layers)
    assert len(lora_clip.patcher.patches) == len(layers) > 0, "a trained text-encoder layer was not patched"
    difference = (images - with_encoder).abs().max().item()
    print(f"{family}: {len(layers)} text-encoder layers; validation vs the stock chain: max abs diff {difference:.2e}; "
          f"the text encoder's part of the image: {(with_encoder - model_only).abs().max().item():.2e}")
    assert difference <= 1e-3
    assert (with_encoder - model_only).abs().max().item() > 1e-3, "the trained text encoder should change the image"
    comfy.model_management.unload_all_models()  # the loaded LoraLoader clones hold patched weights until unloaded
    assert all(torch.equal(base[k], v) for k, v in base_weights(model).items()), "the shared MODEL changed"
    assert all(torch.equal(clip_base[k], v) for k, v in _clip_weights(clip).items()), "the shared CLIP changed"
    with torch.inference_mode():
        assert torch.equal(nodes.CLIPTextEncode().encode(clip, PROMPT)[0][0][0], before)


def test_each_step_encodes_the_texts_the_cache_holds_and_unmerged_validation_uses_the_trained_encoder(comfyui):
    """Untrained, the captions through the text encoder are bit for bit what Cache Text cached, for every cached text
    (each caption's tag-shuffled orders) and the empty prompt caption dropout uses; trained,
    they differ, and validation's "unmerged" encodes its prompts through the trained encoder too (its image is the
    as_saved_file one but for the rounding the stock loader bakes in)."""
    from headroom.nodes import train_lora as T

    captions = "ohwx, red, circle, center\nohwx, blue, square\na green triangle\nsmall, yellow, star, left"
    model, clip, vae, latents, texts = _data("sd15", captions=captions, tag_shuffles=2)
    run = _init(model, clip, latents, texts, _unique("te_texts"))
    source = run.trainer.text_cache
    assert not run.trained.text_encoder.reads_t5_from_cache  # no T5: its steps read nothing of the cache
    keys = [key for key in texts.keys() if key in texts.captions]
    orders = [(key, order) for key in keys for order in range(texts.tag_orders(key))]
    assert len(orders) > len(keys) + 2  # shuffled orders are among them

    def encodings():
        with torch.inference_mode(), run.attached():
            return ([source.conditioning(key, order) for key, order in orders], source.empty_conditioning())

    def same(a, b):
        return a.keys() == b.keys() and all(torch.equal(a[name].float(), b[name].float()) for name in a)

    untrained, empty = encodings()
    assert all(same(got, texts.conditioning(key, order)) for got, (key, order) in zip(untrained, orders))
    assert same(empty, texts.empty_conditioning())
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 6)
    trained, _ = encodings()
    assert not any(same(a, b) for a, b in zip(trained, untrained))
    sampling = dict(clip=clip, vae=vae, prompts=PROMPT, negative="", sample_seed=7, sample_steps=2, cfg=3.0,
                    sampler_name="euler", scheduler="simple", width=32, height=32, loss_timesteps=1)
    with torch.inference_mode():
        unmerged = T.HeadroomValidate.execute(run, lora_application="unmerged", **sampling).args[0]
        saved = T.HeadroomValidate.execute(run, **sampling).args[0]
        no_encoder = T.HeadroomValidate.execute(
            _init(model, clip, latents, texts, _unique("te_texts_model_only"), text_encoder_lr=0.0),
            lora_application="unmerged", **sampling).args[0]
    assert (unmerged - saved).abs().max().item() <= 1e-2
    assert (unmerged - no_encoder).abs().max().item() > 1e-3


def _sd3_clip_with_t5(attention_mask: bool = False):
    """The tiny SD3 CLIP (CLIP-L + CLIP-G) with a T5-XXL beside them, as the SD3.5 release's three encoders: one layer
    of T5, as wide as ComfyUI's SD3 text encoder joins it to the CLIP tokens (4096); `attention_mask`: ComfyUI's
    t5_attention_mask option (T5's mask in the conditioning)."""
    import comfy.sd
    import comfy.supported_models_base
    import comfy.text_encoders.sd3_clip as sd3_clip

    from headroom.nodes.bridge.families import sd3
    from headroom.nodes.bridge.tiny_models import init_weights_

    target = comfy.supported_models_base.ClipTarget(sd3_clip.SD3Tokenizer,
                                                    sd3_clip.sd3_clip(t5=True, t5_attention_mask=attention_mask))
    t5 = {"d_model": 4096, "d_ff": 64, "num_layers": 1, "num_heads": 2, "d_kv": 16}
    with torch.inference_mode():
        clip = comfy.sd.CLIP(target, parameters=0, model_options={**sd3.TINY.text_encoder_options,
                                                                  "t5xxl_model_config": t5})
        init_weights_(clip.cond_stage_model, 2 if attention_mask else 1)  # a cache of its own, the mask in it
    return clip


@pytest.mark.parametrize("family, attention_mask", [("flux", False), ("sd3", False), ("sd3", True)])
def test_flux_and_sd3_runs_take_t5s_part_of_each_caption_from_the_cache(comfyui, family, attention_mask):
    """A Flux or SD3 run training CLIP-L (/ CLIP-G) does not run the frozen T5 at its steps: T5's part of each caption
    (Flux: the whole cross_attn; SD3: its rows after the CLIP tokens') is the text cache's, and the conditioning is
    bit for bit the full encode through the CLIP with the trained layers (T5 run), before and after training, for
    every cached text and the empty caption; the planner's measured encode does not run T5 either. Validation's
    prompts, which no cache holds, run T5."""
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.text_encoder_lora import cached_texts

    tags = ["ohwx, red, circle, center", "ohwx, blue, square, top left", "a green triangle, small", "yellow, star"]
    model, clip, vae, latents, texts = _data(family, captions="\n".join(tags), tag_shuffles=1,
                                             clip=_sd3_clip_with_t5(attention_mask) if family == "sd3" else None)
    t5 = clip.cond_stage_model.t5xxl
    runs = []
    t5.register_forward_pre_hook(lambda *_: runs.append(1))
    run = _init(model, clip, latents, texts, _unique(f"te_t5_{family}"), policy=_card_policy())
    source = run.trainer.text_cache
    assert run.trained.text_encoder.reads_t5_from_cache
    assert runs == [1]  # the Init's width check encodes "" through the whole CLIP; its card plan runs no T5
    orders = [(key, order) for key in texts.captions for order in range(texts.tag_orders(key))]
    texts_of = cached_texts(texts)
    assert len(orders) > len(texts.captions)  # shuffled tag orders among them

    def check():
        runs.clear()
        with torch.inference_mode(), run.attached():
            taken = [source.conditioning(key, order) for key, order in orders] + [source.empty_conditioning()]
            assert runs == [], "a step ran T5"
            full = [run.trained.text_encoder.encode(texts_of[key][order]) for key, order in orders]
            full.append(run.trained.text_encoder.encode(""))
        assert len(runs) == len(orders) + 1
        for got, want, cached in zip(taken, full, [*(texts.conditioning(k, o) for k, o in orders),
                                                   texts.empty_conditioning()]):
            assert got.keys() == want.keys() == cached.keys()
            assert all(torch.equal(got[name], want[name]) for name in got)
            t5_rows = want["cross_attn"].shape[0] - (0 if family == "flux" else 77)
            assert torch.equal(got["cross_attn"][-t5_rows:], cached["cross_attn"][-t5_rows:])
        return taken

    untrained = check()
    assert ("attention_mask" in untrained[0]) == attention_mask
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 4)
    trained = check()
    assert not torch.equal(trained[0]["pooled_output"], untrained[0]["pooled_output"])  # CLIP-L learned
    runs.clear()
    caption = texts.captions[orders[0][0]]
    run.trained.text_encoder.training_cost(caption, texts.conditioning(orders[0][0]))
    assert runs == []
    # a cache of fewer rows than T5's tokens (made with another text encoder) is refused, saying what to do
    short = {**texts.conditioning(orders[0][0]), "cross_attn": texts.conditioning(orders[0][0])["cross_attn"][:3]}
    with torch.inference_mode(), run.attached(), pytest.raises(ValueError, match="run Cache Text again"):
        run.trained.text_encoder.encode(caption, short)
    if attention_mask:  # a cache made by this CLIP without its mask option: T5 runs, as the stock encode
        unmasked = {k: v for k, v in texts.conditioning(orders[0][0]).items() if k != "attention_mask"}
        runs.clear()
        with torch.inference_mode(), run.attached():
            got, want = run.trained.text_encoder.encode(caption, unmasked), run.trained.text_encoder.encode(caption)
        assert len(runs) == 2 and all(torch.equal(got[name], want[name]) for name in want)
    with torch.inference_mode():
        T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=PROMPT, negative="", sample_seed=0, sample_steps=1,
                                   cfg=1.0, sampler_name="euler", scheduler="simple", width=32, height=32,
                                   loss_timesteps=1)
    assert runs


def test_a_resumed_run_continues_the_text_encoder_exactly_and_a_kohya_file_maps_onto_the_clip(comfyui, caplog):
    """Straight 6 steps against 3, a new Init of the same run (as after a restart), 3 more: the same weights of the
    model and the text encoder and the same losses, with the text encoder at its own learning rate,
    scale_weight_norms capping the layers of both and an EMA of both. Saved in the kohya format, the text encoder's layers are
    sd-scripts' lora_te_* names (the learning rate in ss_text_encoder_lr), and the stock loader maps all of them."""
    import folder_paths
    import nodes
    from safetensors import safe_open

    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    capped = dict(scale_weight_norms=0.05, ema_decay=0.5)
    straight = _init(model, clip, latents, texts, _unique("te_straight"), **capped)
    name = _unique("te_resumed")
    first = _init(model, clip, latents, texts, name, **capped)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(straight, 6)
        T.HeadroomTrainSteps.execute(first, 3, checkpoint_every=3)
    del first
    second = _init(model, clip, latents, texts, name, **capped)
    assert second.step == 3 and second.resumed
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(second, 6)
    a, b = straight.trainer.trainable.state_dict(), second.trainer.trainable.state_dict()
    assert a.keys() == b.keys() and any(key.startswith("text_encoder.") for key in a)
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run differs from the straight one"
    assert second.trainer.loss_history == straight.trainer.loss_history
    encoder_params = len(second.trained.text_encoder.parameters())
    assert sorted((group["lr"], len(group["params"])) for group in second.trainer.optimizer.param_groups) == \
        [(0.005, encoder_params), (0.01, len(second.adapters.parameters()))]  # text_encoder_lr, learning_rate
    scaled = T.norms_text(second)[0]  # the cap reached both sets' layers: more than the model has are counted
    assert f"of {len(second.adapters.layers) + len(second.trained.text_encoder.paths)} layers" in scaled, scaled
    assert int(scaled.split(": ")[1].split(" of ")[0]) > 0, scaled
    trained = second.trained.text_encoder.comfy_state_dict()
    with second.weights("ema"):  # Save's and Validate's weights "ema": the text encoder's average too
        averaged = second.trained.text_encoder.comfy_state_dict()
    assert any(not torch.equal(trained[key], averaged[key]) for key in trained)

    with torch.inference_mode():
        saved = T.HeadroomSaveLora.execute(second, "headroom/text_encoder", "", "fp32", format="kohya").args[0]
    with safe_open(folder_paths.get_full_path("loras", saved), "pt") as file:
        keys, metadata = list(file.keys()), file.metadata()
    encoder_layers = {key.split(".")[0] for key in keys if key.startswith("lora_te_")}
    assert len(encoder_layers) == len(second.trained.text_encoder.paths)
    assert metadata["ss_text_encoder_lr"] == "0.005"
    caplog.clear()
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        _, lora_clip = nodes.LoraLoader().load_lora(model, clip, saved, 1.0, 1.0)
    assert "lora key not loaded" not in caplog.text, caplog.text
    assert len(lora_clip.patcher.patches) == len(encoder_layers)


def test_what_a_text_encoder_run_cannot_train_is_refused_naming_the_input(comfyui):
    model, clip, vae, latents, texts = _data("sd15")
    refused = [
        (dict(clip=None), r"no clip is connected: connect the CLIP the text cache was made with"),
        (dict(kind="oft"), r"trains a LoRA of kind lora, dora, loha, lokr, and LoRA Config's kind is oft"),
        (dict(optimizer="Prodigy", lr=1.0), r"with Prodigy, which finds one step size"),
        (dict(text_encoder_lr=-1e-4), r"text_encoder_lr -0.0001 is negative"),
    ]
    for change, message in refused:
        with pytest.raises(ValueError, match=r"^Train LoRA: Init \(Headroom\): .*" + message):
            _init(model, change.pop("clip", clip), latents, texts, _unique("te_refused"), **change)
    _, sdxl_clip, _ = _data_clip("sdxl")
    with pytest.raises(ValueError, match=r"the clip encodes captions 64 wide, but the text cache holds them 32 wide"):
        _init(model, sdxl_clip, latents, texts, _unique("te_width"))
    _, chroma_clip, _ = _data_clip("chroma")
    with pytest.raises(ValueError, match=r"has no CLIP text encoder to train"):
        _init(model, chroma_clip, latents, texts, _unique("te_t5"))


def _data_clip(family: str):
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    with torch.inference_mode():
        return build_tiny_models(family, 0)


def _card_policy(**fields):
    from headroom.nodes.memory import HeadroomOffloadPolicy

    settings = dict(vram_budget_gb=0.0, reserve_gb=1.0, base_placement="resident", base_storage="as_loaded",
                    checkpointing="off", checkpoint_depth=1, optimizer_state="gpu",
                    park_optimizer_during_validation=True, vae_tiled_decode="auto", encoders="unload_after_use",
                    card="8 GB")
    return HeadroomOffloadPolicy.execute(**{**settings, **fields}).args[0]


def test_a_plan_counts_the_text_encoder_it_trains_on_the_device(comfyui, monkeypatch):
    """A run training the text encoder: its Init node's card plan and its own plan (the one it places its base by)
    hold in the training step the CLIP as loaded and each caption's activations (what an encode of the run's longest
    caption keeps for backward, times the batch), and count the text encoder's LoRA with the trained tensors (its
    optimizer state, host RAM, checkpoints); the model's share of a budget shrinks by it; the node says how much of
    a step is the text encoder's. A run without it plans as before."""
    import dataclasses

    from family_checks import saved_by_an_encode
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge import planning
    from headroom.training.memory import planner, text_encoder_training

    planned = []
    plan_for_card = T.plan_for_card
    monkeypatch.setattr(T, "plan_for_card", lambda *a, **k: planned.append((a[4], plan_for_card(*a, **k))) or
                        planned[-1][1])  # (the trainable it plans, (plan, measured model))
    captions = ["red", "a red circle with a blue square beside it on a grey ground, seen from above", "blue", "grey"]
    model, clip, vae, latents, texts = _data("sdxl", captions=captions)
    run = _init(model, clip, latents, texts, _unique("te_plan"), policy=_card_policy())
    (trainable, (card_plan, _)), = planned
    encoder = run.trained.text_encoder
    per_caption = saved_by_an_encode(encoder, captions[1])
    assert per_caption > 0
    step = card_plan.phase("training step").items
    assert step[text_encoder_training.WEIGHTS] == clip.patcher.model_size() > 0
    assert step["text encoder activations (2 captions)"] == 2 * per_caption  # batch_size 2
    assert card_plan.text_encoder_bytes() == clip.patcher.model_size() + 2 * per_caption
    # its LoRA: the trainer's tensors (the model's and the text encoder's) are the plan's
    assert trainable.param_count == sum(p.numel() for p in run.trainer.params)
    assert trainable.param_count > sum(p.numel() for p in run.adapters.parameters())
    said = T.opened_text(run)
    assert f"of a step {planner.format_bytes(card_plan.text_encoder_bytes())} for the text encoder" in said, said
    assert "its compute with the work outside the blocks" in card_plan.to_text()

    with torch.inference_mode():
        own = planning.run_plan(run)
        description, own_trainable, shape, budget = planning._run_inputs(run)
    assert own.text_encoder_bytes() == card_plan.text_encoder_bytes()
    assert own_trainable.param_count == trainable.param_count
    assert own_trainable.text_encoder.saved_bytes_per_caption == trainable.text_encoder.saved_bytes_per_caption
    # Its encodes' time (measured with that forward) is in the predicted step: forward and backward of a batch's
    timed = own_trainable.text_encoder
    untimed = dataclasses.replace(own_trainable, text_encoder=dataclasses.replace(timed, forward_s=0.0))
    with_encoder = planner.estimate(description, own_trainable, shape, run.policy, budget).step_time
    without = planner.estimate(description, untimed, shape, run.policy, budget).step_time
    assert timed.forward_s > 0 and with_encoder.compute_s - without.compute_s >= 2 * timed.forward_s * 0.999

    # The same budget with and without the text encoder: "partial" keeps less of the base on the device beside it
    model_only = dataclasses.replace(own_trainable, text_encoder=None,
                                     shapes=tuple(tuple(p.shape) for p in run.adapters.parameters()))
    partial = run.policy.replace(base_placement="partial", checkpointing="blocks")
    alone = planner.estimate(description, model_only, shape, partial,
                             int(planner.estimate(description, model_only, shape, run.policy).peak_bytes * 0.9))
    both = planner.estimate(description, own_trainable, shape, partial, alone.budget_bytes)
    assert alone.text_encoder_bytes() == 0 and "text encoder" not in alone.summary()
    trained_more = 4 * (own_trainable.param_count - model_only.param_count) * 4  # weights, gradients, AdamW's two
    assert both.base_device_bytes < alone.base_device_bytes
    assert alone.base_device_bytes - both.base_device_bytes >= min(alone.base_device_bytes, trained_more)


def test_a_plan_measures_the_text_the_run_encodes_with_the_most_tokens(comfyui, monkeypatch):
    """The caption a plan measures a step's text encoder with is the text the run encodes that has the most of the
    CLIP's tokens, not the most characters: a caption of two alternative lines is encoded a line at a time (one CLIP
    chunk each, though both together make two), and a caption in Japanese of fewer characters makes three chunks."""
    from family_checks import saved_by_an_encode
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.text_encoder_lora import longest_caption

    planned = []
    plan_for_card = T.plan_for_card
    monkeypatch.setattr(T, "plan_for_card", lambda *a, **k: planned.append(plan_for_card(*a, **k)) or planned[-1])
    line = "a red circle with a blue square beside it on a grey ground seen from above in soft light " * 3
    japanese = "東京の夜景、赤い丸と青い四角、灰色の地面、上から見た柔らかい光の中の街並み" * 3
    captions = ["red", f"{line}\n{line}", japanese, "grey"]
    model, clip, vae, latents, texts = _data("sdxl", captions=captions)
    assert len(japanese) < len(line) < len(captions[1])
    assert [len(clip.tokenize(text)["l"]) for text in (line, captions[1], japanese)] == [1, 2, 3]  # CLIP chunks
    assert longest_caption(texts, clip)[0] == japanese
    run = _init(model, clip, latents, texts, _unique("te_tokens"), policy=_card_policy())
    (card_plan, _), = planned
    per_caption = saved_by_an_encode(run.trained.text_encoder, japanese)
    assert per_caption > saved_by_an_encode(run.trained.text_encoder, captions[1])  # three chunks, not two
    assert card_plan.phase("training step").items["text encoder activations (2 captions)"] == 2 * per_caption


def test_memory_plan_plans_a_run_that_trains_the_text_encoder_too(comfyui):
    """Memory Plan with train_text_encoder: the training step holds the CLIP as loaded and a batch of captions'
    activations of one full CLIP chunk (75 tokens), and its trained weights, gradients and optimizer state count the
    text encoder's LoRA at the planned rank; without it the plan is the model's alone. Refused, naming the input: kind
    full, no clip, a CLIP with no CLIP encoder."""
    from family_checks import saved_by_an_encode
    from headroom.nodes.bridge.text_encoder_lora import TextEncoderLora
    from headroom.nodes.memory import HeadroomMemoryPlan
    from headroom.training.core.adapters import AdapterConfig
    from headroom.training.memory import text_encoder_training

    model, clip, _ = _data_clip("sdxl")
    plan = dict(model=model, mode="estimate", batch_size=3, width=64, height=64, rank=4, targets="preset",
                optimizer="AdamW", precision="fp32", text_tokens=0, clip=clip)
    with torch.inference_mode():
        alone = json.loads(HeadroomMemoryPlan.execute(**plan).args[1])
        both = json.loads(HeadroomMemoryPlan.execute(**plan, train_text_encoder=True).args[1])
    step = {phase["phase"]: phase["items"] for phase in both["phases"]}["training step"]
    step_alone = {phase["phase"]: phase["items"] for phase in alone["phases"]}["training step"]
    encoder = TextEncoderLora(clip, AdapterConfig(rank=4, alpha=4.0))
    assert step[text_encoder_training.WEIGHTS] == clip.patcher.model_size()
    assert step["text encoder activations (3 captions)"] == 3 * saved_by_an_encode(encoder, " ".join(["a"] * 75))
    assert not any(name.startswith("text encoder") for name in step_alone)
    encoder_weights = 4 * sum(p.numel() for p in encoder.parameters())
    assert step["trainable weights (fp32)"] - step_alone["trainable weights (fp32)"] == encoder_weights
    assert step["optimizer state (AdamW)"] - step_alone["optimizer state (AdamW)"] == 2 * encoder_weights

    _, chroma_clip, _ = _data_clip("chroma")
    for change, message in [(dict(kind="full"), r"set kind lora and connect the clip \(kind is full\)"),
                            (dict(clip=None), r"set kind lora and connect the clip$"),
                            (dict(clip=chroma_clip), r"has no CLIP text encoder to train")]:
        with torch.inference_mode(), pytest.raises(ValueError, match=r"^Memory Plan \(Headroom\): .*" + message):
            HeadroomMemoryPlan.execute(**{**plan, **change}, train_text_encoder=True)


def test_the_all_in_one_nodes_clip_output_is_what_load_lora_makes_of_its_saved_file(comfyui):
    """Train LoRA (all-in-one) with text_encoder_lr: its clip output encodes as the stock Load LoRA's CLIP of the file
    it saved (save_dtype bf16: the layers as that file holds them), bit for bit, and differs from the clip given."""
    import nodes
    from family_checks import init_inputs
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute("lora", 4, 4.0, "preset", False, 0.0, 0).args[0]
        inputs = {**init_inputs(model, latents, texts, batch_size=2, lr=1e-2), "lora_config": lora,
                  "run_name": _unique("te_all_in_one"), "steps": 3, "validate_every": 0, "save_every": 0,
                  "lora_subfolder": "headroom-tests", "clip": clip, "vae": vae, "prompts": PROMPT, "negative": "",
                  "sample_seed": 0, "sample_steps": 1, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
                  "width": 32, "height": 32, "text_encoder_lr": 5e-3, "save_dtype": "bf16"}
        _, run, name, _, trained_clip = T.HeadroomTrainLora.execute(**inputs).args
        loaded = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 1.0)[1]
        encoded = nodes.CLIPTextEncode().encode(trained_clip, PROMPT)[0][0][0]
        assert torch.equal(encoded, nodes.CLIPTextEncode().encode(loaded, PROMPT)[0][0][0])
        assert not torch.equal(encoded, nodes.CLIPTextEncode().encode(clip, PROMPT)[0][0][0])
    assert run.trained.text_encoder is not None and name.endswith(".safetensors")


@pytest.mark.parametrize("file_format", ["comfyui", "kohya"])
def test_init_lora_continues_a_files_text_encoder_layers_too(comfyui, file_format):
    """init_lora with text_encoder_lr: the run starts from the file's text-encoder layers as well as its model's
    (comfyui or kohya names, mapped as the stock Load LoRA maps them): before its first step its text encoder encodes
    as the source run's did, and the node says how many layers it continued. A file with the model's layers alone
    starts the text encoder anew (it encodes as the CLIP as loaded), said on the node."""
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")

    def encoded(run) -> torch.Tensor:
        with torch.inference_mode(False), torch.no_grad(), run.trained.text_encoder.attached():
            return run.trained.text_encoder.encode(PROMPT)["cross_attn"]

    source = _init(model, clip, latents, texts, _unique("te_source"))
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(source, 6)
        name = T.HeadroomSaveLora.execute(source, "headroom-tests", "", "fp32", format=file_format).args[0]
    continued = _init(model, clip, latents, texts, _unique("te_continued"), init_lora=name)
    layers = len(continued.trained.text_encoder.paths)
    assert f"{layers} of them continued from init_lora" in T.opened_text(continued), T.opened_text(continued)
    trained = encoded(source)
    assert torch.allclose(encoded(continued), trained, rtol=0, atol=1e-5)
    with torch.inference_mode():
        stock = nodes_encode(clip)
    assert not torch.allclose(trained, stock, atol=1e-4)  # the source's text encoder moved

    model_only = _init(model, clip, latents, texts, _unique("te_model_only"), text_encoder_lr=0.0)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(model_only, 2)
        plain = T.HeadroomSaveLora.execute(model_only, "headroom-tests", "", "fp32", format=file_format).args[0]
    anew = _init(model, clip, latents, texts, _unique("te_anew"), init_lora=plain)
    assert "init_lora holds no text-encoder layers: they start anew" in T.opened_text(anew)
    assert torch.allclose(encoded(anew), stock, rtol=0, atol=1e-6)


def nodes_encode(clip) -> torch.Tensor:
    import nodes

    return nodes.CLIPTextEncode().encode(clip, PROMPT)[0][0][0]


def test_a_diffusers_file_holds_the_text_encoders_for_the_stock_loader_and_diffusers(comfyui, caplog):
    """Save LoRA's diffusers format with the text encoder (SDXL: CLIP-L as `text_encoder`, CLIP-G as
    `text_encoder_2`, PEFT's lora_A / lora_B, alpha / rank 0.5 folded into up): the stock Load LoRA maps every layer
    of the model and of both encoders, and encodes as with the comfyui-format file; diffusers' own SDXL reader loads
    each component's layers with its LoraConfig into transformers' CLIP text models, each layer's update the run's."""
    import warnings

    import folder_paths
    import nodes
    import transformers
    from diffusers import StableDiffusionXLPipeline
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sdxl")
    run = _init(model, clip, latents, texts, _unique("te_diffusers"), lr=2e-2, alpha=2.0)  # alpha / rank folded in
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 4)
        names = {file_format: T.HeadroomSaveLora.execute(run, "headroom-tests", f"{run.run_dir.name}_{file_format}",
                                                         "fp32", format=file_format).args[0]
                 for file_format in ("comfyui", "diffusers")}
    assert len(set(names.values())) == 2
    encoder = run.trained.text_encoder
    caplog.clear()
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        loaded = {f: nodes.LoraLoader().load_lora(model, clip, name, 1.0, 1.0) for f, name in names.items()}
    assert "lora key not loaded" not in caplog.text, caplog.text
    lora_model, lora_clip = loaded["diffusers"]
    assert len(lora_model.patches) == len(run.adapters.layers) and len(lora_clip.patcher.patches) == len(encoder.paths)
    with torch.inference_mode():
        plain, comfy_file, diffusers_file = (nodes.CLIPTextEncode().encode(c, PROMPT)[0][0]
                                             for c in (clip, *(c for _, c in loaded.values())))
    for part in (lambda e: e[0], lambda e: e[1]["pooled_output"]):  # as the comfyui file, to 0.1 % of its effect
        effect = (part(comfy_file) - part(plain)).abs().max()
        assert effect > 0 and (part(diffusers_file) - part(comfy_file)).abs().max() <= 1e-3 * effect

    state, alphas, metadata = StableDiffusionXLPipeline.lora_state_dict(
        folder_paths.get_full_path("loras", names["diffusers"]), return_lora_metadata=True)
    for component, ours in (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g")):
        tower = encoder.root.get_submodule(f"{ours}.transformer.text_model")
        layer = tower.encoder.layers[0]
        config = transformers.CLIPTextConfig(
            vocab_size=tower.embeddings.token_embedding.weight.shape[0],
            hidden_size=tower.embeddings.token_embedding.weight.shape[1], intermediate_size=layer.mlp.fc1.out_features,
            num_hidden_layers=len(tower.encoder.layers), num_attention_heads=layer.self_attn.heads,
            max_position_embeddings=tower.embeddings.position_embedding.weight.shape[0])
        model_class = transformers.CLIPTextModel if component == "text_encoder" else \
            transformers.CLIPTextModelWithProjection
        with torch.inference_mode(False), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hf = model_class(config)
            StableDiffusionXLPipeline.load_lora_into_text_encoder(state, alphas, hf, prefix=component,
                                                                  adapter_name="headroom", metadata=metadata)
        assert not [str(w.message) for w in caught if "unexpected" in str(w.message)]
        injected = {name: module for name, module in hf.named_modules() if "headroom" in getattr(module, "lora_A", {})}
        paths = [p for p in encoder.paths if p.startswith(ours + ".")]
        assert len(injected) == len(paths) > 0, (component, len(injected), len(paths))
        flat = not hasattr(hf, "text_model")  # transformers 5's CLIPTextModel: no `text_model.` in its names
        with torch.no_grad():
            for path in paths:
                name = path[len(ours + ".transformer."):]
                theirs = injected[name.removeprefix("text_model.") if flat else name].get_delta_weight("headroom")
                mine = encoder.adapters.layers[path].get_delta_weight("default")
                assert torch.allclose(theirs, mine, rtol=1e-5, atol=1e-7), path
