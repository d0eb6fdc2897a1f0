"""Checks every model a LoRA is trained on must pass, shared by the family conformance tests
(tests/comfy/test_family_conformance.py: every registry family) and the generic-model tests (tests/comfy/test_generic_model.py:
a ComfyUI model no family module describes)."""
from __future__ import annotations

import json
import logging

import pytest
import torch


def _block_linears_stored(state_dict: dict, blocks: tuple[str, ...], store) -> dict:
    """`state_dict` with each block Linear's weight (keys under one of `blocks`) replaced by `store(prefix, weight)`'s
    entries; the rest as it is."""
    out = {}
    for key, tensor in state_dict.items():
        if key.startswith(blocks) and key.endswith(".weight") and tensor.ndim == 2:
            out.update(store(key[:-len("weight")], tensor))
        else:
            out[key] = tensor
    return out


def scaled_fp8(state_dict: dict, blocks: tuple[str, ...]) -> dict:
    """A diffusion model's weights in the layout of a scaled fp8 release: each block Linear's weight (keys under one of
    `blocks`) in float8_e4m3fn with its per-tensor `scale_weight`, and the `scaled_fp8` marker ComfyUI's loader
    converts (comfy.utils.convert_old_quants) into its quantized layers; the rest as it is."""
    def store(prefix, weight):
        scale = weight.abs().max().float() / 448.0
        return {prefix + "weight": (weight.float() / scale).to(torch.float8_e4m3fn),
                prefix + "scale_weight": scale.reshape(())}

    return {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn), **_block_linears_stored(state_dict, blocks, store)}


def int8_tensorwise(state_dict: dict, blocks: tuple[str, ...]) -> dict:
    """Each block Linear's weight (keys under one of `blocks`) as int8 with its per-tensor `weight_scale` and the
    `comfy_quant` marker ComfyUI's mixed-precision loader builds its INT8 layers from; the rest as it is."""
    marker = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode("utf-8")), dtype=torch.uint8)

    def store(prefix, weight):
        scale = weight.abs().max().float() / 127.0
        return {prefix + "weight": (weight.float() / scale).round().clamp(-127, 127).to(torch.int8),
                prefix + "weight_scale": scale.reshape(()), prefix + "comfy_quant": marker.clone()}

    return _block_linears_stored(state_dict, blocks, store)


def loaded_as_a_file(state_dict: dict, config_class, unet_extra_config: dict):
    """The MODEL ComfyUI's UNETLoader builds from `state_dict` (its quantized layers too). Its detection fixes part
    of a released geometry through the config class's unet_extra_config: the tiny model's is given here."""
    import comfy.sd

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(config_class, "unet_extra_config", unet_extra_config)
        with torch.inference_mode():  # as UNETLoader runs (its QuantizedTensors are inference tensors)
            return comfy.sd.load_diffusion_model_state_dict(state_dict)


def image_size(model) -> int:
    """The test images' side: 32 px, or two latent pixels where the VAE downscales more (HunyuanImage 2.1: 32x), or two
    patches of a pixel-space model whose position ids need an image of more than one patch (HiDream-O1's 32 px)."""
    downscale = model.model.latent_format.spacial_downscale_ratio
    patch = getattr(model.model.diffusion_model, "patch_size", None)
    pixel_patch = patch if isinstance(patch, int) and downscale == 1 else 1
    return max(32, 2 * downscale, 2 * pixel_patch)


def cached_data(model, clip, vae, count=4, resolution=None, seed=0):
    """(latent_cache, text_cache) of `count` synthetic images through the real dataset and caching nodes."""
    from headroom.nodes import cache as cache_nodes, data as data_nodes

    resolution = resolution or image_size(model)
    with torch.inference_mode():  # as ComfyUI runs nodes
        images, captions, _ = data_nodes.HeadroomSyntheticDataset.execute(count, resolution, seed).args
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, captions, resolution, resolution, "center",
                                                                False, 0).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
    return latents, texts


def control_data(model, clip, vae, count=4, resolution=64, seed=0):
    """(latent_cache, text_cache) of `count` synthetic shapes with their control images (cached as pixels), through
    the real dataset and caching nodes: the caches LoRA and ControlNet Init nodes both open runs on."""
    from headroom.nodes import cache as cache_nodes
    from headroom.training.data.synthetic import generate_shapes

    shapes = generate_shapes(count, resolution, seed)
    with torch.inference_mode():  # as ComfyUI runs nodes
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(
            shapes.images, "\n".join(shapes.captions), resolution=resolution, step=64, crop="center", flip=False,
            seed=seed, control_images=shapes.control_images).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae, "pixels").args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
    return latents, texts


