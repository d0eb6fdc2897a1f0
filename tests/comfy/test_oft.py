"""Kind oft: orthogonal finetuning in ComfyUI's own OFT parametrisation (training/core/adapters.py OFTLayer).

Why not peft's OFT: it rotates the input features (W' = W R^T), ComfyUI's OFT files rotate the output features
(W' = R^T W per block); the first test shows numerically that no left factor reproduces peft's update.
The rest: identity at init, the saved file through the stock loader (comfy.sd.load_lora_for_models) gives what the
trainer trained with, exact resume, the kohya format, continuing an OFT file, and the refusals.
"""
from __future__ import annotations

import pathlib

import pytest
import torch

from headroom.training.core.adapters import AdapterConfig, OFTLayer, _export_oft

from test_train_lora_nodes import OVERFIT, _data, _no_adapter_attached

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The trainer rotates the layer's output, y + (R - I)^T (y - b); the stock loader rotates the weight,
# W + (R - I)^T W, then multiplies. Equal in exact arithmetic; in float32 the products are summed in another order,
# so they agree to float32 rounding of the layer's output: max |difference| / max |output| within a few float32 eps
# (1.19e-7): measured up to 7e-7 on the tiny models, so 2e-6.
OUTPUT_TOLERANCE = 2e-6


def _scaled_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def test_peft_oft_rotates_the_input_side_which_a_comfyui_oft_file_cannot_express():
    from peft import OFTConfig
    from peft.tuners import oft

    torch.manual_seed(0)
    base = torch.nn.Linear(16, 8, bias=False)
    config = OFTConfig(r=0, oft_block_size=4, init_weights=False, use_cayley_neumann=False, target_modules=["x"])
    layer = oft.Linear(base, "default", config=config, r=0)
    with torch.no_grad():
        effective = layer(torch.eye(16)).T  # peft's weight: (8, 16)
    weight = base.weight.detach()
    # The best left factor S of any kind (ComfyUI's would be block-diagonal orthogonal): S W ~ effective.
    s = torch.linalg.lstsq(weight.T, effective.T).solution.T
    unexplained = ((s @ weight - effective).norm() / (effective - weight).norm()).item()
    assert unexplained > 0.5, unexplained  # measured 0.66: two thirds of peft's update is out of reach
    # Rotating the input side instead matches peft: W' = W blockdiag(R)^T.
    rotation = layer.oft_R["default"].get_weight()
    torch.testing.assert_close(effective, weight @ rotation.T)


def _layer(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(12, 24) if kind == "linear" else torch.nn.Conv2d(3, 8, 3, padding=1, stride=2)


def _input(kind: str) -> torch.Tensor:
    return torch.randn(5, 12) if kind == "linear" else torch.randn(2, 3, 9, 9)


@pytest.mark.comfyui
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_identity_at_init_bit_for_bit(comfyui, kind):
    base = _layer(kind)
    layer = OFTLayer(base, 4, 1.0)
    x = _input(kind)
    assert torch.equal(layer.rotation(), torch.eye(4).expand(layer.block_num, 4, 4))
    with torch.no_grad():
        assert torch.equal(layer(x), base(x))
    # ComfyUI's OFTDiff holds only the blocks here (its unused frozen `alpha` Parameter is dropped).
    assert [name for name, _ in layer.oft.named_parameters()] == ["oft_blocks"]


@pytest.mark.comfyui
def test_the_rotation_stays_float32_under_autocast(comfyui):
    """bf16 / fp16 training: R is what the loader computes (float32), not a half-precision Cayley product."""
    layer = OFTLayer(torch.nn.Linear(8, 8), 4, 1.0)
    with torch.no_grad():
        layer.oft.oft_blocks.copy_(torch.randn(layer.oft.oft_blocks.shape) * 0.3)
    exact = layer.rotation()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layer.rotation(), exact)


