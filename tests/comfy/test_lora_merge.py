"""Merge LoRAs (Headroom): LoRA files of any format summed at their strengths into one file that ComfyUI's stock
LoraLoader applies as the chain of Load LoRA nodes it replaces (exactly at rank 0; at a lower rank each summed update's
best approximation), text-encoder layers and whole-tensor differences included (tiny models, in-process, CPU)."""
from __future__ import annotations

import json

import pytest
import torch

from test_lora_formats import _patched_weights, _read, _save, _save_both, _write_lora

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]


def _merge(model, loras, clip=None, rank: int = 0, energy: float = 0.0, filename: str = "", dtype: str = "auto",
           file_format: str = "comfyui"):
    from headroom.nodes import train_lora as T

    slots = {}
    for index, (name, strength) in enumerate(loras, 1):
        slots |= {f"lora_{index}": name, f"strength_{index}": strength}
    with torch.inference_mode():
        return T.HeadroomMergeLoras.execute(model, rank, energy, "merged", filename, dtype, file_format, clip=clip,
                                            **slots)


def _chain(model, clip, loras, caplog) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The diffusion model's and CLIP's patched weights after a chain of stock LoraLoader nodes (each file at its
    strength on both); every key of every file must load."""
    import comfy.lora
    import nodes

    caplog.clear()
    with torch.inference_mode():
        for name, strength in loras:
            model, clip = nodes.LoraLoader().load_lora(model, clip, name, strength, strength)
        model_weights = _patched_weights(model)
        base = clip.cond_stage_model.state_dict()
        clip_weights = {key: comfy.lora.calculate_weight(patches, base[key].float().clone(), key)
                        for key, patches in clip.patcher.patches.items()}
    assert "lora key not loaded" not in caplog.text and "NOT LOADED" not in caplog.text, caplog.text
    return model_weights, clip_weights


def _text_encoder_lora(clip, name: str, rank: int, alpha: float, dtype: torch.dtype, seed: int) -> dict:
    """A kohya-named LoRA (`lora_te_...`, as sd-scripts writes SD1.x text-encoder layers) on the CLIP's first layer's
    attention and MLP, random weights."""
    import comfy.lora

    key_map = comfy.lora.model_lora_keys_clip(clip.cond_stage_model, {})
    shapes = clip.cond_stage_model.state_dict()
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for layer in ("self_attn_q_proj", "self_attn_out_proj", "mlp_fc1"):
        kohya = f"lora_te_text_model_encoder_layers_0_{layer}"
        out, inner = shapes[key_map[kohya]].shape
        state[f"{kohya}.lora_up.weight"] = torch.randn(out, rank, generator=generator).to(dtype) * 0.1
        state[f"{kohya}.lora_down.weight"] = torch.randn(rank, inner, generator=generator).to(dtype) * 0.1
        state[f"{kohya}.alpha"] = torch.tensor(alpha)
    return state


def _assert_same(merged: dict[str, torch.Tensor], chained: dict[str, torch.Tensor]) -> None:
    assert merged.keys() == chained.keys() and merged
    for key in chained:
        torch.testing.assert_close(merged[key], chained[key], rtol=1e-5, atol=1e-6, msg=key)


def test_a_merged_file_is_the_chain_of_load_lora_nodes_it_replaces(comfyui, caplog):
    """Three files of three formats: a trained SD1.5 LoRA in ComfyUI's keys (rank 4), a kohya file with the same
    layers at another rank plus text-encoder layers (bf16), and a file of whole-tensor differences (as ComfyUI's Train
    LoRA saves trained biases), at strengths 0.7, -0.5 and 1. The merged file through the stock LoraLoader patches the
    diffusion model and the CLIP as the three chained loaders do; at rank 2 each summed update is its best rank-2
    approximation; the caption tag counts of the files are added."""
    model, clip, run, comfy_name, kohya_name = _save_both("sd15", "lora")
    second = dict(_read_state(kohya_name))
    for key in [k for k in second if k.endswith(".lora_down.weight")]:  # another update of rank 3 on each layer
        layer = key[:-len(".lora_down.weight")]
        generator = torch.Generator().manual_seed(len(layer))
        second[key] = torch.randn(3, *second[key].shape[1:], generator=generator).bfloat16()
        second[f"{layer}.lora_up.weight"] = torch.randn(second[f"{layer}.lora_up.weight"].shape[0], 3,
                                                        *second[f"{layer}.lora_up.weight"].shape[2:],
                                                        generator=generator).bfloat16()
        second[f"{layer}.alpha"] = torch.tensor(1.5)
    second |= _text_encoder_lora(clip, "te", 2, 1.0, torch.bfloat16, 0)
    tags = json.dumps({"style": {"ohwx": 3, "red": 1}})
    kohya_second = _write_lora("merge_second_kohya", second, {"ss_tag_frequency": tags})
    bias = next(k for k in model.model.state_dict() if k.endswith(".bias") and "out." in k)
    differences = _write_lora("merge_differences", {
        bias.removesuffix(".bias") + ".diff_b": torch.linspace(-1, 1, model.model.state_dict()[bias].numel())}, {})
    loras = [(comfy_name, 0.7), (kohya_second, -0.5), (differences, 1.0)]
    chained_model, chained_clip = _chain(model, clip, loras, caplog)

    result = _merge(model, loras, clip=clip)
    name, text = result.args[0], result.ui["text"][0]
    assert name.startswith("merged") and name.endswith("_merged.safetensors"), name
    assert "the exact sum of the files' updates" in text and "1 whole-tensor difference (diff) added" in text, text
    keys, metadata = _read(name)
    assert all(k.startswith(("diffusion_model.", "text_encoders.")) for k in keys)
    merged_model, merged_clip = _chain(model, clip, [(name, 1.0)], caplog)
    _assert_same(merged_model, chained_model)
    _assert_same(merged_clip, chained_clip)
    assert json.loads(metadata["headroom.merged_from"]) == [{"lora": n, "strength": s} for n, s in loras]
    frequency = json.loads(metadata["ss_tag_frequency"])
    assert frequency["style"] == {"ohwx": 3, "red": 1} and run.run_dir.name in frequency
    assert metadata["headroom.format"] == "comfyui"
    assert all(_read_state(name)[k].dtype == torch.float32 for k in keys)  # fp32 and bf16 files: auto is fp32
    # kohya's names (SD1.x: the diffusers block names, lora_te_ for the CLIP), the same weights for the stock loader
    kohya = _merge(model, loras, clip=clip, filename="merged_kohya", file_format="kohya").args[0]
    kohya_keys, kohya_metadata = _read(kohya)
    assert all(k.startswith(("lora_unet_down_blocks_", "lora_unet_up_blocks_", "lora_unet_mid_block", "lora_te_"))
               for k in kohya_keys), kohya_keys
    assert len(kohya_keys) == len(keys) and kohya_metadata["ss_network_dim"] == "Dynamic"
    assert kohya_metadata["ss_base_model_version"] == "sd_v1" and "ss_steps" not in kohya_metadata
    kohya_model, kohya_clip = _chain(model, clip, [(kohya, 1.0)], caplog)
    _assert_same(kohya_model, chained_model)
    _assert_same(kohya_clip, chained_clip)

    reduced = _merge(model, loras, clip=clip, rank=2, filename="merged_rank2")
    assert "reduced from the sum of their ranks" in reduced.ui["text"][0], reduced.ui["text"][0]
    reduced_model, reduced_clip = _chain(model, clip, [(reduced.args[0], 1.0)], caplog)
    for merged, chained, base in ((reduced_model, chained_model, model.model.state_dict()),
                                  (reduced_clip, chained_clip, clip.cond_stage_model.state_dict())):
        assert merged.keys() == chained.keys()
        for key, weight in chained.items():
            delta = (weight.double() - base[key].double())
            if key == bias:
                torch.testing.assert_close(merged[key].double() - base[key].double(), delta)
                continue
            u, s, vh = torch.linalg.svd(delta.flatten(1), full_matrices=False)
            best = ((u[:, :2] * s[:2]) @ vh[:2]).reshape(delta.shape)
            torch.testing.assert_close(merged[key].double() - base[key].double(), best, rtol=1e-4, atol=1e-6,
                                       msg=key)
    print(text, "|", reduced.ui["text"][0])


def _read_state(name: str) -> dict[str, torch.Tensor]:
    import folder_paths
    from safetensors.torch import load_file

    return load_file(folder_paths.get_full_path_or_raise("loras", name))


def _assert_same_updates(merged: dict[str, torch.Tensor], original: dict[str, torch.Tensor],
                         base: dict[str, torch.Tensor], tolerance: float, case) -> None:
    """Each patched weight's update (patched - base) within `tolerance` of the original's, relative to its norm."""
    assert merged.keys() == original.keys()
    for key in original:
        before, after = original[key].double() - base[key].double(), merged[key].double() - base[key].double()
        assert (after - before).norm() <= tolerance * before.norm() + 1e-7, (key, case)


def test_a_diffusers_file_merges_with_a_comfyui_one_into_comfyuis_fused_layers(comfyui, caplog):
    """Flux: the diffusers file writes ComfyUI's fused qkv as separate q / k / v layers, each rows of the fused
    weight. Half of the ComfyUI file plus half of the diffusers file of the same adapter is that adapter: the merged
    file patches what the ComfyUI file alone does, exactly at rank 0, and at the adapter's own rank too (the sum has
    that rank), in bf16 when asked. Exact, a fused weight's rank is the sum of its pieces' (each diffusers layer's up
    zero outside its rows). The diffusers file alone, merged at rank 4 in the kohya format, is the same adapter in
    kohya's names: a conversion."""
    model, clip, run, comfy_name, _ = _save_both("flux", "lora")
    diffusers_name = _save(run, "flux_lora_diffusers_to_merge", "diffusers")
    original, _ = _chain(model, clip, [(comfy_name, 1.0)], caplog)
    for rank, dtype, tolerance in ((0, "auto", 1e-5), (4, "fp32", 1e-5), (4, "bf16", 2e-2)):
        result = _merge(model, [(comfy_name, 0.5), (diffusers_name, 0.5)], clip=clip, rank=rank,
                        filename=f"flux_halves_{rank}_{dtype}", dtype=dtype)
        merged, _ = _chain(model, clip, [(result.args[0], 1.0)], caplog)
        _assert_same_updates(merged, original, model.model.state_dict(), tolerance, (rank, dtype))
        state = _read_state(result.args[0])
        ups = [v for k, v in state.items() if k.endswith(".lora_up.weight")]
        assert {u.dtype for u in ups} == {torch.bfloat16 if dtype == "bf16" else torch.float32}
        ranks = {u.shape[1] for u in ups}
        # exact: the ranks add up (a fused qkv: 4 + the 3 diffusers layers' 4 each, zero outside their rows)
        assert ranks == {4} if rank else (min(ranks) == 8 and 16 in ranks), ranks
    # one file at strength 1 is that file in another format: the diffusers file as kohya's names (fused at its rank)
    converted = _merge(model, [(diffusers_name, 1.0)], rank=4, filename="flux_diffusers_as_kohya",
                       file_format="kohya").args[0]
    keys, metadata = _read(converted)
    assert all(k.startswith("lora_unet_") for k in keys) and metadata["ss_network_dim"] == "4", keys
    merged, _ = _chain(model, clip, [(converted, 1.0)], caplog)
    _assert_same_updates(merged, original, model.model.state_dict(), 1e-5, "converted")