def init_inputs(model, latents, texts, batch_size=1, lr=1e-3) -> dict:
    """The inputs LoRA and ControlNet Init nodes share (but run_name), with plain settings: AdamW at `lr`, fp32, no
    checkpointing, no holdout."""
    from headroom.nodes.train_lora import HeadroomOptimizerConfig

    optimizer = HeadroomOptimizerConfig.execute("AdamW", lr, 0.0, "constant", 0, 1000).args[0]
    return dict(model=model, latent_cache=latents, text_cache=texts, optimizer_config=optimizer, seed=0,
                batch_size=batch_size, grad_accumulation=1, precision="fp32", max_grad_norm=1.0, caption_dropout=0.0,
                timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0, noise_offset=0.0,
                gradient_checkpointing=False, checkpoint_depth=1, holdout=0)


def init_run(model, latents, texts, run_name, rank, lr, targets, include_conv, schedule="constant", steps=1000,
             kind="lora"):
    from headroom.nodes import train_lora as T

    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute(kind, rank, float(rank), targets, include_conv, 0.0, 0).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", lr, 0.0, schedule, 0, steps).args[0]
        return T.HeadroomTrainLoraInit.execute(
            model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt,
            run_name=run_name, seed=0, batch_size=4, grad_accumulation=1, precision="fp32", max_grad_norm=1.0,
            caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0,
            noise_offset=0.0, gradient_checkpointing=False, checkpoint_depth=1, holdout=0).args[0]


# Validation settings of the all-in-one vs Validate checks: a short sampling, one loss timestep.
VALIDATION = dict(prompts="a red circle moving right", negative="", sample_seed=7, sample_steps=2, cfg=3.0,
                  sampler_name="euler", scheduler="simple", loss_timesteps=1)


def train_all_in_one(model, latents, texts, clip, vae, run_name, steps, size, frames, **video):
    """The run the all-in-one Train LoRA node trains to `steps` and validates at the end (VALIDATION, clips of
    `frames`, `video`: its start_image / frame_rate inputs)."""
    from headroom.nodes import train_lora as T

    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute("lora", 8, 8.0, "preset", False, 0.0, 0).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", 2e-2, 0.0, "constant", 0, 1000).args[0]
        return T.HeadroomTrainLora.execute(
            model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt,
            run_name=run_name, seed=0, batch_size=2, grad_accumulation=1, precision="fp32", max_grad_norm=1.0,
            caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0,
            noise_offset=0.0, gradient_checkpointing=False, checkpoint_depth=1, holdout=0, steps=steps,
            validate_every=0, save_every=0, lora_subfolder="headroom/all_in_one", clip=clip, vae=vae, width=size,
            height=size, frames=frames, **VALIDATION, **video).args[1]


def validation_samples(run) -> torch.Tensor:
    """The sampled latents the run's last validation saved (at its current step)."""
    from safetensors.torch import load_file

    return load_file(run.run_dir.validation_dir / f"step_{run.step:08d}_latents.safetensors")["samples"]


def validate_samples(run, clip, vae, size, frames, **video) -> torch.Tensor:
    """The sampled latents of Validate on `run` with the all-in-one checks' settings and `video` inputs."""
    from headroom.nodes import train_lora as T

    with torch.inference_mode():
        T.HeadroomValidate.execute(run, clip=clip, vae=vae, width=size, height=size, frames=frames, **VALIDATION,
                                   **video)
    return validation_samples(run)


def overfit(run) -> tuple[float, float]:
    """Train until the loss on the training items halves (checked every 50 steps, at most 300 steps);
    returns (initial, final) loss."""
    from headroom.nodes import train_lora as T

    with torch.inference_mode():
        initial = run.loss_on(run.train_items)
        for target in range(50, 301, 50):
            T.HeadroomTrainSteps.execute(run, target)
            final = run.loss_on(run.train_items)
            if final <= 0.5 * initial:
                break
    return initial, final


def base_weights(model):
    return {k: v.detach().clone() for k, v in model.model.diffusion_model.state_dict().items()}


