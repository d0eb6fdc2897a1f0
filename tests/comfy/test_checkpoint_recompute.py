"""Gradient checkpointing recomputes a block in backward; ComfyUI's split and sub-quadratic attention (its CPU path,
and GPUs run with --use-split-cross-attention or without PyTorch attention) pick their chunking from the free memory
at call time (comfy/ldm/modules/attention.py: model_management.get_free_memory). Free memory moves between the
forward and the recompute (weight streaming, other processes): a recompute chunked otherwise saves other tensors
(torch's CheckpointError; ComfyUI's own TrainLoraNode crashed so on SD1.5). The reading is recorded in the forward and
replayed in the recompute: the same graph, the same result as when free memory stands still."""
from __future__ import annotations

import sys

import pytest
import torch

BIG = 64 << 30  # the forward's reading: everything in one chunk


def _less_free_memory(caller) -> int:
    """A reading that makes the attention that takes it chunk finer than with BIG, but still run: sub-quadratic
    attention just fits query chunks of 256 tokens (kv unchunked), split attention two slices."""
    local = caller.f_locals
    if caller.f_code.co_name == "attention_sub_quad":
        return local["batch_x_heads"] * local["bytes_per_token"] * 256 * 4 * local["k_tokens"]
    q, k = local["q"], local["k"]
    return q.shape[0] * q.shape[1] * k.shape[1] * q.element_size() * 3 // 2 + 1


def _free_memory(moving: bool):
    def get_free_memory(dev=None, torch_free_too=False):
        in_backward = torch._C._current_graph_task_id() != -1  # the recompute runs inside backward
        free = _less_free_memory(sys._getframe(1)) if moving and in_backward else BIG
        return (free, free) if torch_free_too else free

    return get_free_memory


def _trained(data, attention, checkpointing, moving, monkeypatch, name):
    import comfy.ldm.modules.attention as comfy_attention
    import comfy.model_management
    from test_train_lora_nodes import _init

    from headroom.nodes import train_lora as T
    from headroom.training.memory.policy import OffloadPolicy

    model, latents, texts = data
    monkeypatch.setattr(comfy_attention, "optimized_attention", getattr(comfy_attention, attention))
    monkeypatch.setattr(comfy_attention, "optimized_attention_masked", getattr(comfy_attention, attention))
    monkeypatch.setattr(comfy.model_management, "get_free_memory", _free_memory(moving))
    run = _init(model, latents, texts, name, rank=4, batch_size=2,
                policy=OffloadPolicy(checkpointing=checkpointing, checkpoint_depth=1))
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 1, checkpoint_minutes=0.0)
    monkeypatch.undo()
    return [p.detach().clone() for p in run.trainer.params]


@pytest.fixture(scope="module")
def sd15(comfyui):
    from test_train_lora_nodes import _data

    model, _, _, latents, texts = _data("sd15", count=2, resolution=256)  # 1024 tokens: several query chunks
    return model, latents, texts


@pytest.mark.parametrize("checkpointing", ["blocks", "blocks_cpu_offload"])
@pytest.mark.parametrize("attention", ["attention_sub_quad", "attention_split"])
def test_recompute_chunks_attention_as_the_forward_did(sd15, attention, checkpointing, monkeypatch):
    still = _trained(sd15, attention, checkpointing, False, monkeypatch, f"still_{attention}_{checkpointing}")
    moved = _trained(sd15, attention, checkpointing, True, monkeypatch, f"moved_{attention}_{checkpointing}")
    assert still and all(torch.equal(a, b) for a, b in zip(still, moved, strict=True))
