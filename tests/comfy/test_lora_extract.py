"""A LoRA extracted from a fine-tune's difference (training/core/lora_extract.py, issue 27 item 3) through the stock
LoraLoader: the base model with the extracted file loads to the fine-tuned weights."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from headroom.training.core.lora_extract import extract_lora

pytestmark = pytest.mark.comfyui


def _fine_tuned(base: dict[str, torch.Tensor], rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every Linear / conv weight moved by a rank-`rank` difference, every bias and norm weight by a small one:
    what a full fine-tune's weights look like against its base (low-rank changes are what LoRA extraction keeps)."""
    generator = torch.Generator().manual_seed(seed)
    trained = {}
    for key, value in base.items():
        if not value.is_floating_point():
            trained[key] = value
        elif value.ndim >= 2:
            rows, cols = value.shape[0], value[0].numel()
            delta = (torch.randn(rows, rank, generator=generator) @ torch.randn(rank, cols, generator=generator))
            trained[key] = value + 1e-2 * delta.reshape(value.shape).to(value.dtype)
        else:
            trained[key] = value + 1e-3 * torch.randn(value.shape, generator=generator).to(value.dtype)
    return trained


def _loaded_weights(model, clip, name: str) -> dict[str, torch.Tensor]:
    """The diffusion model's weights as the stock LoraLoader + ComfyUI's load make them (patches baked in)."""
    import comfy.model_management
    import nodes

    with torch.inference_mode():
        patched, _ = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)
        comfy.model_management.load_models_gpu([patched], force_full_load=True)
        weights = {k: v.detach().clone() for k, v in patched.model.diffusion_model.state_dict().items()}
        comfy.model_management.unload_model_and_clones(patched)  # the shared weights back to the base
    return weights


@pytest.mark.parametrize("family", ["sd15", "flux"])
def test_extracted_lora_takes_the_base_to_the_fine_tune_through_the_stock_loader(comfyui, family):
    import folder_paths

    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, clip, _ = build_tiny_models(family, 0)
    base = {k: v.detach().clone() for k, v in model.model.diffusion_model.state_dict().items()}
    trained = _fine_tuned(base, rank=3)
    assert min((trained[k] - base[k]).abs().max().item() for k in base if base[k].is_floating_point()) > 1e-5
    lora, report = extract_lora(base, trained, rank=3)
    folder = folder_paths.get_folder_paths("loras")[0]
    os.makedirs(folder, exist_ok=True)
    name = f"extracted_{family}.safetensors"
    save_file(lora, os.path.join(folder, name))

    loaded = _loaded_weights(model, clip, name)
    assert loaded.keys() == trained.keys()
    worst = max((loaded[k].float() - trained[k].float()).abs().max().item() for k in trained)
    assert worst < 1e-4, f"the stock loader's weights differ from the fine-tune by up to {worst}"
    assert report.ranks and set(report.ranks.values()) == {3} and report.whole  # biases / norms whole
    assert min(report.energy.values()) > 0.999999  # a rank-3 difference is all in 3 singular values
    # The base file is untouched: the shared MODEL is back to its own weights.
    assert all(torch.equal(v, base[k]) for k, v in model.model.diffusion_model.state_dict().items())

    # A smaller rank keeps part of it, an energy threshold picks the rank per weight.
    lora_1, report_1 = extract_lora(base, trained, rank=1)
    assert set(report_1.ranks.values()) == {1} and max(report_1.energy.values()) < 1.0
    _, by_energy = extract_lora(base, trained, energy=0.9)
    assert set(by_energy.ranks.values()) <= {1, 2, 3} and min(by_energy.energy.values()) >= 0.9
    assert "weights as LoRA" in by_energy.summary()


def test_extraction_refuses_what_it_cannot_express():
    base = {"a.weight": torch.zeros(4, 4), "a.bias": torch.zeros(4), "scale": torch.zeros(4)}
    with pytest.raises(ValueError, match="rank > 0 or energy"):
        extract_lora(base, base)
    with pytest.raises(ValueError, match="rank > 0 or energy"):
        extract_lora(base, base, rank=2, energy=1.5)
    with pytest.raises(ValueError, match="energy=nan is not a finite number"):
        extract_lora(base, base, rank=2, energy=float("nan"))
    with pytest.raises(ValueError, match="keys differ"):
        extract_lora(base, {"a.weight": torch.zeros(4, 4)}, rank=2)
    with pytest.raises(ValueError, match="a.weight is"):
        extract_lora(base, {**base, "a.weight": torch.zeros(4, 5)}, rank=2)
    with pytest.raises(ValueError, match="scale changed and no LoRA key"):
        extract_lora(base, {**base, "scale": torch.ones(4)}, rank=2)
    lora, report = extract_lora(base, base, rank=2)
    assert lora == {} and report.unchanged == 3
