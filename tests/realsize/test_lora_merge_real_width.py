"""Merge LoRAs at real width: on one Flux-dev double block (3072 wide; the MLP weights 3072 x 12288, past 2^24
elements), a kohya-named rank-64 bf16 LoRA and a diffusers-named rank-32 fp32 one (its q / k / v three layers that are
rows of ComfyUI's fused qkv) merged through the node, the model on the meta device (the merge reads only names and
shapes). Exact (rank 0): the merged factors' product is the sum of the files' updates at their strengths (checked on
probe vectors), the fused qkv at rank 64 + 3 x 32. At rank 64 the fused qkv's summed update (rank 160) is its best of
that rank (Eckart-Young, as tests/realsize/test_lora_resize_real_width.py checks it), the MLP's (rank 64) kept exact."""
from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.comfyui, pytest.mark.realsize]

WIDTH, HIDDEN = 3072, 12288
KOHYA = {"img_attn_qkv": (3 * WIDTH, WIDTH), "img_mlp_0": (HIDDEN, WIDTH), "img_mlp_2": (WIDTH, HIDDEN)}
DIFFUSERS = ("to_q", "to_k", "to_v")  # rows 0, 3072, 6144 of img_attn.qkv
WEIGHTS = {name: f"diffusion_model.double_blocks.0.{path}" for name, path in
           (("img_attn_qkv", "img_attn.qkv"), ("img_mlp_0", "img_mlp.0"), ("img_mlp_2", "img_mlp.2"))}
OUT = {WEIGHTS[name]: shape[0] for name, shape in KOHYA.items()}
STRENGTHS = (1.0, 0.8)


def _files(generator):
    """(kohya state, diffusers state, {weight prefix: [(up times scale and strength, down, first row)]})."""
    kohya, diffusers, pieces = {}, {}, {prefix: [] for prefix in WEIGHTS.values()}
    for index, (name, (out, inner)) in enumerate(KOHYA.items()):
        layer = f"lora_unet_double_blocks_0_{name}"
        falloff = torch.linspace(1.0, 0.02 * (index + 1), 64) ** 2  # singular values falling off as trained ones do
        up = (torch.randn(out, 64, generator=generator) * falloff).bfloat16()
        down = (torch.randn(64, inner, generator=generator) / inner ** 0.5).bfloat16()
        kohya |= {f"{layer}.lora_up.weight": up, f"{layer}.lora_down.weight": down,
                  f"{layer}.alpha": torch.tensor(32.0)}
        pieces[WEIGHTS[name]].append((up.double() * (32 / 64) * STRENGTHS[0], down.double(), 0))
    for index, name in enumerate(DIFFUSERS):
        layer = f"transformer.transformer_blocks.0.attn.{name}"
        up = torch.randn(WIDTH, 32, generator=generator) * 0.05
        down = torch.randn(32, WIDTH, generator=generator) / WIDTH ** 0.5
        diffusers |= {f"{layer}.lora_B.weight": up, f"{layer}.lora_A.weight": down}
        pieces[WEIGHTS["img_attn_qkv"]].append((up.double() * STRENGTHS[1], down.double(), index * WIDTH))
    return kohya, diffusers, pieces


def _dense(pieces, out: int) -> torch.Tensor:
    total = None
    for up, down, offset in pieces:
        placed = up.new_zeros(out, up.shape[1])
        placed[offset:offset + up.shape[0]] = up
        total = placed @ down if total is None else total + placed @ down
    return total


def test_files_of_two_formats_merge_at_flux_width_exactly_and_to_the_best_update_of_a_rank(comfyui):
    from safetensors.torch import load_file

    import folder_paths
    import realsize_models
    from headroom.nodes import train_lora as T
    from test_lora_formats import _write_lora

    assert HIDDEN * WIDTH > 2 ** 24
    model = realsize_models.build_model("flux_dev", (1, 0), device="meta")
    kohya, diffusers, pieces = _files(torch.Generator().manual_seed(0))
    names = [_write_lora("flux_width_merge_kohya", kohya, {}), _write_lora("flux_width_merge_diffusers", diffusers, {})]
    slots = {f"lora_{i}": name for i, name in enumerate(names, 1)} | \
        {f"strength_{i}": strength for i, strength in enumerate(STRENGTHS, 1)}
    probe = torch.randn(WIDTH, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for rank in (0, 64):
        started = time.perf_counter()
        with torch.inference_mode():
            result = T.HeadroomMergeLoras.execute(model, rank, 0.0, "merged", f"flux_width_merged_{rank}", "fp32",
                                                  **slots)
        seconds = time.perf_counter() - started
        merged = load_file(folder_paths.get_full_path_or_raise("loras", result.args[0]))
        for prefix, parts in pieces.items():
            up, down = merged[f"{prefix}.lora_up.weight"].double(), merged[f"{prefix}.lora_down.weight"].double()
            assert float(merged[f"{prefix}.alpha"]) == up.shape[1] and up.shape[0] == OUT[prefix]
            if rank == 0:
                assert up.shape[1] == sum(p[0].shape[1] for p in parts)  # 64 + 3 x 32 for the fused qkv
                sample = probe if down.shape[1] == WIDTH else torch.cat([probe] * 4)
                expected = sum(torch.zeros(up.shape[0], 4, dtype=torch.float64).index_add_(
                    0, torch.arange(o, o + u.shape[0]), u @ (d @ sample)) for u, d, o in parts)
                assert (up @ (down @ sample) - expected).norm() / expected.norm() < 1e-6, prefix
                continue
            assert up.shape[1] == 64
            before = _dense(parts, up.shape[0])
            left = before - up @ down
            norm = before.norm()
            if sum(p[0].shape[1] for p in parts) <= 64:  # the MLP weights: one file's rank-64 layer, kept exact
                assert left.norm() / norm < 1e-6, prefix
                continue
            # Eckart-Young: the residual orthogonal to the kept columns and rows, the squared norms adding up
            assert (up.T @ left).norm() / (up.norm() * left.norm()) < 1e-5, prefix
            assert (left @ down.T).norm() / (down.norm() * left.norm()) < 1e-5, prefix
            assert abs(float((up @ down).norm() ** 2 + left.norm() ** 2 - norm ** 2)) / float(norm ** 2) < 1e-5
        print(f"rank {rank}: {seconds:.2f} s; {result.ui['text'][0]}")
