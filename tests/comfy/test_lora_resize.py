"""Resize LoRA (Headroom): a trained file at a lower rank, read by ComfyUI's stock LoraLoader (and diffusers' loader
for the diffusers format) as the best approximation of the original update, in the original's keys and format;
at its own rank it is the same file's weights bit for bit (tiny models, in-process, CPU)."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch

from test_lora_formats import (_diffusers_flux_transformer, _fused_against_comfy, _load_with_diffusers, _read, _save,
                               _save_both, _stock_loader_weights, _write_lora)

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]


def _resize(name: str, rank: int = 0, energy: float = 0.0, filename: str = "", dtype: str = "auto"):
    from headroom.nodes import train_lora as T

    with torch.inference_mode():
        return T.HeadroomResizeLora.execute(name, rank, energy, "resized", filename, dtype)


def _deltas(model, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    base = model.model.state_dict()
    return {key: (weight.double() - base[key].double()).flatten(1) for key, weight in weights.items()}


def test_a_resized_file_is_the_best_lower_rank_lora_for_the_stock_loader_in_every_format(comfyui, caplog):
    model, clip, run, comfy_name, kohya_name = _save_both("sd15", "lora")  # rank 4, alpha 4
    diffusers_name = _save(run, "sd15_lora_diffusers_to_resize", "diffusers")
    for name in (comfy_name, kohya_name, diffusers_name):
        keys, metadata = _read(name)
        original, _ = _stock_loader_weights(model, clip, name, caplog)
        same = _resize(name, rank=4)  # every layer at the rank asked for: copied bit for bit
        assert "nothing resized" in same.ui["text"][0]
        copied, _ = _stock_loader_weights(model, clip, same.args[0], caplog)
        assert copied.keys() == original.keys() and all(torch.equal(copied[k], original[k]) for k in original)

        result = _resize(name, rank=2)
        resized_name = result.args[0]
        assert resized_name.startswith("resized") and resized_name.endswith("_resized.safetensors")
        text = result.ui["text"][0]
        assert f"{len(run.adapters.layers)} layers resized: rank 4 -> 2-2" in text, text
        resized_keys, resized_metadata = _read(resized_name)
        assert resized_keys == keys  # the same names: the file keeps its format
        resized, _ = _stock_loader_weights(model, clip, resized_name, caplog)
        before, after = _deltas(model, original), _deltas(model, resized)
        assert after.keys() == before.keys() and len(after) == len(run.adapters.layers)
        for key, delta in before.items():
            u, s, vh = torch.linalg.svd(delta, full_matrices=False)
            torch.testing.assert_close(after[key], (u[:, :2] * s[:2]) @ vh[:2], rtol=1e-4, atol=1e-6)
            assert torch.linalg.matrix_rank(after[key].float()) <= 2
        # what the file says about itself matches its layers; hashes of the old weights and the run's name are gone
        assert resized_metadata["headroom.resized_from"] == name and resized_metadata["headroom.rank"] == "2"
        assert json.loads(resized_metadata["headroom.resize"]) == {"rank": 2, "energy": 0.0, "dtype": "auto"}
        assert "headroom.run" in metadata and "headroom.run" not in resized_metadata
        if "ss_network_dim" in metadata:
            assert (resized_metadata["ss_network_dim"], resized_metadata["ss_network_alpha"]) == ("2", "2")
        if "lora_adapter_metadata" in metadata:
            config = json.loads(resized_metadata["lora_adapter_metadata"])
            assert (config["unet.r"], config["unet.lora_alpha"], config["unet.rank_pattern"]) == (2, 2, {})
        print(f"{name}: {text}")


def test_a_diffusers_file_resized_by_energy_loads_in_diffusers_with_comfyuis_weights(comfyui, caplog):
    """Layers of several ranks after resizing by energy: the file's PEFT config names them in rank_pattern /
    alpha_pattern, so diffusers' Flux loader injects each at its size and fuses what ComfyUI's loader applies."""
    import folder_paths
    from diffusers import FluxPipeline

    model, clip, run, _, _ = _save_both("flux", "lora")
    name = _save(run, "flux_lora_diffusers_to_resize", "diffusers")
    resized_name = _resize(name, rank=4, energy=0.9).args[0]
    _, metadata = _read(resized_name)
    config = json.loads(metadata["lora_adapter_metadata"])
    assert config["transformer.rank_pattern"], "energy 0.9 gave every layer the same rank: choose another energy"
    assert config["transformer.rank_pattern"] == config["transformer.alpha_pattern"]
    from_comfy, _ = _stock_loader_weights(model, clip, resized_name, caplog)
    with torch.inference_mode(False), torch.no_grad():
        transformer, conversion = _diffusers_flux_transformer(model)
        layers = _load_with_diffusers(transformer, FluxPipeline, folder_paths.get_full_path_or_raise("loras",
                                                                                                       resized_name), caplog)
        ranks = {module.lora_A["headroom"].weight.shape[0] for module in layers.values()}
        assert len(ranks) > 1, ranks
        _fused_against_comfy(transformer, layers, conversion, from_comfy)


def test_resize_refuses_its_own_source_a_missing_file_and_a_broken_one(comfyui):
    import folder_paths
    from headroom.nodes import train_lora as T

    broken = _write_lora("resize_broken", {"diffusion_model.a.lora_up.weight": torch.full((4, 2), float("nan")),
                                           "diffusion_model.a.lora_down.weight": torch.ones(2, 4)}, {})
    not_lora = _write_lora("resize_not_lora", {"diffusion_model.a.hada_w1_a": torch.ones(4, 2)}, {})
    garbage = pathlib.Path(folder_paths.get_full_path_or_raise("loras", not_lora)).with_name("resize_garbage.safetensors")
    garbage.write_bytes(b"\xff" * 64)
    folder_paths.filename_list_cache.pop("loras", None)
    cases = [
        ((broken, 1, 0.0, "formats", "resize_broken"), "is the file being resized"),
        (("formats/none.safetensors", 1, 0.0, "", ""), "is not in models/loras/"),
        ((broken, 1, 0.0, "resized", ""), r"LoRA file formats.resize_broken.safetensors: diffusion_model.a: .*NaN"),
        ((not_lora, 1, 0.0, "resized", ""), "holds no plain LoRA layers"),
        (("formats/resize_garbage.safetensors", 1, 0.0, "resized", ""), "resize_garbage.safetensors cannot be read"),
        ((broken, 0, 0.0, "resized", ""), "give rank > 0 or energy"),
        ((broken, 1, 0.0, "resized", "bad/name"), "LoRA file name"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=message) as caught, torch.inference_mode():
            T.HeadroomResizeLora.execute(*arguments)
        assert str(caught.value).startswith("Resize LoRA (Headroom): "), caught.value


def test_a_locon_files_conv_dim_is_made_true(comfyui):
    """kohya's ss_network_args of a LoCon file name its 3x3 convolutions' rank (conv_dim / conv_alpha): after a resize
    they name the new one, the other args kept; where the convolutions' ranks differ, conv_dim is left out (as Save LoRA
    writes it)."""
    generator = torch.Generator().manual_seed(0)
    state = {"lora_unet_conv.lora_up.weight": torch.randn(8, 4, 1, 1, generator=generator),
             "lora_unet_conv.lora_down.weight": torch.randn(4, 6, 3, 3, generator=generator),
             "lora_unet_conv.alpha": torch.tensor(2.0),
             "lora_unet_small_conv.lora_up.weight": torch.randn(8, 2, 1, 1, generator=generator),
             "lora_unet_small_conv.lora_down.weight": torch.randn(2, 6, 3, 3, generator=generator),
             "lora_unet_small_conv.alpha": torch.tensor(2.0),
             "lora_unet_linear.lora_up.weight": torch.randn(8, 4, generator=generator),
             "lora_unet_linear.lora_down.weight": torch.randn(4, 6, generator=generator),
             "lora_unet_linear.alpha": torch.tensor(2.0)}
    args = json.dumps({"conv_dim": "4", "conv_alpha": "2", "dropout": "0.1"})
    name = _write_lora("resize_locon", state, {"ss_network_dim": "4", "ss_network_alpha": "2", "ss_network_args": args})
    _, metadata = _read(_resize(name, rank=2, filename="resize_locon_2").args[0])
    assert json.loads(metadata["ss_network_args"]) == {"dropout": "0.1", "conv_dim": "2", "conv_alpha": "2"}
    _, metadata = _read(_resize(name, rank=3, filename="resize_locon_3").args[0])  # convolutions at 3 and 2
    assert json.loads(metadata["ss_network_args"]) == {"dropout": "0.1"}


def test_a_dora_file_resizes_its_updates_and_keeps_its_scales(comfyui, caplog):
    """DoRA: the up / down pairs are resized, each layer's dora_scale kept as it is; the stock loader reads every key
    (the loader renormalises the resized update: close to the original, not its best approximation)."""
    from safetensors.torch import load_file

    import folder_paths

    model, clip, run, comfy_name, _ = _save_both("sd15", "dora")
    original, _ = _stock_loader_weights(model, clip, comfy_name, caplog)
    resized_name = _resize(comfy_name, rank=2).args[0]
    resized, _ = _stock_loader_weights(model, clip, resized_name, caplog)  # asserts every key loaded
    assert resized.keys() == original.keys()
    before = load_file(folder_paths.get_full_path_or_raise("loras", comfy_name))
    after = load_file(folder_paths.get_full_path_or_raise("loras", resized_name))
    scales = [key for key in before if key.endswith(".dora_scale")]
    assert scales and all(torch.equal(after[key], before[key]) for key in scales)
    assert all(after[key].shape[0] == 2 for key in after if key.endswith(".lora_down.weight"))