def test_merge_refuses_what_it_cannot_merge_naming_the_file(comfyui):
    import folder_paths
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    with torch.inference_mode():
        model, clip, _ = build_tiny_models("sd15", 0)
        flux_model, _, _ = build_tiny_models("flux", 0)
    weight = next(k for k, v in model.model.state_dict().items() if k.endswith("attn2.to_k.weight"))
    layer = weight.removesuffix(".weight")
    out, inner = model.model.state_dict()[weight].shape
    good = _write_lora("merge_good", {f"{layer}.lora_up.weight": torch.ones(out, 2),
                                      f"{layer}.lora_down.weight": torch.ones(2, inner)}, {})
    broken = _write_lora("merge_nan", {f"{layer}.lora_up.weight": torch.full((out, 2), float("nan")),
                                       f"{layer}.lora_down.weight": torch.ones(2, inner)}, {})
    loha = _write_lora("merge_loha", {f"{layer}.hada_w{i}_{side}": torch.ones(*shape) for i in (1, 2)
                                      for side, shape in (("a", (out, 2)), ("b", (2, inner)))}, {})
    misfit = _write_lora("merge_misfit", {f"{layer}.lora_up.weight": torch.ones(out, 2),
                                          f"{layer}.lora_down.weight": torch.ones(2, inner + 1)}, {})
    integers = _write_lora("merge_integers", {f"{layer}.lora_up.weight": torch.ones(out, 2, dtype=torch.int32),
                                              f"{layer}.lora_down.weight": torch.ones(2, inner)}, {})
    alpha_only = _write_lora("merge_alpha_only", {f"{layer}.alpha": torch.tensor(1.0)}, {})
    text_encoder = _write_lora("merge_text_encoder", _text_encoder_lora(clip, "te", 2, 1.0, torch.float32, 1), {})
    garbage = folder_paths.get_full_path_or_raise("loras", good).replace("merge_good", "merge_garbage")
    with open(garbage, "wb") as handle:
        handle.write(b"\xff" * 64)
    folder_paths.filename_list_cache.pop("loras", None)
    cases = [
        ((model, [(good, 1.0), (broken, 1.0)]), r"LoRA file formats.merge_nan.safetensors: .*NaN"),
        ((model, [(good, 1.0), (loha, 1.0)]), r"merge_loha.safetensors: .* holds a loha update"),
        ((model, [(misfit, 1.0)]), r"merge_misfit.safetensors: .* does not fit the model's weight"),
        ((model, [(integers, 1.0)]), r"merge_integers.safetensors: .* up weight is not a floating-point matrix"),
        ((model, [(alpha_only, 1.0)]), r"merge_alpha_only.safetensors holds no LoRA layer"),
        ((model, [(text_encoder, 1.0)]), r"has text-encoder layers .*connect the checkpoint's CLIP"),
        ((flux_model, [(good, 1.0)]), r"merge_good.safetensors: .* map to no layer of this model"),
        ((model, [("none", 1.0), (good, 0.0)]), "no LoRA to merge"),
        ((model, [("formats/absent.safetensors", 1.0)]), "is not in models/loras/"),
        ((model, [("formats/merge_garbage.safetensors", 1.0)]), "merge_garbage.safetensors cannot be read"),
    ]
    for (base, loras), message in cases:
        with pytest.raises(ValueError, match=message) as caught:
            _merge(base, loras)
        assert str(caught.value).startswith("Merge LoRAs (Headroom): "), caught.value
    with pytest.raises(ValueError, match="one of the files being merged"):
        with torch.inference_mode():
            T.HeadroomMergeLoras.execute(model, 0, 0.0, "formats", "merge_good", "auto", lora_1=good, strength_1=1.0)
    with pytest.raises(ValueError, match="strength_2"):
        _merge(model, [(good, 1.0), (good, float("nan"))])
    # the same file twice at 0.5 is the file: allowed
    assert "the exact sum" in _merge(model, [(good, 0.5), (good, 0.5)], filename="merge_good_twice").ui["text"][0]


