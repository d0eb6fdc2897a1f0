"""Full fine-tuning (LoRA Config kind "full", training/core/adapters.FullLayer) through the nodes on a tiny model:
it learns, resumes exactly, leaves the shared MODEL unchanged, and what it saves goes through stock nodes only:
Load LoRA applies it (the run's validation image, reproduced), stock Save Model / Save Checkpoint write the merged
model: exactly the base weights plus the trained difference, under the input's keys."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import pytest
import torch
from test_train_lora_nodes import _base_weights, _data, _init, _no_adapter_attached

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]

SAMPLING = dict(sample_seed=3, sample_steps=3, cfg=2.0, sampler_name="euler", scheduler="normal", width=32, height=32)


def test_full_finetune_overfits_four_images_and_leaves_the_shared_model_unchanged(comfyui):
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15", count=4)
    base = _base_weights(model)
    run = _init(model, latents, texts, "full_overfit", kind="full", targets="all_layers", lr=1e-3,
                schedule="cosine", schedule_steps=200)
    trained = sum(p.numel() for p in run.adapters.parameters())
    weights = sum(v.numel() for k, v in base.items() if k.rsplit(".", 1)[0] in run.adapters.layers)
    with torch.inference_mode():
        initial = run.loss_on(run.train_items)
        for target in range(50, 201, 50):  # stop as soon as the loss on the training items has halved
            T.HeadroomTrainSteps.execute(run, target)
            final = run.loss_on(run.train_items)
            if final <= 0.5 * initial:
                break
    print(f"full fine-tune: {trained} trained weights (every Linear / Conv2d), {run.step} steps, loss {initial:.4f} -> "
          f"{final:.4f}")
    assert trained == weights > 0  # the whole of every targeted layer: weights and biases
    assert final <= 0.5 * initial
    after = _base_weights(model)
    assert all(torch.equal(base[k], after[k]) for k in base), "the shared MODEL's weights changed"
    assert _no_adapter_attached(model)


def test_extracting_a_lora_needs_a_full_finetune(comfyui):
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "lora_not_full", rank=4)
    with pytest.raises(ValueError, match=r"Extract LoRA from Full Fine-tune \(Headroom\): a LoRA is extracted from a full fine-tune .*kind lora: "
                                         "save it with Save LoRA"):
        T.HeadroomExtractLora.execute(run, 8, 0.0, "headroom", "", "fp32")


def test_full_finetune_resumes_exactly(comfyui):
    model, clip, vae, latents, texts = _data("sd15")
    _resumes_exactly(model, latents, texts, "full", kind="full", targets="all_layers", lr=1e-3, batch_size=2,
                     caption_dropout=0.25)


def test_a_run_folder_of_the_difference_layout_resumes_on_one_copy(comfyui):
    """Checkpoints written before issue 42 hold the trained difference D ("<layer>.full_weight" / ".full_bias") and
    its EMA: resuming converts them once to the run's own weights W' = W + D (the EMA's likewise) and the run goes on
    as the run that never stopped (to fp32 rounding: W + (W' - W) is W' within an ulp)."""
    import json

    from safetensors.torch import load_file, save_file

    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    settings = dict(kind="full", targets="all_layers", lr=1e-3, batch_size=2, ema_decay=0.9)
    straight = _init(model, latents, texts, "full_layout_straight", **settings)
    old = _init(model, latents, texts, "full_layout_old", **settings)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(straight, 6)
        T.HeadroomTrainSteps.execute(old, 3)
        # The checkpoint rewritten as the old layout wrote it: differences under the old names, the EMA of them.
        differences = dict(old.adapters.differences())
        at_three = old.adapters.state_dict()
        folder = old.run_dir.path / json.loads((old.run_dir.path / "latest.json").read_text())["checkpoint"]
        adapter = load_file(str(folder / "adapter.safetensors"))
        names = list(old.adapters.state_dict(copy=False))  # the parameter order: the EMA's names are its indices
        assert sorted(names) == sorted(adapter)
        # A copy: before 0.8, safetensors' load_file returns views of a mapping of the file, which save_file below
        # rewrites in place (the EMA read here would change under the comparison)
        ema = {name: tensor.clone() for name, tensor in load_file(str(folder / "ema.safetensors")).items()}
        bases = {}
        for path, layer in old.adapters.layers.items():
            weight, bias = layer.read_base(torch.device("cpu"))
            bases[f"{path}.full_trained_weight"], bases[f"{path}.full_trained_bias"] = weight, bias
        old_adapter = {key.replace(".full_trained_", ".full_"): differences[
            key.replace(".full_trained_", ".")] for key in names}
        old_ema = {name: ema[name] - bases[key] for name, key in zip(sorted(ema), names)}
        old.release()
        save_file(old_adapter, str(folder / "adapter.safetensors"))
        save_file(old_ema, str(folder / "ema.safetensors"))
        resumed = _init(model, latents, texts, "full_layout_old", **settings)
        assert resumed.step == 3
        assert sorted(resumed.adapters.state_dict()) == sorted(names)
        # Converted once: W + D is W' to fp32 rounding (within an ulp of W' and one of D), the EMA's likewise.
        converted, converted_ema = resumed.adapters.state_dict(), resumed.trainer.ema.state_dict()
        for key, name in zip(names, sorted(ema)):
            torch.testing.assert_close(converted[key], at_three[key], rtol=3e-7, atol=1e-9)
            torch.testing.assert_close(converted_ema[name], ema[name], rtol=3e-7, atol=1e-9)
        T.HeadroomTrainSteps.execute(resumed, 6)
    # Then it trains on as the straight run does: AdamW divides by the gradients' own size, so an ulp of difference
    # may move a weight whose gradient is near zero by a fraction of a step; within 10 % of the steps' movement.
    a, b = straight.adapters.state_dict(), resumed.adapters.state_dict()
    moved = max((a[key] - at_three[key]).abs().max().item() for key in a)
    assert moved > 0 and max((b[key] - a[key]).abs().max().item() for key in a) <= 0.1 * moved
    assert resumed.step == straight.step == 6


def _resumes_exactly(model, latents, texts, name, **settings):
    """A run trained 3 + 3 steps (released and opened again between) ends where a run of 6 steps does, bit for bit;
    returns the straight run."""
    from headroom.nodes import train_lora as T

    straight = _init(model, latents, texts, f"{name}_straight", **settings)
    interrupted = _init(model, latents, texts, f"{name}_resumed", **settings)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(straight, 6)
        T.HeadroomTrainSteps.execute(interrupted, 3)
        interrupted.release()
        resumed = _init(model, latents, texts, f"{name}_resumed", **settings)
        assert resumed.step == 3
        T.HeadroomTrainSteps.execute(resumed, 6)
    a, b = straight.adapters.state_dict(), resumed.adapters.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return straight


def test_full_finetune_is_saved_for_the_stock_loaders(comfyui, tmp_path):
    import comfy.model_detection
    import comfy.model_management
    import comfy.utils
    import folder_paths
    import nodes
    from comfy_extras.nodes_model_merging import CheckpointSave, ModelSave
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.tiny_models import build_tiny_model_patcher

    model, clip, vae, latents, texts = _data("sd15")
    base = _base_weights(model)
    run = _init(model, latents, texts, "full_saved", kind="full", targets="all_layers", lr=1e-2)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 5)
        images = T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts="a green cross", negative="",
                                            loss_timesteps=1, **SAMPLING).args[0]
        for file_format in ("kohya", "diffusers"):  # whole-weight differences: only ComfyUI's loader reads them
            with pytest.raises(ValueError, match=f"kind full cannot be saved in the {file_format} format"):
                T.HeadroomSaveLora.execute(run, "headroom", f"full_{file_format}", "fp32", file_format)
        name = T.HeadroomSaveLora.execute(run, "headroom", "", "fp32").args[0]
        saved = comfy.utils.load_torch_file(folder_paths.get_full_path_or_raise("loras", name))
        assert {k.rsplit(".", 1)[1] for k in saved} == {"diff", "diff_b"}

        # The stock Load LoRA applies it to the shared MODEL: the run's validation image, from stock sampling.
        lora_model, _ = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)
        assert len(lora_model.patches) == len(saved)

        def sample(m):
            positive = nodes.CLIPTextEncode().encode(clip, "a green cross")[0]
            negative = nodes.CLIPTextEncode().encode(clip, "")[0]
            empty = nodes.EmptyLatentImage().generate(32, 32, 1)[0]
            return nodes.VAEDecode().decode(vae, nodes.common_ksampler(m, 3, 3, 2.0, "euler", "normal", positive,
                                                                       negative, empty)[0])[0]

        stock = sample(lora_model)
        assert (images - stock).abs().max().item() <= 1e-3

        # A LoRA extracted from the differences (Extract LoRA node): with every singular direction kept it is the
        # same model through the stock loader; with rank 2 a small file whose every key the stock loader maps.
        every = T.HeadroomExtractLora.execute(run, 4096, 0.0, "headroom", "full_saved_every", "fp32").args[0]
        assert (sample(nodes.LoraLoader().load_lora(model, clip, every, 1.0, 0.0)[0]) - stock).abs().max() <= 1e-3
        small = T.HeadroomExtractLora.execute(run, 2, 0.0, "headroom", "full_saved_r2", "fp32")
        extracted = comfy.utils.load_torch_file(folder_paths.get_full_path_or_raise("loras", small.args[0]))
        ranks = {v.shape[0] for k, v in extracted.items() if k.endswith(".lora_down.weight")}
        assert max(ranks) == 2 and re.search(r"\(rank [12]-2, ", small.ui["text"][0]), (ranks, small.ui)
        small_model = nodes.LoraLoader().load_lora(model, clip, small.args[0], 1.0, 0.0)[0]
        assert len(small_model.patches) == len(saved)  # every trained weight and bias, none left out
        # the training captions' tag counts, as Save LoRA writes them (caption_tags off: none)
        from safetensors import safe_open

        def metadata(lora_name):
            with safe_open(folder_paths.get_full_path_or_raise("loras", lora_name), "pt") as handle:
                return handle.metadata()

        assert json.loads(metadata(small.args[0])["ss_tag_frequency"]) == json.loads(
            metadata(name)["ss_tag_frequency"]) != {}
        private = T.HeadroomExtractLora.execute(run, 2, 0.0, "headroom", "full_saved_r2_private", "fp32",
                                                caption_tags=False).args[0]
        assert "ss_tag_frequency" not in metadata(private)

        # Stock Save Model / Save Checkpoint write the merged model. A tiny model is no released configuration, so
        # ComfyUI's detection cannot name it and Load Diffusion Model / Load Checkpoint refuse it: their own steps after
        # detection load it here (the prefix they find, BaseModel.load_model_weights into a fresh model of the same
        # config); tests/realsize loads real-width files with the named loaders.
        prefix = f"full_saved_{tmp_path.name}"
        ModelSave().save(lora_model, f"diffusion_models/{prefix}")
        CheckpointSave().save(lora_model, clip, vae, f"checkpoints/{prefix}")
        output = pathlib.Path(folder_paths.get_output_directory())
        files = [next((output / folder).glob(f"{prefix}_*.safetensors")) for folder in ("diffusion_models", "checkpoints")]
        differences = dict(run.adapters.differences())  # {"<layer>.weight" | "<layer>.bias": W' - W}
        for file in files:
            state = comfy.utils.load_torch_file(str(file))
            unet_prefix = comfy.model_detection.unet_prefix_from_state_dict(state)
            weights = {k[len(unet_prefix):]: v for k, v in state.items() if k.startswith(unet_prefix)}
            assert weights.keys() == base.keys(), file.name  # the input's key layout, every key
            for key, weight in weights.items():
                layer, kind = key.rsplit(".", 1)
                difference = differences.get(key)
                expected = base[key] if difference is None else (base[key].float() + difference).to(base[key].dtype)
                assert torch.equal(weight, expected), (file.name, key)
            loaded = build_tiny_model_patcher("sd15", seed=7)  # other random weights: all of them must be replaced
            loaded.model.load_model_weights(state, unet_prefix)
            assert (sample(loaded) - stock).abs().max().item() <= 1e-5, file.name
    # Stock ComfyUI patches the shared modules in place while a Load LoRA clone is loaded and restores them when it
    # unloads: once unloaded, the shared MODEL holds its own weights again.
    comfy.model_management.unload_all_models()
    after = _base_weights(model)
    assert all(torch.equal(base[k], after[k]) for k in base), "the shared MODEL's weights changed"


def _fused_policy(**fields):
    from headroom.training.memory.policy import OffloadPolicy

    return OffloadPolicy(fused_backward=True, **fields)


def test_fused_backward_trains_the_weights_of_the_plain_step(comfyui):
    """The Offload Policy's fused_backward steps each trained tensor inside backward (no full set of gradients):
    in fp32, without clipping (a global norm needs every gradient at once), a run's weights equal the plain run's
    bit for bit, step after step, and at most one gradient exists at a time; with the optimizer state in host RAM
    (optimizer_state cpu: each tensor stepped there) too."""
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    common = dict(kind="full", targets="all_layers", lr=1e-3, schedule="cosine", schedule_steps=10, max_grad_norm=0.0)
    plain = _init(model, latents, texts, "full_plain", **common)
    fused = _init(model, latents, texts, "full_fused", policy=_fused_policy(), **common)
    on_host = _init(model, latents, texts, "full_fused_host", policy=_fused_policy(optimizer_state="cpu"), **common)
    with torch.inference_mode():
        for run in (plain, fused, on_host):
            T.HeadroomTrainSteps.execute(run, 4)
    a = plain.adapters.state_dict()
    assert any(torch.any(v != 0) for v in a.values())  # it trained
    for run in (fused, on_host):
        b = run.adapters.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert run.trainer.optimizer.most_gradients_alive == 1
        assert plain.trainer.loss_history == run.trainer.loss_history
    assert on_host.trainer.optimizer.state_on_host


def test_trained_weights_in_host_ram_train_the_weights_of_the_fused_host_step(comfyui):
    """The Offload Policy's trained_weights host: the differences are made in host RAM and stay there whenever ComfyUI
    loads the model (each layer's copy crosses to the compute device when it runs: on this CPU both are the host;
    tests/unit/test_trained_weights_on_host.py runs the crossing on CUDA); the run tells ComfyUI it keeps no trained
    weight on the device, trains the weights of the same run with them on the device, validates, and a run saved with
    them on the device resumes with them in host RAM. An adapter run refuses it, naming the Init node."""
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    common = dict(kind="full", targets="all_layers", lr=1e-3, max_grad_norm=0.0)
    host_state = _fused_policy(optimizer_state="cpu")
    on_device = _init(model, latents, texts, "full_weights_device", policy=host_state, **common)
    on_host = _init(model, latents, texts, "full_weights_host", policy=host_state.replace(trained_weights="host"),
                    **common)
    with torch.inference_mode():
        for run in (on_device, on_host):
            T.HeadroomTrainSteps.execute(run, 3)
        images = T.HeadroomValidate.execute(on_host, clip=clip, vae=vae, prompts="a green cross", negative="",
                                            loss_timesteps=1, **SAMPLING).args[0]
    assert images.shape[0] == 1 and torch.isfinite(images).all()
    assert all(p.device.type == "cpu" for p in on_host.adapters.parameters())
    a, b = on_device.adapters.state_dict(), on_host.adapters.state_dict()
    assert any(torch.any(v != 0) for v in b.values()) and all(torch.equal(a[k], b[k]) for k in a)
    assert on_device.trainer.loss_history == on_host.trainer.loss_history
    weights = sum(p.numel() * p.element_size() for p in on_host.trainer.params)
    assert on_device.trained.device_extra_bytes(on_device.trainer) - on_host.trained.device_extra_bytes(
        on_host.trainer) == weights
    with torch.inference_mode():  # saved with the weights on the device, resumed with them in host RAM
        resumed = _init(model, latents, texts, "full_weights_device", policy=host_state.replace(trained_weights="host"),
                        **common)
    assert resumed.trainer.step == 3 and all(torch.equal(a[k], v) for k, v in resumed.adapters.state_dict().items())
    with pytest.raises(ValueError, match=r"Train LoRA: Init \(Headroom\): trained_weights 'host' .* this run trains a lora"):
        _init(model, latents, texts, "lora_weights_host", policy=host_state.replace(trained_weights="host"))


def test_blocks_whose_trained_weights_the_policy_keeps_on_the_card(comfyui):
    """trained_weights_card_blocks (a card's plan fills it in): with the trained weights in host RAM, the layers of
    those blocks are made on the compute device and never cross, the rest as before; the run trains the weights of
    the run with every layer on the device, tells ComfyUI it keeps those layers' weights there, and a block index the
    model does not have is refused, naming the field."""
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.comfy_model import training_blocks

    model, clip, vae, latents, texts = _data("sd15")
    common = dict(kind="full", targets="all_layers", lr=1e-3, max_grad_norm=0.0)
    on_device = _init(model, latents, texts, "full_split_device", policy=_fused_policy(), **common)
    split = _init(model, latents, texts, "full_split_blocks", policy=_fused_policy(  # the state streamed too
        trained_weights="host", trained_weights_card_blocks="0,2", optimizer_state="streamed"), **common)
    with torch.inference_mode():
        for run in (on_device, split):
            T.HeadroomTrainSteps.execute(run, 3)
    a, b = on_device.adapters.state_dict(), split.adapters.state_dict()
    assert any(torch.any(v != 0) for v in b.values()) and all(torch.equal(a[k], b[k]) for k in a)
    names = [name for name, _ in training_blocks(split.placement.patcher.model.diffusion_model)]
    kept = [path for path in split.adapters.layers if (path + ".").startswith((names[0] + ".", names[2] + "."))]
    assert kept and set(kept) == split.adapters.on_card
    assert all(split.adapters.layers[path].crossings is None for path in kept)
    assert all(layer.crossings is split.trainer.optimizer.crossings for path, layer in split.adapters.layers.items()
               if path not in kept)
    card_bytes = sum(p.numel() * p.element_size() for path in kept
                     for _, p in split.adapters._own_parameters(split.adapters.layers[path]))
    assert split.trained.device_extra_bytes(split.trainer) == card_bytes > 0  # no state kept there either
    assert "2 blocks' on the card" in split.policy.describe()
    with pytest.raises(ValueError, match=r"trained_weights_card_blocks: block 999 does not exist: this model has"):
        _init(model, latents, texts, "full_split_beyond", policy=_fused_policy(
            trained_weights="host", trained_weights_card_blocks="0,999"), **common)


def test_trained_weights_in_host_ram_stepped_where_their_state_is(comfyui):
    """Issue 42 item 3: trained_weights host with optimizer_state gpu: each layer's backward hands its gradients to
    the step on the compute device (FusedBackward.step_on_device; on this CPU the host, so the hand-over is what is
    checked) instead of autograd: bf16 copies with stochastic rounding and per-tensor clipping train the weights of the
    same run with them on the device, with every block checkpointed, the state stays where the step runs, and the run
    resumes exactly."""
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    common = dict(kind="full", targets="all_layers", lr=1e-3, max_grad_norm=0.05, full_precision="bf16_stochastic",
                  optimizer="Adafactor", batch_size=2, gradient_checkpointing=True)  # recomputed: hooks unpack
    on_device = _init(model, latents, texts, "full_state_gpu", policy=_fused_policy(), **common)
    stepped = _resumes_exactly(model, latents, texts, "full_weights_host_state_gpu",
                               policy=_fused_policy(trained_weights="host"), **common)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(on_device, 6)
    fused = stepped.trainer.optimizer
    assert fused.step_device == stepped.trainer.denoiser.device and not fused.state_on_host
    assert all(layer.device_step == fused.step_on_device and layer.crossings is fused.crossings
               for layer in stepped.adapters.layers.values())
    # each weight crossed in twice per step (forward; the recompute and backward on one copy), its update back once
    assert fused.crossings.to_host_bytes > 0 and fused.crossings.to_device_bytes == 2 * fused.crossings.to_host_bytes
    assert fused.most_gradients_alive == 1 and len(fused.state) == len(fused.params)
    a, b = on_device.adapters.state_dict(), stepped.adapters.state_dict()
    assert any(torch.any(v != 0) for v in b.values()) and all(torch.equal(a[k], b[k]) for k in a)
    assert on_device.trainer.loss_history == stepped.trainer.loss_history
    # optimizer_state streamed: the state in host RAM between steps, crossing with its tensor for the step on the
    # device (memory/streamed_optimizer_state.py): the same weights, resumed exactly, no state counted on the device
    streamed = _resumes_exactly(model, latents, texts, "full_weights_host_state_streamed",
                                policy=_fused_policy(trained_weights="host", optimizer_state="streamed"), **common)
    b = streamed.adapters.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a) and on_device.trainer.loss_history == streamed.trainer.loss_history
    fused = streamed.trainer.optimizer
    assert fused.streamed_state is not None and len(fused.state) == len(fused.params)
    to_device, to_host = fused.streamed_state.bytes_each_way
    state = sum(v.numel() * v.element_size() for s in fused.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    assert to_host == 6 * state and to_device == 5 * state  # each step back once, in once from the second step
    assert streamed.trained.device_extra_bytes(streamed.trainer) == 0


def test_bf16_weights_with_stochastic_rounding_learn_and_resume_exactly(comfyui):
    """full_precision bf16_stochastic: the trained weights are bf16 (half the memory), each update rounded stochastically
    in the fused step; it learns like the fp32 run, and a resumed run continues the rounding noise exactly."""
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15", count=4)
    with torch.inference_mode():
        initial = _init(model, latents, texts, "bf16_initial", kind="full").loss_on([0, 1, 2, 3])
    straight = _resumes_exactly(model, latents, texts, "bf16", kind="full", targets="all_layers", lr=1e-3,
                                full_precision="bf16_stochastic", policy=_fused_policy(), batch_size=2)
    assert all(p.dtype == torch.bfloat16 for p in straight.adapters.parameters())
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(straight, 50)
        final = straight.loss_on(straight.train_items)
    print(f"bf16 trained weights, stochastic rounding: loss {initial:.4f} -> {final:.4f} in 50 steps")
    assert final <= 0.6 * initial


def test_fused_backward_and_bf16_weights_refuse_what_they_cannot_do(comfyui):
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    with pytest.raises(ValueError, match="turn fused_backward on in the Offload Policy"):
        _init(model, latents, texts, "bf16_unfused", kind="full", full_precision="bf16_stochastic")
    with pytest.raises(ValueError, match="grad_accumulation 2 needs the gradients of several passes kept"):
        _init(model, latents, texts, "fused_accum", kind="full", policy=_fused_policy(), grad_accumulation=2)
    with pytest.raises(ValueError, match="before fp16's gradient scaler"):
        _init(model, latents, texts, "fused_fp16", kind="full", policy=_fused_policy(), precision="fp16")
    with pytest.raises(ValueError, match=r"LoRA Config \(Headroom\): .*full_precision bf16_stochastic is for kind full"):
        T.HeadroomLoraConfig.execute("lora", 8, 8.0, "preset", False, 0.0, 0, full_precision="bf16_stochastic")


def test_a_run_resumed_with_fused_backward_switched_says_so(comfyui):
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(_init(model, latents, texts, "fused_switch", kind="full"), 1)
        with pytest.raises(ValueError, match="saved with the Offload Policy's fused_backward off: set it off"):
            _init(model, latents, texts, "fused_switch", kind="full", policy=_fused_policy())


def test_on_a_device_the_trained_layers_base_stays_in_host_ram(comfyui, monkeypatch):
    """Issue 42: on a device a full fine-tune's training load puts every block in host RAM (ComfyUI's own partial unload,
    not a full load) and the streamer brings back what the plan keeps, less the trained layers' base layers (`unread`:
    FullLayer computes with its own copy). Resident: every block kept, none streamed. The plan counts those weights in
    host RAM and validation (as the saved file) with them. On the CPU nothing is loaded apart: the device check is made
    to pass and the load's ComfyUI calls are recorded."""
    from headroom.nodes.bridge import comfy_bridge, planning
    from headroom.training.memory import planner
    from headroom.training.memory.policy import OffloadPolicy

    model, _, _, latents, texts = _data("flux", count=2)
    run = _init(model, latents, texts, "full_base_in_host_ram", kind="full", targets="all_linear", batch_size=2,
                policy=OffloadPolicy(checkpointing="blocks"))
    unread = run.trained.unread_base_layers()
    assert len(unread) == len(run.adapters.layers) > 0
    assert run._plan_streamer() is False and run.trainer.stream_options == {}  # a CPU: no plan, nothing to place
    patcher = run.placement.patcher
    monkeypatch.setattr(patcher, "offload_device", torch.device("meta"))
    describe = planning.describe_comfy_model  # as a GPU's model describes itself (on a CPU nothing is left apart)
    monkeypatch.setattr(planning, "describe_comfy_model",
                        lambda *args, **kwargs: dataclasses.replace(describe(*args, **kwargs), compute_device="cuda"))
    with torch.inference_mode():
        plan = planning.run_plan(run)
        assert run._plan_streamer()
    blocks = comfy_bridge.training_blocks(patcher.model.diffusion_model)
    options = run.trainer.stream_options
    assert options["unread"] == unread and options["resident"] == plan.resident_blocks == tuple(range(len(blocks)))
    base = sum(planner.frozen_bytes(layer) for layer in unread)
    training, validation = plan.phase("training step").items, plan.phase("validation").items
    host = plan.host_bytes["trained layers' base weights (the training step never reads them)"]
    assert host == base > 0
    frozen = planner.frozen_bytes(model.model.diffusion_model)
    assert (training["frozen weights outside the blocks"] + training["frozen block weights (as_loaded)"]
            == frozen - base)
    assert validation["frozen weights outside the blocks"] + validation["frozen block weights (as_loaded)"] == frozen
    # The load: not ComfyUI's full load (the blocks would all come to the device beside the trained copies), and then
    # everything it placed there back to host RAM.
    loads, freed = [], []
    monkeypatch.setattr(comfy_bridge.comfy.model_management, "load_models_gpu",
                        lambda models, memory_required=0, force_full_load=False: loads.append(force_full_load))
    monkeypatch.setattr(patcher, "partially_unload", lambda device, memory_to_free=0: freed.append(memory_to_free))
    monkeypatch.setattr(patcher, "loaded_size", lambda: 10 * frozen)
    run.placement.load([patcher], 0, run._base_device_share(), whole_blocks=True)
    assert loads == [False] and freed == [10 * frozen]
    # A LoRA reads its base: nothing unread, and a resident LoRA run places nothing itself.
    lora = _init(model, latents, texts, "lora_reads_its_base", rank=4, batch_size=2,
                 policy=OffloadPolicy(checkpointing="blocks"))
    assert lora.trained.unread_base_layers() == [] and not lora._plan_streamer()