@pytest.mark.comfyui
@pytest.mark.parametrize("kind", ["linear", "conv"])
@pytest.mark.parametrize("constraint", [0.05, 100.0])  # the constraint scaling Q down, and not reached
def test_layer_equals_the_stock_loaders_weight(comfyui, kind, constraint):
    import comfy.lora

    base = _layer(kind)
    layer = OFTLayer(base, 4, constraint)
    with torch.no_grad():
        layer.oft.oft_blocks.copy_(torch.randn(layer.oft.oft_blocks.shape) * 0.2)
    exported = _export_oft("m", layer)
    patches = comfy.lora.load_lora(exported, {"m": "m.weight"})
    assert list(patches) == ["m.weight"] and patches["m.weight"].name == "oft"
    merged = comfy.lora.calculate_weight([(1.0, patches["m.weight"], 1.0, None, None)], base.weight.detach().clone(),
                                         "m.weight")
    # Orthogonal per block, so each block of output rows keeps its norm (what OFT preserves).
    def block_norms(w):
        return w.flatten(1).unflatten(0, (layer.block_num, 4)).norm(dim=(1, 2))

    torch.testing.assert_close(block_norms(merged), block_norms(base.weight.detach()))
    x = _input(kind)
    with torch.no_grad():
        expected = (torch.nn.functional.linear(x, merged, base.bias) if kind == "linear"
                    else base._conv_forward(x, merged, base.bias))
        assert _scaled_difference(layer(x), expected) <= OUTPUT_TOLERANCE


# --- on the tiny models, through the nodes ----------------------------------------------------------------------
def _oft_run(model, latents, texts, run_name, rank=4, alpha=1.0, lr=5e-3, targets="preset", include_conv=False,
             init_lora="none", **train):
    from headroom.nodes import train_lora as T

    settings = dict(seed=0, batch_size=4, grad_accumulation=1, precision="fp32", max_grad_norm=1.0, caption_dropout=0.0,
                    timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0, noise_offset=0.0,
                    gradient_checkpointing=False, checkpoint_depth=1, holdout=0)
    settings.update(train)
    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute("oft", rank, alpha, targets, include_conv, 0.0, 0, init_lora).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", lr, 0.0, "constant", 0, 1000).args[0]
        return T.HeadroomTrainLoraInit.execute(model=model, latent_cache=latents, text_cache=texts, lora_config=lora,
                                               optimizer_config=opt, run_name=run_name, **settings).args[0]


def _stock_loaded(model, name: str, caplog):
    """The saved file through the stock loader (comfy.sd.load_lora_for_models, what LoraLoader calls)."""
    import comfy.sd
    import comfy.utils
    import folder_paths

    state = comfy.utils.load_torch_file(folder_paths.get_full_path_or_raise("loras", name), safe_load=True)
    lora_model, _ = comfy.sd.load_lora_for_models(model, None, state, 1.0, 0.0)
    assert "lora key not loaded" not in caplog.text
    return lora_model


def _predictions(denoiser, trainer, items):
    """The denoiser's x0 prediction on fixed noisy inputs of `items` (what the deterministic validation loss uses)."""
    sigma = trainer.objective.sigma_at(trainer.objective.fixed_times(2))
    x0 = trainer._latents(items[:1]).repeat_interleave(2, dim=0)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(False), torch.no_grad():
        return denoiser.predict(trainer.objective.noisy(x0, noise, sigma), sigma, trainer._conds(items[:1]) * 2)


@pytest.mark.comfyui
@pytest.mark.parametrize("family", ["sd15", "flux"])
def test_tiny_run_learns_and_the_stock_loader_gives_what_was_trained(comfyui, family, caplog):
    import comfy.lora
    import comfy.model_management
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.comfy_model import ComfyDenoiser

    model, _, _, latents, texts = _data(family)
    base = {k: v.clone() for k, v in model.model.state_dict().items()}
    run = _oft_run(model, latents, texts, f"oft_{family}", rank=4, alpha=1.0, lr=1e-2, **OVERFIT[family])
    assert all(isinstance(layer, OFTLayer) for layer in run.adapters.layers.values())
    with torch.inference_mode():
        before = run.loss_on(run.train_items)
        T.HeadroomTrainSteps.execute(run, 40)
        after = run.loss_on(run.train_items)
        name = T.HeadroomSaveLora.execute(run, "oft", f"{family}_trained", "fp32").args[0]
    print(f"{family} oft: loss on the training items {before:.4f} -> {after:.4f}")
    assert after < 0.8 * before

    with run.attached():
        trained = _predictions(run.denoiser, run.trainer, run.train_items)
        layers = {path: layer for path, layer in run.adapters.layers.items()}
        inputs, outputs = {}, {}
        generator = torch.Generator().manual_seed(1)
        for path, layer in layers.items():
            base_layer = layer.base_layer
            shape = (3, base_layer.in_features) if isinstance(base_layer, torch.nn.Linear) else (
                1, base_layer.in_channels, 6, 6)
            inputs[path] = torch.randn(shape, generator=generator)
            with torch.no_grad():
                outputs[path] = layer(inputs[path])
    comfy.model_management.unload_all_models()

    lora_model = _stock_loaded(model, name, caplog)
    assert len(lora_model.patches) == len(run.adapters.layers)
    assert all(p[0][1].name == "oft" for p in lora_model.patches.values())
    worst = 0.0
    for path, layer in layers.items():
        key = f"diffusion_model.{path}.weight"
        base_layer = layer.base_layer
        weight = comfy.lora.calculate_weight(lora_model.patches[key], base[key].float().clone(), key)
        with torch.no_grad():
            expected = (torch.nn.functional.linear(inputs[path], weight, base_layer.bias)
                        if isinstance(base_layer, torch.nn.Linear) else
                        base_layer._conv_forward(inputs[path], weight, base_layer.bias))
        worst = max(worst, _scaled_difference(outputs[path], expected))
    with torch.inference_mode():
        comfy.model_management.load_models_gpu([lora_model])
        stock = _predictions(ComfyDenoiser(lora_model), run.trainer, run.train_items)
        comfy.model_management.unload_all_models()
    prediction = (trained - stock).abs().max().item()
    print(f"{family} oft: per-layer output vs stock weight, max difference / output scale {worst:.1e}; model "
          f"prediction max abs diff {prediction:.1e} (scale {stock.abs().max().item():.2f})")
    assert worst <= OUTPUT_TOLERANCE
    assert _scaled_difference(trained, stock) <= 1e-5
    assert all(torch.equal(v, model.model.state_dict()[k]) for k, v in base.items()), "shared weights changed"
    assert _no_adapter_attached(model)