def test_a_lora_layer_and_a_difference_on_one_weight_are_saved_as_one_difference(comfyui, caplog):
    """One file's LoRA layer and another's whole-tensor difference on the same weight: a file holds one patch per
    weight, so the merge folds the LoRA update into the difference; the stock loader patches what the two chained
    loaders do, in both formats (ComfyUI reads a `.diff` under kohya's names too)."""
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    with torch.inference_mode():
        model, clip, _ = build_tiny_models("sd15", 0)
    base = model.model.state_dict()
    weight = next(k for k in base if k.endswith("attn2.to_k.weight"))
    other = next(k for k in base if k.endswith("attn2.to_v.weight"))
    generator = torch.Generator().manual_seed(5)
    state = {}
    for key in (weight, other):
        out, inner = base[key].shape
        layer = key.removesuffix(".weight")
        state |= {f"{layer}.lora_up.weight": torch.randn(out, 2, generator=generator),
                  f"{layer}.lora_down.weight": torch.randn(2, inner, generator=generator),
                  f"{layer}.alpha": torch.tensor(1.0)}
    lora = _write_lora("merge_fold_lora", state, {})
    difference = _write_lora("merge_fold_difference", {
        weight.removesuffix(".weight") + ".diff": torch.randn(base[weight].shape, generator=generator)}, {})
    loras = [(lora, 0.6), (difference, -0.4)]
    chained, _ = _chain(model, clip, loras, caplog)
    for file_format in ("comfyui", "kohya"):
        result = _merge(model, loras, filename=f"merge_fold_{file_format}", file_format=file_format)
        assert "1 weight with both a LoRA layer and a difference saved as differences" in result.ui["text"][0]
        keys, _ = _read(result.args[0])
        assert sum(k.endswith(".diff") for k in keys) == 1 and sum(k.endswith(".lora_up.weight") for k in keys) == 1
        merged, _ = _chain(model, clip, [(result.args[0], 1.0)], caplog)
        _assert_same(merged, chained)


