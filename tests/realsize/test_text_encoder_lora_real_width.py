"""A LoRA on SDXL's text encoders at real size (nodes/bridge/text_encoder_lora.py): CLIP-L (768 wide, 12 layers) and
CLIP-G (1280 wide, 32 layers), fp16 as ComfyUI's loaders store them, random weights from ComfyUI's own classes
(tests/realsize_models.py). Every attention and MLP Linear of both trained (264 layers, sd-scripts' text-encoder
targets), two AdamW steps through the stock encoding path; the CLIP's weights bit for bit as loaded after; the saved
layers mapped by the stock Load LoRA onto every one of them and encoding as the LoRA does (but for the rounding of the
weights it bakes them into), in ComfyUI's names and in sd-scripts' (Save LoRA's kohya format: lora_te1_* / lora_te2_*).
The tiny families' check: tests/comfy/test_text_encoder_lora.py; the nodes':
tests/comfy/test_text_encoder_training.py."""
from __future__ import annotations

import logging
import pathlib
import time

import pytest
import torch

pytestmark = [pytest.mark.comfyui, pytest.mark.realsize]

CAPTION = "a photo of a red fox sitting in the snow, soft morning light"


def _stock_encoding(clip, text: str) -> dict[str, torch.Tensor]:
    import nodes

    with torch.inference_mode():
        cond, extras = nodes.CLIPTextEncode().encode(clip, text)[0][0]
    return {"cross_attn": cond[0], "pooled_output": extras["pooled_output"][0]}


def test_a_text_encoder_lora_on_sdxls_clip_l_and_clip_g_at_real_size(comfyui, caplog):
    import folder_paths
    import nodes
    import realsize_models
    from family_checks import saved_by_an_encode
    from realsize_worker import weights_digest
    from safetensors.torch import save_file

    from headroom.nodes.bridge.text_encoder_lora import TextEncoderLora
    from headroom.training.core.adapters import AdapterConfig

    with torch.inference_mode():  # as ComfyUI's loaders make the weights
        clip = realsize_models.build_clip("sdxl")
    widths = {name: module.transformer.text_model.embeddings.token_embedding.weight.shape[1]
              for name, module in clip.cond_stage_model.named_children()}
    assert widths == {"clip_l": 768, "clip_g": 1280}
    assert {p.dtype for p in clip.cond_stage_model.parameters()} >= {torch.float16}
    digest = weights_digest(clip.cond_stage_model)
    stock = _stock_encoding(clip, CAPTION)

    lora = TextEncoderLora(clip, AdapterConfig(rank=16, alpha=16.0))
    assert len(lora.paths) == 6 * (12 + 32)
    # What a plan counts for it in a training step (training/memory/text_encoder_training.py): the CLIP as loaded,
    # and a caption's activations as an encode with the LoRA attached keeps them (counted apart here)
    cost = lora.training_cost(CAPTION)
    assert cost.weight_bytes == sum(t.numel() * t.element_size() for t in clip.cond_stage_model.state_dict().values())
    assert cost.saved_bytes_per_caption == saved_by_an_encode(lora, CAPTION)
    print(f"\nSDXL's CLIP as loaded {cost.weight_bytes / 2 ** 20:.0f} MiB, a caption's activations "
          f"{cost.saved_bytes_per_caption / 2 ** 20:.0f} MiB")
    # 77 tokens through 44 layers 768 / 1280 wide keep well over one fp32 copy of each layer's input (an int32 sum
    # or a count of one encoder alone would not)
    assert cost.saved_bytes_per_caption > 77 * 4 * (12 * 768 + 32 * 1280) * 6
    optimizer = torch.optim.AdamW(lora.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    targets = {key: torch.randn(value.shape, generator=generator) for key, value in stock.items()}
    losses = []
    started = time.perf_counter()
    with lora.attached():
        for _ in range(2):
            encoded = lora.encode(CAPTION)
            with torch.enable_grad():
                loss = sum((encoded[key].float() - target).pow(2).mean() for key, target in targets.items())
            optimizer.zero_grad()
            loss.backward()
            losses.append(loss.item())
            optimizer.step()
        with torch.no_grad():
            trained = lora.encode(CAPTION)
    print(f"\nSDXL CLIP-L + CLIP-G, {len(lora.paths)} layers at rank 16: loss {losses[0]:.4f} -> {losses[1]:.4f}, "
          f"{(time.perf_counter() - started) / 2:.1f} s/step")
    assert all(loss == loss for loss in losses) and losses[1] < losses[0]
    assert weights_digest(clip.cond_stage_model) == digest, "the CLIP's weights changed"

    name = f"text_encoder_sdxl_real_{time.time_ns()}.safetensors"
    folder = pathlib.Path(folder_paths.get_folder_paths("loras")[0])
    folder.mkdir(parents=True, exist_ok=True)
    save_file(lora.comfy_state_dict(), str(folder / name))
    caplog.clear()
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        _, clip_lora = nodes.LoraLoader().load_lora(None, clip, name, 0.0, 1.0)
    assert "lora key not loaded" not in caplog.text and "NOT LOADED" not in caplog.text, caplog.text
    assert len(clip_lora.patcher.patches) == len(lora.paths)
    loaded = _stock_encoding(clip_lora, CAPTION)
    for key in stock:
        effect = (trained[key] - stock[key]).norm()
        error = (loaded[key] - trained[key]).norm()
        print(f"{key}: the stock loader's encoding vs the LoRA's {error / effect:.3%} of the LoRA's effect")
        assert effect > 0 and error <= 0.02 * effect, (key, error / effect)

    # Save LoRA's kohya format: sd-scripts' names from ComfyUI's key map of the real CLIPs, every one mapped back
    kohya = lora.kohya_state_dict(lora.comfy_state_dict())
    layers = {key.split(".")[0] for key in kohya}
    assert len(layers) == len(lora.paths) and {name[:len("lora_te1_")] for name in layers} == {"lora_te1_", "lora_te2_"}
    save_file(kohya, str(folder / f"kohya_{name}"))
    caplog.clear()
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        _, clip_kohya = nodes.LoraLoader().load_lora(None, clip, f"kohya_{name}", 0.0, 1.0)
    assert "lora key not loaded" not in caplog.text, caplog.text
    assert len(clip_kohya.patcher.patches) == len(lora.paths)
    assert torch.equal(_stock_encoding(clip_kohya, CAPTION)["cross_attn"], loaded["cross_attn"])
