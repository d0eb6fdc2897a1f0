"""Compute precision of a run: "auto" (the default) picks the device's fast precision, a CPU never silently takes
the slow bf16 path, the choice is said in the node's output and log, and a resumed run keeps what it started with."""
from __future__ import annotations

import logging

import pytest
import torch

from headroom.training.core.trainer import PRECISIONS, auto_precision

pytestmark = pytest.mark.comfyui


def test_auto_precision_per_device(monkeypatch):
    assert auto_precision("cpu") == "fp32"
    assert auto_precision(torch.device("cpu")) == "fp32"
    # CUDA: bf16 where the device supports it, else fp16 (no GPU here: the capability query answers instead)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert auto_precision("cuda") == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert auto_precision("cuda:0") == "fp16"


def _caches():
    from headroom.nodes import cache as cache_nodes, data as data_nodes
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    with torch.inference_mode():
        model, clip, vae = build_tiny_models("sd15", 0)
        images, captions, _ = data_nodes.HeadroomSyntheticDataset.execute(2, 32, 0).args
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, captions, 32, 32, "center", False, 0).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
    return model, latents, texts


def _init(model, latents, texts, run_name, precision):
    from headroom.nodes import train_lora as T

    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute("lora", 4, 4.0, "preset", False, 0.0, 0).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", 1e-3, 0.0, "constant", 0, 100).args[0]
        return T.HeadroomTrainLoraInit.execute(
            model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt,
            run_name=run_name, seed=0, batch_size=2, grad_accumulation=1, precision=precision, max_grad_norm=1.0,
            caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0,
            noise_offset=0.0, gradient_checkpointing=False, checkpoint_depth=1, holdout=0)


def test_the_default_is_auto_and_keeps_every_option(comfyui):
    from headroom.nodes import train_controlnet as C, train_lora as T

    for node in (T.HeadroomTrainLoraInit, T.HeadroomTrainLora, C.HeadroomTrainControlNetInit, C.HeadroomTrainControlNet):
        precision = next(i for i in node.define_schema().inputs if i.id == "precision")
        assert precision.default == "auto"
        assert precision.options == ["auto", *PRECISIONS]  # the existing values stay valid (public API)
        assert "CPU" in precision.tooltip


def test_auto_on_a_cpu_computes_in_fp32_and_says_so(comfyui, caplog):
    from headroom.nodes import train_lora as T

    model, latents, texts = _caches()
    with caplog.at_level(logging.INFO):
        output = _init(model, latents, texts, "precision_auto", "auto")
    run = output.args[0]
    assert run.config.train.precision == "fp32" and run.trainer.config.precision == "fp32"
    assert run.run_dir.read_config()["session"]["train"]["precision"] == "fp32"  # resolved, not "auto"
    opened, note, epoch = output.ui.as_dict()["text"][0].split("\n")
    assert opened == "run 'precision_auto', step 0: started"
    assert epoch == "an epoch (each training item once, repeat folders counted) is 1 step"
    assert note == "Train LoRA: Init (Headroom): precision auto -> fp32 on cpu (a CPU has no fast bf16 / fp16 kernels)"
    assert note in caplog.text
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 1)


def test_explicit_bf16_on_a_cpu_is_honoured_with_a_warning_and_resumes_under_auto(comfyui, caplog):
    from headroom.nodes import train_lora as T

    model, latents, texts = _caches()
    with caplog.at_level(logging.WARNING):
        output = _init(model, latents, texts, "precision_bf16", "bf16")
    run = output.args[0]
    assert run.trainer.config.precision == "bf16"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("precision bf16 on cpu: honoured" in w and "fp32" in w for w in warnings)
    assert "slower" in output.ui.as_dict()["text"][0]
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 2)
    # "auto" on the existing run: the precision it was started with, so the resumed run continues exactly.
    resumed = _init(model, latents, texts, "precision_bf16", "auto")
    assert resumed.args[0].step == 2 and resumed.args[0].trainer.config.precision == "bf16"
    assert resumed.ui.as_dict()["text"] == ("run 'precision_bf16', step 2: resumed from its last checkpoint\n"
                                            "Train LoRA: Init (Headroom): precision auto -> bf16, as run 'precision_bf16' "
                                            "was started\n"
                                            "an epoch (each training item once, repeat folders counted) is 1 step",)
    # An explicit different precision is a different configuration: refused, naming the stored value.
    with pytest.raises(ValueError, match="precision: stored 'bf16', now 'fp32'"):
        _init(model, latents, texts, "precision_bf16", "fp32")