def empty_latent(model, width: int, height: int, frames: int = 1) -> dict:
    """An empty LATENT of the model's own format (channels, downscale, frames), as its stock empty-latent node makes
    (clips, frames > 1: the stock EmptyHunyuanLatentVideo, which Wan workflows start from, EmptyHunyuanVideo15Latent
    for HunyuanVideo 1.5's 32-channel 16x latents, or EmptyLTXVLatentVideo for LTX-2's 128-channel 32x / 8x ones)."""
    latent_format = model.model.latent_format
    if frames > 1:
        from comfy_extras.nodes_hunyuan import EmptyHunyuanLatentVideo, EmptyHunyuanVideo15Latent
        from comfy_extras.nodes_lt import EmptyLTXVLatentVideo

        node = {32: EmptyHunyuanVideo15Latent, 128: EmptyLTXVLatentVideo}.get(latent_format.latent_channels,
                                                                            EmptyHunyuanLatentVideo)
        return node.execute(width, height, frames, 1).args[0]
    downscale = latent_format.spacial_downscale_ratio
    frames = (1,) if latent_format.latent_dimensions == 3 else ()  # video-VAE families (Wan 2.1 latents): one frame
    return {"samples": torch.zeros(1, latent_format.latent_channels, *frames, height // downscale, width // downscale)}


def check_stock_round_trip(run, model, clip, vae, caplog, steps_trained=20, label="", frames=1, frame_rate=None):
    """Train, validate through stock samplers, save; the stock LoraLoader + KSampler reproduce the validation image
    (<= 1e-3) with zero "lora key not loaded", every trained layer patched, and the base weights unchanged.
    frames > 1: a clip of a video model, every decoded frame compared. frame_rate: the stock chain sets it with
    LTXVConditioning (LTX-2), and validation must have used it. Returns the max abs difference."""
    import comfy.model_management
    import nodes
    from headroom.nodes import train_lora as T

    base = base_weights(model)
    prompt = "a red circle at the center"
    seed, steps, cfg, sampler, scheduler = 7, 4, 3.0, "euler", "simple"
    size = image_size(model)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, steps_trained)
        images = T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=prompt, negative="", sample_seed=seed,
                                            sample_steps=steps, cfg=cfg, sampler_name=sampler, scheduler=scheduler,
                                            width=size, height=size, loss_timesteps=1, frames=frames).args[0]
        name = T.HeadroomSaveLora.execute(run, "headroom/conformance", "", "fp32").args[0]

    caplog.clear()
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        lora_model, _ = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)
        positive = nodes.CLIPTextEncode().encode(clip, prompt)[0]
        negative = nodes.CLIPTextEncode().encode(clip, "")[0]
        if frame_rate is not None:
            from comfy_extras.nodes_lt import LTXVConditioning

            positive, negative = LTXVConditioning.execute(positive, negative, frame_rate).args
        empty = empty_latent(model, size, size, frames)
        stock = nodes.VAEDecode().decode(vae, nodes.common_ksampler(lora_model, seed, steps, cfg, sampler, scheduler,
                                                                     positive, negative, empty)[0])[0]
        plain = nodes.VAEDecode().decode(vae, nodes.common_ksampler(model, seed, steps, cfg, sampler, scheduler,
                                                                    positive, negative, empty)[0])[0]
    assert "lora key not loaded" not in caplog.text, caplog.text
    assert len(lora_model.patches) == len(run.adapters.layers), "a trained layer was not patched by the stock loader"
    assert images.shape == stock.shape == (frames, size, size, 3), (images.shape, stock.shape)
    difference = (images - stock).abs().max().item()
    print(f"{label}: validation image vs LoraLoader+KSampler: max abs diff {difference:.2e}; "
          f"{len(run.adapters.layers)} layers")
    assert difference <= 1e-3
    assert (plain - stock).abs().max().item() > 1e-3, "the LoRA should change the image"
    comfy.model_management.unload_all_models()  # a loaded LoraLoader clone holds patched weights until unloaded
    after = base_weights(model)
    assert all(torch.equal(base[k], after[k]) for k in base), "the shared MODEL's weights changed"
    return difference


