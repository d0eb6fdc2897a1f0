"""Ideogram 4 is released in fp8 only (Comfy-Org's ideogram4_fp8_scaled.safetensors, the file workflows/ideogram4_lora
names). The stock UNETLoader builds that file's layers as ComfyUI's mixed-precision ops (QuantizedTensor weights, not
torch Linear layers). A LoRA trains on them as they are: the tiny Ideogram 4 converted to the scaled fp8 file layout
and loaded as UNETLoader loads it, trained, saved, loaded by the stock LoraLoaderModelOnly onto the same fp8 MODEL;
Headroom's validation (as the saved file) samples what stock KSampler samples, bit for bit. Kinds peft cannot put on
such layers are refused at Init by name; the weight streamer carries them (bit for bit); the planner counts their
stored bytes."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from family_checks import cached_data, empty_latent, loaded_as_a_file, scaled_fp8

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]
SAMPLING = dict(sample_seed=3, sample_steps=3, cfg=2.0, sampler_name="euler", scheduler="simple")
PROMPT = "a red circle"
QUANTIZED = r"this MODEL's layers hold ComfyUI's quantized weights \(12 layers, e\.g\. layers\.0\.attention\.qkv: a scaled fp8"


@pytest.fixture(scope="module")
def fp8_model(comfyui):
    """(fp8 MODEL, plain MODEL, clip, vae, latent cache, text cache)."""
    import comfy.supported_models

    from headroom.nodes.bridge.families import ideogram4
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, clip, vae = build_tiny_models("ideogram4", seed=0)
    latents, texts = cached_data(model, clip, vae)
    state_dict = scaled_fp8(model.model.diffusion_model.state_dict(), ("layers.",))
    fp8 = loaded_as_a_file(state_dict, comfy.supported_models.Ideogram4, ideogram4._TinyIdeogram4.unet_extra_config)
    return fp8, model, clip, vae, latents, texts


def _init(fp8_model, kind, run_name, policy=None):
    from headroom.nodes import train_lora as T

    fp8, _, _, _, latents, texts = fp8_model
    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute(kind, 4, 4.0, "preset", False, 0.0, 0).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", 2e-2, 0.0, "constant", 0, 1000).args[0]
        return T.HeadroomTrainLoraInit.execute(
            model=fp8, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt,
            run_name=run_name, seed=0, batch_size=4, grad_accumulation=1, precision="fp32", max_grad_norm=1.0,
            caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0,
            noise_offset=0.0, gradient_checkpointing=True, checkpoint_depth=1, holdout=0, policy=policy).args[0]


def test_the_stock_loader_builds_quantized_layers(fp8_model):
    from headroom.nodes.bridge import families
    from headroom.nodes.bridge.comfy_model import quantized_layers
    from headroom.training.core.adapters import is_linear

    fp8, model = fp8_model[:2]
    qkv = fp8.model.diffusion_model.layers[0].attention.qkv
    assert families.family_of(fp8.model).name == "ideogram4"
    assert not isinstance(qkv, torch.nn.Linear) and is_linear(qkv) and type(qkv.weight).__name__ == "QuantizedTensor"
    assert len(quantized_layers(fp8.model)) == 2 * 6 and quantized_layers(model.model) == []  # 6 Linears a block


# the LoRA case also on the oldest declared torch: fp8 is how most Flux / Ideogram users hold their base (torch 2.8's
# CPU could not index a float8 weight, and every fp8 run failed at its start there)
@pytest.mark.parametrize("kind", [pytest.param("lora", marks=pytest.mark.min_torch), "dora", "oft", "full"])
def test_a_lora_trains_on_scaled_fp8_and_validation_is_the_stock_sample(fp8_model, kind):
    """Loss falls, the trained weights are fp32, the fp8 base is unchanged bit for bit; the saved file loads in stock
    LoraLoaderModelOnly onto the fp8 MODEL (every trained layer patched) and KSampler samples exactly what Validate
    (lora_application as_saved_file) sampled."""
    import comfy.model_management
    import nodes

    from headroom.nodes import train_lora as T

    fp8, _, clip, vae = fp8_model[:4]
    base = {k: v.clone() for k, v in fp8.model.diffusion_model.state_dict().items()}
    run = _init(fp8_model, kind, f"fp8_{kind}")
    with torch.inference_mode():
        before = run.loss_on(run.train_items)
        T.HeadroomTrainSteps.execute(run, 10)
        after = run.loss_on(run.train_items)
        T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=PROMPT, negative="", loss_timesteps=1, width=32,
                                   height=32, lora_application="as_saved_file", **SAMPLING)
        validation = load_file(str(run.run_dir.validation_dir / f"step_{run.step:08d}_latents.safetensors"))["samples"]
        name = T.HeadroomSaveLora.execute(run, "headroom/fp8", "", "fp32").args[0]
        positive = nodes.CLIPTextEncode().encode(clip, PROMPT)[0]
        negative = nodes.CLIPTextEncode().encode(clip, "")[0]
        lora_model = nodes.LoraLoaderModelOnly().load_lora_model_only(fp8, name, 1.0)[0]
        ksampler = (SAMPLING["sample_seed"], SAMPLING["sample_steps"], SAMPLING["cfg"], SAMPLING["sampler_name"],
                    SAMPLING["scheduler"], positive, negative, empty_latent(fp8, 32, 32))
        stock = nodes.common_ksampler(lora_model, *ksampler)[0]["samples"].float()
        comfy.model_management.unload_all_models()  # the patched clone gives the shared weights back
        plain = nodes.common_ksampler(fp8, *ksampler)[0]["samples"].float()
    print(f"{kind}: loss {before:.4f} -> {after:.4f}; as saved vs stock max abs diff "
          f"{(validation - stock).abs().max().item():.3g}")
    assert after < before
    assert {p.dtype for p in run.adapters.parameters()} == {torch.float32}
    assert len(lora_model.patches) >= len(run.adapters.layers)  # every trained layer patched by the stock loader
    assert torch.equal(validation, stock)
    assert not torch.equal(plain, stock), "the LoRA should change the sample"
    now = fp8.model.diffusion_model.state_dict()
    assert all(torch.equal(base[k].view(torch.uint8) if base[k].dtype == torch.float8_e4m3fn else base[k],
                           now[k].view(torch.uint8) if now[k].dtype == torch.float8_e4m3fn else now[k]) for k in base)
    run.release()


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_kinds_peft_cannot_put_on_quantized_layers_are_refused_at_init(fp8_model, kind):
    with pytest.raises(ValueError, match=rf"^Train LoRA: Init \(Headroom\): {QUANTIZED}.*LoRA Config \(Headroom\) "
                                         rf"kind {kind} cannot train on them.*choose kind lora, dora, oft or full"):
        _init(fp8_model, kind, f"fp8_{kind}")


@pytest.mark.parametrize("placement", ["streamed", "partial"])
def test_the_ring_streams_a_quantized_base_bitwise(fp8_model, monkeypatch, placement):
    """The weight streamer carries ComfyUI's QuantizedTensor weights (their fp8 data and scales packed like any
    tensor, the QuantizedTensor rebuilt around views of the slot at install): its whole machinery run on the CPU
    (CPU->CPU copies; "partial": block 0 kept resident, block 1 through the ring) trains the same losses and LoRA
    weights, bit for bit, as the resident base, and gives the host weights back unchanged."""
    from headroom.nodes import train_lora as T
    from headroom.training.memory import policy as policy_module
    from headroom.training.memory.policy import OffloadPolicy
    from headroom.training.memory.weight_streaming import WeightStreamer

    streamers, slot_buffers = [], []

    class Exercised(WeightStreamer):  # as on a device: every block's frozen weights through the ring
        def __init__(self, blocks, device, **options):
            resident = (0,) if placement == "partial" else ()
            super().__init__(blocks, device, **{**options, "exercise_on_cpu": True, "record": True,
                                                "resident": resident})
            streamers.append(self)

        def attach(self):
            attached = super().attach()
            # Every slot kept alive to the end: on a CPU the slots and the host buffers share one allocator, and a
            # later host buffer may take a detached slot's address (torch 2.8 did), which the last check would read
            # as the host weight living in the ring.
            slot_buffers.extend(slot.buffer for slot in self._ring)
            return attached

    monkeypatch.setattr(policy_module, "WeightStreamer", Exercised)
    fp8 = fp8_model[0]
    layers = fp8.model.diffusion_model.layers
    streamed_layer = layers[1].attention.qkv  # the base layer (peft wraps it for the run)
    fp8_data = streamed_layer.weight._qdata.view(torch.uint8).clone()
    seen = []
    handle = streamed_layer.register_forward_pre_hook(  # the weight it runs on, and the ring's slots then
        lambda module, args: seen.append((module.weight, set(streamers[-1].slot_pointers()) if streamers else set())))
    results = []
    try:
        for name, policy in (("resident", OffloadPolicy(checkpointing="blocks")),
                             (placement, OffloadPolicy(base_placement=placement, checkpointing="blocks"))):
            run = _init(fp8_model, "lora", f"fp8_ring_{placement}_{name}", policy)
            with torch.inference_mode():
                losses = [float(T.HeadroomTrainSteps.execute(run, step).args[1]) for step in (1, 2, 3)]
            results.append((losses, {k: v.detach().clone() for k, v in run.adapters.state_dict().items()}))
            run.release()
    finally:
        handle.remove()
    (resident_losses, resident_weights), (losses, weights) = results
    assert losses == resident_losses
    assert resident_weights.keys() == weights.keys()
    assert all(torch.equal(resident_weights[k], weights[k]) for k in weights)
    streamer = streamers[-1]
    assert {phase for phase, _ in streamer.install_log} == {"forward", "backward"}
    assert {block for _, block in streamer.install_log} == ({1} if placement == "partial" else {0, 1})
    assert streamer.fetches > 0 and streamer.fallback_fetches == 0 and not streamer.active
    # the streamed run's forwards ran on a QuantizedTensor rebuilt around views of a ring slot (fp8 data and scale)
    ring = [(w, slots) for w, slots in seen if slots]
    assert ring and all(type(w).__name__ == "QuantizedTensor" and isinstance(w, torch.nn.Parameter)
                        and not w.requires_grad
                        and w._qdata.dtype == torch.float8_e4m3fn
                        and w._qdata.untyped_storage().data_ptr() in slots
                        and w._params.scale.untyped_storage().data_ptr() in slots for w, slots in ring)
    host = streamed_layer.weight  # the host weight back on the layer, unchanged
    assert type(host).__name__ == "QuantizedTensor" and torch.equal(host._qdata.view(torch.uint8), fp8_data)
    assert all(host._qdata.untyped_storage().data_ptr() not in slots for _, slots in ring)


def test_the_planner_counts_the_quantized_storage_and_may_stream_it(fp8_model):
    """The blocks' frozen bytes are what the fp8 file stores (1 byte a weight, its scales, the rest as loaded), not
    the dequantised dtype the QuantizedTensor reports; each layer's weight is dequantised for its product (in flight);
    plans may stream such a base (the ring carries it as stored) but never store it low-bit again."""
    from headroom.nodes.bridge import planning
    from headroom.training.core.adapters import AdapterConfig
    from headroom.training.memory import planner
    from headroom.training.memory.policy import OffloadPolicy

    fp8, model = fp8_model[:2]
    described = planning.describe_comfy_model(fp8, AdapterConfig(rank=4, alpha=4), "fp32")
    plain = planning.describe_comfy_model(model, AdapterConfig(rank=4, alpha=4), "fp32")
    for profile, block in zip(described.blocks, fp8.model.diffusion_model.layers, strict=True):
        stored = block.state_dict()  # ComfyUI's own: the fp8 data, scales, and a comfy_quant marker per layer
        assert profile.param_bytes == sum(t.nbytes for k, t in stored.items() if not k.endswith("comfy_quant"))
    fp8_numel = sum(t.numel() for t in fp8.model.diffusion_model.state_dict().values()
                    if t.dtype == torch.float8_e4m3fn)
    # the tiny model is fp32 on the CPU: each fp8 weight 3 bytes less than its fp32 original, plus one fp32 scale a layer
    assert sum(b.param_bytes for b in plain.blocks) - sum(b.param_bytes for b in described.blocks) == \
        3 * fp8_numel - 4 * 12
    assert described.weight_copy_in_flight_bytes == 4 * fp8.model.diffusion_model.layers[0].attention.qkv.weight.numel()
    assert described.quantized_layers == 12 and plain.quantized_layers == 0
    candidates = planner.candidate_policies(OffloadPolicy())
    assert {p.base_placement for p in candidates} == {"resident", "partial", "streamed"}
    assert planner._storages(OffloadPolicy(), described) == ["as_loaded"]
    # a streamed plan carries the stored (fp8) bytes through the ring: two blocks' buffers, the rest in host RAM
    trainable = planner.TrainableSpec(((4, 512), (1536, 4)) * 12, "AdamW")
    shape = planner.RunShape(batch=4, width=32, height=32)
    streamed = OffloadPolicy(base_placement="streamed", checkpointing="blocks")
    plan = planner.estimate(described, trainable, shape, streamed)
    assert plan.host_bytes["streamed block weights"] == sum(b.param_bytes for b in described.blocks)
    assert plan.phase("training step").items["streamed block buffers (2 blocks)"] == 2 * max(
        b.param_bytes for b in described.blocks)


def test_flux_blocks_made_safe_for_in_place_inputs_train_on_scaled_fp8(comfyui):
    """Flux's blocks update their inputs in place, so checkpointing guards them with saved-tensor hooks
    (training/memory/checkpointing._inplace_safe) that see every saved tensor, the quantized layers' saved
    QuantizedTensor weights too (no storage of their own: reading it raised before). Found at real width
    (tests/realsize/test_quantized_base_real_width.py); the tiny Flux as scaled fp8 takes the same path."""
    import comfy.sd

    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.comfy_model import quantized_layers
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, clip, vae = build_tiny_models("flux", seed=0)
    latents, texts = cached_data(model, clip, vae)
    state_dict = scaled_fp8(model.model.diffusion_model.state_dict(), ("double_blocks.", "single_blocks."))
    with torch.inference_mode():
        fp8 = comfy.sd.load_diffusion_model_state_dict(state_dict)
        assert quantized_layers(fp8.model)
        lora = T.HeadroomLoraConfig.execute("lora", 4, 4.0, "preset", False, 0.0, 0).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", 2e-2, 0.0, "constant", 0, 1000).args[0]
        run = T.HeadroomTrainLoraInit.execute(
            model=fp8, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt,
            run_name="fp8_flux_inplace", seed=0, batch_size=2, grad_accumulation=1, precision="fp32",
            max_grad_norm=1.0, caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none",
            min_snr_gamma=5.0, noise_offset=0.0, gradient_checkpointing=True, checkpoint_depth=1, holdout=0).args[0]
        loss = float(T.HeadroomTrainSteps.execute(run, 2).args[1])
    assert loss == loss
    run.release()
