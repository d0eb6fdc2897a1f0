"""A LoRA on a CLIP's text encoders (nodes/bridge/text_encoder_lora.py), the engine's part of text-encoder training, on
the tiny families' real ComfyUI CLIPs (in-process, CPU): untrained it encodes exactly as the stock CLIP Text Encode,
gradients reach its layers and nothing else, trained it changes the encoding, the CLIP other nodes use is left as
loaded, and its saved layers through the stock Load LoRA (strength_clip 1) encode as it does."""
from __future__ import annotations

import logging
import pathlib
import time

import pytest
import torch

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]

CAPTIONS = ["a red circle in the center", "a blue square, top left"]


def _stock_encoding(clip, text: str) -> dict[str, torch.Tensor]:
    import nodes

    with torch.inference_mode():
        cond, extras = nodes.CLIPTextEncode().encode(clip, text)[0][0]
    return {"cross_attn": cond[0], "pooled_output": extras["pooled_output"][0]}


# sd15: CLIP-L; sdxl: CLIP-L + CLIP-G; flux: CLIP-L trained, T5 left frozen (sd-scripts' Flux text-encoder LoRA);
# sd15-fp32: its weights in fp32 as ComfyUI's --fp32-text-enc loads them (no cast: the loader's inference tensors are
# what the layers compute with, and autograd cannot save those for backward unless given normal storage)
@pytest.mark.parametrize("family, encoders", [("sd15", {"clip_l"}), ("sdxl", {"clip_l", "clip_g"}),
                                              ("flux", {"clip_l"}), ("sd15-fp32", {"clip_l"})])