def check_start_image_round_trip(data, stock_node, run_name, label, node, size, frames, caplog):
    """Image-to-video (tests/comfy/test_wan_i2v.py, test_hunyuan_video15_i2v.py): train, validate (start image: the
    first clip's first frame, by default), save; the stock LoraLoader + CLIPTextEncode + the family's start-image node
    (`stock_node(positive, negative, vae, start) -> (positive, negative, latent)`, that frame as start_image) +
    KSampler + VAEDecode give the same frames; the LoRA and the start image each change them; compare_base's base row
    and a start image given to Validate follow the same chain; the shared MODEL is unchanged.
    `data`: (model, clip, vae, moving-shape clips, latent cache with start images, text cache)."""
    import comfy.model_management
    from headroom.nodes import train_lora as T
    from headroom.training.core.validation_grid import grid_cells

    import nodes

    model, clip, vae, clips, latents, texts = data
    base = base_weights(model)
    run = init_run(model, latents, texts, run_name, 8, 2e-2, "preset", False)
    prompt, seed, steps, cfg, sampler, scheduler = "a red circle moving right", 7, 4, 3.0, "euler", "simple"
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 20)
        images = T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=prompt, negative="", sample_seed=seed,
                                            sample_steps=steps, cfg=cfg, sampler_name=sampler, scheduler=scheduler,
                                            width=size, height=size, loss_timesteps=1, frames=frames,
                                            compare_base=True).args[0]
        name = T.HeadroomSaveLora.execute(run, f"headroom/{run_name}", "", "fp32").args[0]

    def stock(model_patcher, start):
        positive = nodes.CLIPTextEncode().encode(clip, prompt)[0]
        negative = nodes.CLIPTextEncode().encode(clip, "")[0]
        positive, negative, latent = stock_node(positive, negative, vae, start)
        return nodes.VAEDecode().decode(vae, nodes.common_ksampler(model_patcher, seed, steps, cfg, sampler, scheduler,
                                                                    positive, negative, latent)[0])[0]

    caplog.clear()
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        lora_model, _ = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)
        with_lora = stock(lora_model, clips.clips[0][:1])
        other_start = stock(lora_model, clips.clips[1][:1])
        plain = stock(model, clips.clips[0][:1])
    assert "lora key not loaded" not in caplog.text, caplog.text
    assert len(lora_model.patches) == len(run.adapters.layers)
    assert images.shape == with_lora.shape == (frames, size, size, 3)
    difference = (images - with_lora).abs().max().item()
    print(f"{label} clip: validation vs LoraLoader+{node}+KSampler: max abs diff {difference:.2e}; "
          f"{len(run.adapters.layers)} layers")
    assert difference <= 1e-3
    assert (plain - with_lora).abs().max().item() > 1e-3, "the LoRA should change the clip"
    assert (other_start - with_lora).abs().max().item() > 1e-3, "the start image should change the clip"
    # compare_base: the base row is the MODEL alone from the same start image (8-bit PNG).
    before_after = next(run.run_dir.validation_dir.glob("step_*_before_after.png"))
    before = torch.from_numpy(grid_cells(before_after)[0]).float() / 255.0  # the top row's cells: the clip's frames
    torch.testing.assert_close(before, plain.float(), atol=1 / 255 + 1e-6, rtol=0)

    # A start image given to Validate is the one the clips start from.
    with torch.inference_mode():
        given = T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=prompt, negative="", sample_seed=seed,
                                           sample_steps=steps, cfg=cfg, sampler_name=sampler, scheduler=scheduler,
                                           width=size, height=size, loss_timesteps=1, frames=frames,
                                           start_image=clips.clips[1][:1]).args[0]
    assert (given - other_start).abs().max().item() <= 1e-3
    comfy.model_management.unload_all_models()
    after = base_weights(model)
    assert all(torch.equal(base[k], after[k]) for k in base), "the shared MODEL's weights changed"


def cached_clips(tiny_name, size, frames, start_image="none", count=4, seed=0):
    """(model, clip, vae, moving-shape clips, latent cache, text cache) of a tiny video model, the clips' start images
    cached through the stock node `start_image` names (image-to-video tests)."""
    from headroom.nodes import cache as cache_nodes
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.data.synthetic import generate_moving_shapes
    from headroom.training.data.video import dataset_from_clips

    with torch.inference_mode():
        model, clip, vae = build_tiny_models(tiny_name, 0)
    clips = generate_moving_shapes(count, size, frames, seed)
    dataset = dataset_from_clips(list(clips.clips), clips.captions, resolution=size, step=16)
    with torch.inference_mode():
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae, start_image=start_image).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
    return model, clip, vae, clips, latents, texts