def test_sdxl_text_encoder_layers_take_kohyas_te1_and_te2_names(comfyui, caplog):
    """SDXL's two CLIPs: a file in ComfyUI's generic names (`text_encoders.clip_l...`, `text_encoders.clip_g...`)
    merged in the kohya format takes sd-scripts' lora_te1_ (CLIP-L) / lora_te2_ (CLIP-G) names, and the stock loader
    patches the same CLIP weights from both files."""
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    with torch.inference_mode():
        model, clip, _ = build_tiny_models("sdxl", 0)
    shapes = clip.cond_stage_model.state_dict()
    generator = torch.Generator().manual_seed(3)
    state = {}
    for tower in ("clip_l", "clip_g"):
        weight = f"{tower}.transformer.text_model.encoder.layers.0.mlp.fc1.weight"
        out, inner = shapes[weight].shape
        layer = "text_encoders." + weight.removesuffix(".weight")
        state |= {f"{layer}.lora_up.weight": torch.randn(out, 2, generator=generator),
                  f"{layer}.lora_down.weight": torch.randn(2, inner, generator=generator)}
    source = _write_lora("merge_sdxl_text_encoders", state, {})
    _, from_source = _chain(model, clip, [(source, 1.0)], caplog)
    kohya = _merge(model, [(source, 1.0)], clip=clip, filename="merged_sdxl_kohya", file_format="kohya").args[0]
    keys, _ = _read(kohya)
    assert {k.split("_text_model_")[0] for k in keys} == {"lora_te1", "lora_te2"}, keys
    _, from_kohya = _chain(model, clip, [(kohya, 1.0)], caplog)
    _assert_same(from_kohya, from_source)