def test_a_text_encoder_lora_trains_and_the_stock_loader_encodes_as_it_does(comfyui, caplog, family, encoders):
    import folder_paths
    import nodes
    from safetensors.torch import save_file

    from headroom.nodes.bridge.text_encoder_lora import SAVED_PREFIX, TextEncoderLora
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.core.adapters import AdapterConfig

    fp32 = family.endswith("-fp32")
    family = family.removesuffix("-fp32")
    with torch.inference_mode():  # as ComfyUI's loaders make the weights: inference tensors
        model, clip, _ = build_tiny_models(family, 0)
        if fp32:
            clip.cond_stage_model.to(torch.float32)
    assert {p.dtype for p in clip.cond_stage_model.parameters()} == ({torch.float32} if fp32 else
                                                                    {torch.float16, torch.float32})
    base = {key: value.clone() for key, value in clip.cond_stage_model.state_dict().items()}
    stock = {text: _stock_encoding(clip, text) for text in CAPTIONS}
    lora = TextEncoderLora(clip, AdapterConfig(rank=4, alpha=4.0))
    assert {path.split(".", 1)[0] for path in lora.paths} == encoders
    assert all(path.rsplit(".", 2)[-2:][0] in ("self_attn", "mlp") for path in lora.paths)  # no text_projection
    layers = {".".join(path.split(".")[:6]) for path in lora.paths}  # <encoder>.transformer.text_model.encoder.layers.N
    assert len(lora.paths) == 6 * len(layers)  # q, k, v, out_proj, fc1, fc2 of every layer

    optimizer = torch.optim.AdamW(lora.parameters(), lr=1e-2)
    losses = []
    with lora.attached():
        untrained = {text: lora.encode(text) for text in CAPTIONS}
        for text in CAPTIONS:  # zero-initialised up weights: exactly the stock encoding
            assert untrained[text].keys() >= {"cross_attn", "pooled_output"}
            assert all(torch.equal(untrained[text][name], stock[text][name]) for name in stock[text]), text
        # pull the first caption's encoding towards a random one: any loss the encoding sets will do. Flux's tokens
        # are T5's (frozen): there only CLIP-L's pooled output trains
        generator = torch.Generator().manual_seed(0)
        targets = {key: torch.randn(value.shape, generator=generator) for key, value in stock[CAPTIONS[0]].items()}
        for _ in range(5):
            encoded = lora.encode(CAPTIONS[0])
            with torch.enable_grad():  # (ComfyUI turns gradients off for its process)
                loss = sum((encoded[key].float() - target).pow(2).mean() for key, target in targets.items()
                           if encoded[key].requires_grad)
            optimizer.zero_grad()
            loss.backward()
            losses.append(loss.item())
            optimizer.step()
        frozen = [p for p in clip.cond_stage_model.parameters() if p.requires_grad and p.grad is not None
                  and not any(p is q for q in lora.parameters())]
        assert frozen == [], "gradients reached the CLIP's own weights"
        with torch.no_grad():
            trained = {text: lora.encode(text) for text in CAPTIONS}
    print(f"{family}: {len(lora.paths)} layers; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert losses[-1] < losses[0]
    moved = {key for key in stock[CAPTIONS[0]] if not torch.equal(trained[CAPTIONS[0]][key], stock[CAPTIONS[0]][key])}
    assert moved == ({"pooled_output"} if family == "flux" else {"cross_attn", "pooled_output"}), moved
    # Detached: the CLIP other nodes use encodes as loaded, its weights bit for bit what they were
    assert all(torch.equal(value, base[key]) for key, value in clip.cond_stage_model.state_dict().items())
    assert all(torch.equal(_stock_encoding(clip, text)["cross_attn"], stock[text]["cross_attn"]) for text in CAPTIONS)

    state = lora.comfy_state_dict()
    assert all(key.startswith(SAVED_PREFIX) for key in state) and len(state) == 3 * len(lora.paths)
    name = f"text_encoder_{family}{'_fp32' if fp32 else ''}_{time.time_ns()}.safetensors"
    folder = pathlib.Path(folder_paths.get_folder_paths("loras")[0])
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / name))
    caplog.clear()
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        _, clip_lora = nodes.LoraLoader().load_lora(model, clip, name, 0.0, 1.0)
    assert "lora key not loaded" not in caplog.text and "NOT LOADED" not in caplog.text, caplog.text
    assert len(clip_lora.patcher.patches) == len(lora.paths)
    # The stock loader bakes up @ down into the CLIP's fp16 weights (rounded there); the LoRA computes it beside them
    # in fp32: the same encoding but for that rounding, a small share of what the LoRA changes (fp32 weights: but
    # for the order of fp32 sums).
    for text in CAPTIONS:
        loaded = _stock_encoding(clip_lora, text)
        for key in moved:
            effect = (trained[text][key] - stock[text][key]).norm()
            error = (loaded[key] - trained[text][key]).norm()
            print(f"  {text!r} {key}: stock loader vs the LoRA {error / effect:.2%} of its effect")
            assert effect > 0 and error <= (1e-5 if fp32 else 0.02) * effect, (text, key, error / effect)
        assert all(torch.equal(loaded[key], stock[text][key]) for key in stock[text].keys() - moved)  # T5's


def test_a_clip_without_a_clip_text_encoder_and_kinds_a_text_encoder_does_not_train_are_named(comfyui):
    from headroom.nodes.bridge.text_encoder_lora import TextEncoderLora, text_encoder_layers
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.core.adapters import AdapterConfig

    with torch.inference_mode():
        _, qwen3, _ = build_tiny_models("zimage", 0)  # Z-Image's LLM encoder (Qwen3)
        _, clip, _ = build_tiny_models("sd15", 0)
    with pytest.raises(ValueError, match=r"this CLIP \(.*\) has no CLIP text encoder to train: .*not T5 or LLM"):
        text_encoder_layers(qwen3)
    for kind in ("oft", "full"):
        with pytest.raises(ValueError, match=f"kind {kind}: a text encoder trains a LoRA"):
            TextEncoderLora(clip, AdapterConfig(kind=kind, rank=2))