@pytest.mark.comfyui
def test_resume_equals_the_straight_run(comfyui):
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, _, _, latents, texts = _data("sd15")
    common = dict(rank=8, alpha=0.5, lr=1e-2, include_conv=True, batch_size=2, grad_accumulation=2)
    straight = _oft_run(model, latents, texts, "oft_straight", **common)
    first = _oft_run(model, latents, texts, "oft_resumed", **common)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(straight, 6)
        T.HeadroomTrainSteps.execute(first, 3)
    del first
    restarted_model, _, _ = build_tiny_models("sd15", 0)  # "restart": new MODEL and cache objects, same run name
    _, _, _, latents2, texts2 = _data("sd15")
    second = _oft_run(restarted_model, latents2, texts2, "oft_resumed", **common)
    assert second.step == 3 and second.resumed
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(second, 6)
    a, b = straight.adapters.state_dict(), second.adapters.state_dict()
    assert a.keys() == b.keys() and all(k.endswith(".oft.oft_blocks") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the straight run"
    assert second.trainer.loss_history == straight.trainer.loss_history
    assert any(v.abs().max() > 0 for v in a.values())
    # The run folder's adapter.safetensors (the checkpoint latest.json names) holds the blocks under the same names.
    import json

    from safetensors.torch import load_file

    pointer = json.loads((second.run_dir.path / "latest.json").read_text())
    stored = load_file(str(second.run_dir.path / pointer["checkpoint"] / "adapter.safetensors"))
    assert pointer["step"] == 6 and stored.keys() == b.keys() and all(torch.equal(stored[k], b[k]) for k in b)


@pytest.mark.comfyui
def test_kohya_file_is_the_same_oft_for_the_stock_loader(comfyui, caplog):
    import json

    from headroom.nodes import train_lora as T
    from test_lora_formats import _patched_weights, _read

    model, _, _, latents, texts = _data("flux")
    run = _oft_run(model, latents, texts, "oft_kohya", rank=8, alpha=2.0, lr=2e-2)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 2)
        comfy_name = T.HeadroomSaveLora.execute(run, "oft", "flux_comfyui", "fp32").args[0]
        kohya_name = T.HeadroomSaveLora.execute(run, "oft", "flux_kohya", "fp32", "kohya").args[0]
    keys, metadata = _read(kohya_name)
    assert keys and all(k.startswith("lora_unet_") and k.endswith((".oft_blocks", ".alpha")) for k in keys)
    assert metadata["ss_network_module"] == "lycoris.kohya"
    assert json.loads(metadata["ss_network_args"]) == {"algo": "diag-oft"}
    from_comfy = _patched_weights(_stock_loaded(model, comfy_name, caplog))
    from_kohya = _patched_weights(_stock_loaded(model, kohya_name, caplog))
    assert from_comfy.keys() == from_kohya.keys() and len(from_comfy) == len(run.adapters.layers)
    for key, weight in from_comfy.items():
        assert torch.equal(weight, from_kohya[key]), key


