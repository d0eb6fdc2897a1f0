"""A LoRA on ComfyUI's quantized layers at real width: Flux-dev (3072 wide, one double block) in the
layout of a scaled fp8 release (each block Linear's weight float8_e4m3fn with its scale; the MLP weights 3072 x 12288,
past 2^24 elements), loaded as UNETLoader loads such a file, trained one step, saved; the stock LoraLoaderModelOnly +
KSampler sample from the saved file exactly what Validate (as the saved file) sampled; the fp8 base is unchanged and
the planner counts its stored bytes (1 a weight); the same step with the block streamed through the ring (its fp8
data and scales packed in a host buffer, the QuantizedTensor rebuilt around a slot; the ring run on the CPU) gives
the same loss and LoRA weights bit for bit. tests/comfy/test_ideogram4_fp8.py holds the same on the tiny model
with every kind."""
from __future__ import annotations

import pytest
import torch
from family_checks import scaled_fp8
from safetensors.torch import load_file

pytestmark = [pytest.mark.comfyui, pytest.mark.realsize]

PROMPT = "a red circle in the center"
BLOCKS = ("double_blocks.", "single_blocks.")


def test_a_lora_on_a_scaled_fp8_base_at_flux_width_is_what_the_stock_loader_samples(comfyui, monkeypatch):
    import comfy.model_management
    import comfy.sd
    import nodes
    import realsize_models
    from headroom.nodes import cache as cache_nodes, data as data_nodes, train_lora as T
    from headroom.nodes.bridge.comfy_model import quantized_layers
    from headroom.training.memory import planner, policy as policy_module
    from headroom.training.memory.policy import OffloadPolicy
    from headroom.training.memory.weight_streaming import WeightStreamer

    with torch.inference_mode():  # as ComfyUI's loaders and nodes run
        model, clip, vae = realsize_models.build_family("flux_dev", (1, 0), t5_layers=1)
        fp8 = comfy.sd.load_diffusion_model_state_dict(scaled_fp8(model.model.diffusion_model.state_dict(), BLOCKS))
        del model
        layers = quantized_layers(fp8.model)
        diffusion = fp8.model.diffusion_model
        largest = max(m.weight.numel() for m in diffusion.modules() if type(m.weight if hasattr(m, "weight") else None)
                      .__name__ == "QuantizedTensor")
        base = {k: v.clone() for k, v in diffusion.state_dict().items()}
        images, captions, _ = data_nodes.HeadroomSyntheticDataset.execute(2, 64, 0).args
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, captions, 64, 64, "center", False, 0).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
        lora = T.HeadroomLoraConfig.execute("lora", 8, 8.0, "preset", False, 0.0, 0).args[0]
        optimizer = T.HeadroomOptimizerConfig.execute("AdamW", 2e-3, 0.0, "constant", 0, 100).args[0]
        def init(name, policy=None):
            return T.HeadroomTrainLoraInit.execute(
                model=fp8, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=optimizer,
                run_name=name, seed=0, batch_size=1, grad_accumulation=1, precision="auto", max_grad_norm=1.0,
                caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0,
                noise_offset=0.0, gradient_checkpointing=True, checkpoint_depth=1, holdout=0, policy=policy).args[0]

        run = init("fp8_flux_width")
        loss = float(T.HeadroomTrainSteps.execute(run, 1).args[1])  # one AdamW step gives the LoRA an effect
        trained_weights = {k: v.detach().clone() for k, v in run.adapters.state_dict().items()}
        T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=PROMPT, negative="", loss_timesteps=1,
                                   lora_application="as_saved_file", sample_seed=3, sample_steps=2, cfg=1.0,
                                   sampler_name="euler", scheduler="simple", width=64, height=64)
        validation = load_file(str(run.run_dir.validation_dir / f"step_{run.step:08d}_latents.safetensors"))["samples"]
        trained = len(run.adapters.layers)
        name = T.HeadroomSaveLora.execute(run, "tests", "", "fp32").args[0]
        run.release()
        positive = nodes.CLIPTextEncode().encode(clip, PROMPT)[0]
        negative = nodes.CLIPTextEncode().encode(clip, "")[0]
        empty = nodes.EmptyLatentImage().generate(64, 64, 1)[0]
        lora_model = nodes.LoraLoaderModelOnly().load_lora_model_only(fp8, name, 1.0)[0]
        sampled = dict(seed=3, steps=2, cfg=1.0, sampler_name="euler", scheduler="simple", positive=positive,
                       negative=negative, latent=empty)
        stock = nodes.common_ksampler(lora_model, **sampled)[0]["samples"].float()
        comfy.model_management.unload_all_models()  # the patched clone gives the shared weights back
        plain = nodes.common_ksampler(fp8, **sampled)[0]["samples"].float()
        streamers = []

        class Exercised(WeightStreamer):  # as on a device: the block's frozen weights through the ring
            def __init__(self, blocks, device, **options):
                super().__init__(blocks, device, **{**options, "exercise_on_cpu": True, "record": True})
                streamers.append(self)

            def detach(self):
                self.per_block = self.streamed_bytes()  # the packed blocks, before they are let go
                super().detach()

        monkeypatch.setattr(policy_module, "WeightStreamer", Exercised)
        streamed_run = init("fp8_flux_width_streamed", OffloadPolicy(base_placement="streamed", checkpointing="blocks"))
        streamed_loss = float(T.HeadroomTrainSteps.execute(streamed_run, 1).args[1])
        streamed_weights = {k: v.detach().clone() for k, v in streamed_run.adapters.state_dict().items()}
        per_block = streamers[-1].per_block
        streamed_run.release()
    now = diffusion.state_dict()
    as_bytes = {k: (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v) for k, v in base.items()}
    fp8_numel = sum(v.numel() for v in base.values() if v.dtype == torch.float8_e4m3fn)
    other = sum(v.nbytes for k, v in base.items() if v.dtype != torch.float8_e4m3fn and not k.endswith("comfy_quant"))
    print(f"\nFlux-dev width as scaled fp8: {len(layers)} quantized layers (largest {largest / 2 ** 24:.2f} x 2^24), "
          f"{trained} trained, loss {loss:.4f}; as saved vs stock max abs diff {(validation - stock).abs().max():.3g}, "
          f"LoRA effect {(stock - plain).norm():.4g}; frozen bytes {planner.frozen_bytes(diffusion) / 2 ** 30:.3f} GiB")
    assert len(layers) > 0 and largest > 2 ** 24 and loss == loss
    assert len(lora_model.patches) >= trained > 0
    assert torch.equal(validation, stock)
    assert not torch.equal(plain, stock), "the LoRA should change the sample"
    assert all(torch.equal(as_bytes[k], now[k].view(torch.uint8) if now[k].dtype == torch.float8_e4m3fn else now[k])
               for k in base)
    assert planner.frozen_bytes(diffusion) == fp8_numel + other  # 1 byte an fp8 weight, its scales, the rest as loaded
    streamer = streamers[-1]
    print(f"streamed through the ring: {max(per_block, default=0) / 2 ** 20:.0f} MB a block, loss {streamed_loss:.4f}")
    assert streamed_loss == loss and streamed_weights.keys() == trained_weights.keys()
    assert all(torch.equal(streamed_weights[k], trained_weights[k]) for k in trained_weights)
    assert streamer.fetches > 0 and streamer.fallback_fetches == 0 and max(per_block) > 2 ** 28
