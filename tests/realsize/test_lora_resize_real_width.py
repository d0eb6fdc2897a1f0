"""Resize LoRA at real width: a kohya-named rank-64 bf16 LoRA on one Flux-dev double block (3072 wide; its MLP
weights 3072 x 12288, past 2^24 elements) resized through the node to rank 16 and by energy. Each resized update is
the best of its rank (Eckart-Young: what is left out is orthogonal to what is kept on both sides, and their squared
norms add up to the original's), computed without the full product; bf16 layers stay bf16 by default."""
from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.comfyui, pytest.mark.realsize]

WIDTH, HIDDEN, RANK = 3072, 12288, 64
LAYERS = {"img_attn_qkv": (3 * WIDTH, WIDTH), "img_attn_proj": (WIDTH, WIDTH), "img_mlp_0": (HIDDEN, WIDTH),
          "img_mlp_2": (WIDTH, HIDDEN)}


def _update(state, layer: str) -> torch.Tensor:
    up, down = state[f"{layer}.lora_up.weight"].double(), state[f"{layer}.lora_down.weight"].double()
    return float(state[f"{layer}.alpha"]) / down.shape[0] * (up @ down)


def test_a_flux_width_lora_resizes_to_the_best_update_of_each_rank(comfyui):
    from safetensors.torch import load_file

    import folder_paths
    from headroom.nodes import train_lora as T
    from test_lora_formats import _write_lora

    assert HIDDEN * WIDTH > 2 ** 24
    generator = torch.Generator().manual_seed(0)
    state = {}
    for index, (name, (out, inner)) in enumerate(LAYERS.items()):
        layer = f"lora_unet_double_blocks_0_{name}"
        # singular values falling off as in trained LoRAs, so that energy picks different ranks per layer
        falloff = torch.linspace(1.0, 0.02 * (index + 1), RANK) ** 2
        state[f"{layer}.lora_up.weight"] = (torch.randn(out, RANK, generator=generator) * falloff).bfloat16()
        state[f"{layer}.lora_down.weight"] = (torch.randn(RANK, inner, generator=generator) / inner ** 0.5).bfloat16()
        state[f"{layer}.alpha"] = torch.tensor(32.0)
    name = _write_lora("flux_width_rank64", state, {"ss_network_dim": "64", "ss_network_alpha": "32"})
    updates = {layer: _update(state, f"lora_unet_double_blocks_0_{layer}") for layer in LAYERS}
    seconds, fp32_name = [], None
    for rank, energy, dtype in ((16, 0.0, "fp32"), (0, 0.95, "fp32"), (16, 0.0, "auto")):
        started = time.perf_counter()
        with torch.inference_mode():
            result = T.HeadroomResizeLora.execute(name, rank, energy, "resized", f"flux_width_{rank}_{energy}_{dtype}",
                                                  dtype)
        seconds.append(time.perf_counter() - started)
        resized = load_file(folder_paths.get_full_path_or_raise("loras", result.args[0]))
        assert resized.keys() == state.keys()
        ranks = set()
        for layer_name in LAYERS:
            layer = f"lora_unet_double_blocks_0_{layer_name}"
            up = resized[f"{layer}.lora_up.weight"]
            assert up.dtype == (torch.bfloat16 if dtype == "auto" else torch.float32)
            kept = up.shape[1]
            ranks.add(kept)
            assert float(resized[f"{layer}.alpha"]) == kept and (rank == 0 or kept == rank)
            before, after = updates[layer_name], _update(resized, layer)
            left = before - after
            norm = before.norm()
            if dtype == "auto":  # bf16 layers: the fp32 result within bf16's rounding
                exact = _update(load_file(folder_paths.get_full_path_or_raise("loras", fp32_name)), layer)
                assert (after - exact).norm() / exact.norm() < 1e-2, layer
                continue
            # Eckart-Young: the residual is orthogonal to the kept update's column and row spaces (those of its up
            # and down factors), and the squared norms add up.
            kept_up = resized[f"{layer}.lora_up.weight"].double()
            kept_down = resized[f"{layer}.lora_down.weight"].double()
            assert (kept_up.T @ left).norm() / (kept_up.norm() * left.norm()) < 1e-5, layer
            assert (left @ kept_down.T).norm() / (kept_down.norm() * left.norm()) < 1e-5, layer
            assert abs(float(after.norm() ** 2 + left.norm() ** 2 - norm ** 2)) / float(norm ** 2) < 1e-5
            if energy:
                assert float(after.norm() ** 2 / norm ** 2) >= energy - 1e-6
        if energy:
            assert len(ranks) > 1, ranks  # energy chose per layer
        if (rank, energy, dtype) == (16, 0.0, "fp32"):
            fp32_name = result.args[0]
        print(f"rank {rank} energy {energy} {dtype}: {seconds[-1]:.2f} s, ranks {sorted(ranks)}; {result.ui['text'][0]}")