@pytest.mark.comfyui
def test_an_oft_file_continues_exactly_and_misfits_are_refused(comfyui, caplog):
    from headroom.nodes import train_lora as T
    from test_lora_formats import _init_from, _patched_weights

    model, _, _, latents, texts = _data("sd15")
    first = _oft_run(model, latents, texts, "oft_first", rank=4, alpha=0.25, lr=2e-2)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(first, 3)
        name = T.HeadroomSaveLora.execute(first, "oft", "sd15_first", "fp32").args[0]
    continued = _oft_run(model, latents, texts, "oft_continued", rank=4, alpha=0.25, init_lora=name)
    assert continued.step == 0 and not continued.resumed
    a, b = first.adapters.state_dict(), continued.adapters.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with torch.inference_mode():
        at_start = T.HeadroomSaveLora.execute(continued, "oft", "sd15_continued_step0", "fp32").args[0]
    expected = _patched_weights(_stock_loaded(model, name, caplog))
    got = _patched_weights(_stock_loaded(model, at_start, caplog))
    assert expected.keys() == got.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(continued, 1)
    assert any(not torch.equal(b[k], v) for k, v in continued.adapters.state_dict().items())

    with pytest.raises(ValueError, match=r"block size 4 at .*set the LoRA config's rank \(the block size for oft\) to 4"):
        _oft_run(model, latents, texts, "oft_continue_rank", rank=8, alpha=0.25, init_lora=name)
    with pytest.raises(ValueError, match=r"constraint alpha 0.25 at .*set the LoRA config's alpha to 0.25"):
        _oft_run(model, latents, texts, "oft_continue_alpha", rank=4, alpha=1.0, init_lora=name)
    with pytest.raises(ValueError, match=r"holds an oft update; only plain LoRA files .*set the LoRA config's kind "
                                         r"to oft"):
        _init_from(model, latents, texts, "oft_as_lora", name)
    # Hand-edited OFT files: without the constraint, and with a rescale (neither is what kind oft trains).
    import folder_paths
    from safetensors.torch import load_file, save_file

    path = pathlib.Path(folder_paths.get_full_path_or_raise("loras", name))
    state = load_file(str(path))
    save_file({k: v for k, v in state.items() if not k.endswith(".alpha")}, str(path.with_name("no_alpha.safetensors")))
    rescaled = dict(state, **{k.replace(".oft_blocks", ".rescale"): torch.ones(v.shape[0] * v.shape[1], 1)
                              for k, v in state.items() if k.endswith(".oft_blocks")})
    save_file(rescaled, str(path.with_name("rescaled.safetensors")))
    folder = name.rsplit("/", 1)[0]
    with pytest.raises(ValueError, match=r"has no OFT constraint \(alpha\) at .*cannot continue this file exactly"):
        _oft_run(model, latents, texts, "oft_no_alpha", rank=4, alpha=0.25, init_lora=f"{folder}/no_alpha.safetensors")
    with pytest.raises(ValueError, match=r"has an OFT rescale / DoRA scale"):
        _oft_run(model, latents, texts, "oft_rescaled", rank=4, alpha=0.25, init_lora=f"{folder}/rescaled.safetensors")


@pytest.mark.comfyui
def test_settings_that_do_not_fit_are_refused_with_what_to_change(comfyui):
    from test_lora_formats import _save_both

    model, _, _, latents, texts = _data("sd15")
    # The tiny SD1.5 attention layers have 32 and 64 output features.
    with pytest.raises(ValueError, match=r"rank is the block size, and 12 does not divide the 32 output features of "
                                         r"\S+ .*block sizes that fit every trained layer: 2, 4, 8, 16, 32"):
        _oft_run(model, latents, texts, "oft_bad_block", rank=12)
    with pytest.raises(ValueError, match=r"rank is the block size of the rotations, and 1 cannot rotate"):
        AdapterConfig(kind="oft", rank=1).validate()
    with pytest.raises(ValueError, match=r"kind oft has no dropout .*set dropout to 0"):
        AdapterConfig(kind="oft", rank=4, dropout=0.1).validate()
    _, _, _, lora_name, _ = _save_both("sd15", "lora")
    with pytest.raises(ValueError, match=r"holds a lora update; kind oft continues OFT files only"):
        _oft_run(model, latents, texts, "oft_from_lora", rank=4, init_lora=lora_name)