def blocks_backward_skips(model, run) -> tuple[list, int]:
    """One training step of `run` (through HeadroomTrainSteps) with a hook on each of the base's training blocks: (the
    blocks, how many leading ones had outputs needing no gradient: autograd runs no backward through them). Checks
    that every block ran and that the ones after them all needed one."""
    from headroom.nodes.bridge.comfy_model import training_blocks
    from headroom.nodes.train_lora import HeadroomTrainSteps

    needs_gradient = {}

    def record(name):
        def hook(module, args, output):
            if torch.is_grad_enabled():
                leaves = output if isinstance(output, (tuple, list)) else [output]
                needs_gradient[name] = any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)
        return hook

    blocks = training_blocks(model.model.diffusion_model)
    handles = [block.register_forward_hook(record(name)) for name, block in blocks]
    try:
        HeadroomTrainSteps.execute(run, run.step + 1)
    finally:
        for handle in handles:
            handle.remove()
    assert set(needs_gradient) == {name for name, _ in blocks}
    flags = [needs_gradient[name] for name, _ in blocks]
    skipped = flags.index(True)
    assert not any(flags[:skipped]) and all(flags[skipped:])
    return blocks, skipped


def controlnet_plan_over_step(run, description=None) -> dict[bool, tuple[float, float]]:
    """A ControlNet run's plan (its own step's calibration, as planning._run_inputs plans it) against what its training
    forward keeps for backward (the planner's counter on the run's step, base and ControlNet blocks), by whether every
    block is checkpointed: (planned, kept) bytes of the blocks and the rest; without checkpointing what they save
    (weight copies included), with it the inputs of the blocks that hold them (the base's first blocks, which run no
    backward, hold none) and the rest's saved. `description`: the model planned otherwise (the bench's from a LoRA's
    calibration). For the tests and bench/bench_step_prediction.py."""
    from headroom.nodes.bridge import planning
    from headroom.nodes.bridge.comfy_model import training_blocks
    from headroom.nodes.bridge.controlnet_build import controlnet_trainable
    from headroom.training.memory import planner

    diffusion_model = run.source_model.model.diffusion_model
    base = [block for _, block in training_blocks(diffusion_model)]
    own = [block for _, block in run.trainer.denoiser.blocks()[len(base):]]
    assert own, "not a ControlNet run"
    weights = [*diffusion_model.parameters(), *diffusion_model.buffers(), *run.controlnet.parameters()]
    with torch.inference_mode(False), torch.enable_grad():  # nodes run in inference mode, as ComfyUI runs them
        step = planner.measure_activations(lambda: run.trainer._micro_step_loss(0)[0], base + own, weights=weights)
    config = run.config
    # its block times fitted from the calibration (not timed at the run's size: activations are the question here)
    description = description or planning.describe_comfy_model(run.source_model, planning.AdapterConfig(),
                                                                config.train.precision, controlnet=run.controlnet)
    trainable = controlnet_trainable(run.source_model, config.blocks, config.optimizer.name, config.dtype)
    shape = planning.cache_run_shape(run.source_model, run.latent_cache, run.text_cache, config.train.batch_size, "test")
    assert len(description.blocks) == len(base)
    compared = {}
    for checkpointing in (False, True):
        policy = run.trainer.policy.replace(checkpointing="blocks" if checkpointing else "off", checkpoint_blocks="")
        items = planner.estimate(description, trainable, shape, policy).phase("training step").items
        outside = items["saved activations outside the blocks"]
        compared[checkpointing] = (
            (items["checkpointed block inputs"] + outside, sum(step.block_inputs[trainable.without_backward:])
             + step.outside_saved) if checkpointing else
            (items["saved activations, all blocks"] + items["weight copies kept for backward, all blocks (manual cast)"]
             + outside, sum(step.block_saved) + sum(step.block_weight_copies) + step.outside_saved))
    return compared


def saved_by_an_encode(encoder, caption: str) -> int:
    """What `caption`'s encode through a text-encoder LoRA (nodes/bridge/text_encoder_lora.TextEncoderLora) keeps for
    backward, counted here apart from the planner's measurement: each distinct storage autograd saves that is none of
    the CLIP's or the LoRA's weights."""
    saved: dict[int, int] = {}
    held = []

    def pack(tensor):
        key = tensor.untyped_storage().data_ptr()
        if key not in weights:
            saved.setdefault(key, tensor.untyped_storage().nbytes())
            held.append(tensor)  # addresses stay unique while counting
        return None

    with encoder.attached():  # the LoRA's weights among the CLIP's
        weights = {t.untyped_storage().data_ptr() for t in [*encoder.root.parameters(), *encoder.root.buffers()]}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
            encoder.encode(caption)
    return sum(saved.values())
