"""Every fingerprint / hash / index helper on tensors past 2**24 and 2**31 elements.

Real weights are that large (SDXL's biggest UNet weight has 29.5 M elements, CLIP-L's token embedding 38 M,
T5-XXL's 131 M); float32 index arithmetic goes wrong past 2**24 and int32 past 2**31. Tensors past 2**31
elements are strided or expanded views of a small buffer (or meta tensors), so no test needs gigabytes.
"""
from __future__ import annotations

import hashlib

import pytest
import torch

from headroom.training.data.cache_store import (
    HASH_CHUNK_BYTES, _sample_bytes, fingerprint_state_dict, fingerprint_value, sample_indices, tensor_digest,
)
from headroom.training.data.dataset import TensorImage

PAST_FLOAT32 = 29491200  # the SDXL weight that failed: linspace's float32 rounded the last index to numel
SIDE = 1 << 16  # a SIDE x SIDE view has 2**32 elements


def _overlapping_view(dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, view): view[i, j] == base[i + j], 2**32 elements over 2**17 stored ones."""
    base = torch.arange(2 * SIDE, dtype=torch.float64).to(dtype)
    return base, base.as_strided((SIDE, SIDE), (1, 1))


@pytest.mark.parametrize("numel", [2**24 + 1, PAST_FLOAT32, 2**31 + 3, 2**40 + 7])
def test_sample_indices_are_exact_past_float32_and_int32_range(numel):
    indices = sample_indices(numel, 1024)
    assert indices.dtype == torch.int64 and len(indices) == 1024
    assert indices[0] == 0 and indices[-1] == numel - 1  # float32 rounded this one to numel
    assert bool((indices[1:] > indices[:-1]).all())
    spacing = (numel - 1) / 1023
    expected = [int(k * (numel - 1) // 1023) for k in (1, 511, 1022)]
    assert [int(indices[k]) for k in (1, 511, 1022)] == expected
    assert all(abs(int(indices[k]) - k * spacing) < 1 for k in (1, 511, 1022))


def test_sample_indices_small_and_degenerate():
    assert sample_indices(5, 1024).tolist() == [0, 1, 2, 3, 4]
    assert sample_indices(0, 1024).tolist() == []
    assert sample_indices(10, 1).tolist() == [0]


def test_fingerprints_of_a_real_size_weight_see_its_last_element():
    weight = torch.zeros(PAST_FLOAT32, dtype=torch.bfloat16)
    base = fingerprint_state_dict({"w": weight})  # raised IndexError with float32 indices
    changed = weight.clone()
    changed[-1] = 1.0
    assert fingerprint_state_dict({"w": changed}) != base
    assert fingerprint_value({"patch": [weight]}) != fingerprint_value({"patch": [changed]})
    assert fingerprint_state_dict({"w": weight.reshape(4800, -1)}) != base  # the shape is part of it


def test_sampled_values_past_int32_come_from_the_right_elements():
    base, view = _overlapping_view()
    assert view.numel() == 2**32 and not view.is_contiguous()
    indices = sample_indices(view.numel(), 1024)
    rows, cols = indices // SIDE, indices % SIDE
    expected = base[rows + cols]  # view[i, j] == base[i + j]
    assert _sample_bytes(view, 1024) == expected.numpy().tobytes()
    assert expected[-1] == view[-1, -1]
    # the same values stored contiguously (where they fit) give the same bytes
    assert _sample_bytes(view[:2, :], 1024) == _sample_bytes(view[:2, :].contiguous(), 1024)


def test_fingerprints_past_int32_elements():
    base, view = _overlapping_view(torch.bfloat16)
    first = fingerprint_state_dict({"w": view})
    assert fingerprint_state_dict({"w": base.clone().as_strided((SIDE, SIDE), (1, 1))}) == first
    other = base.clone()
    other[-2] = -1.0  # view[-1, -1] == base[2 * SIDE - 2]: the last sampled element
    assert fingerprint_state_dict({"w": other.as_strided((SIDE, SIDE), (1, 1))}) != first
    assert fingerprint_value({"w": [view]}) != fingerprint_value({"w": [other.as_strided((SIDE, SIDE), (1, 1))]})
    meta = torch.empty(2**31 + 1, device="meta", dtype=torch.bfloat16)
    assert fingerprint_state_dict({"w": meta}) != fingerprint_state_dict({"w": meta.reshape(1, -1)})


def _expected_digest(tensor: torch.Tensor, chunks) -> str:
    hasher = hashlib.sha256(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    for chunk in chunks:
        hasher.update(chunk)
    return hasher.hexdigest()


def test_tensor_digest_past_float32_elements():
    tensor = torch.arange(2**24 + 5, dtype=torch.int32)
    assert tensor_digest(tensor) == _expected_digest(tensor, [tensor.numpy().tobytes()])
    strided = tensor[::2]  # non-contiguous: hashed in pieces, same bytes as its contiguous copy
    assert tensor_digest(strided) == tensor_digest(strided.contiguous())


def test_tensor_digest_past_int32_elements_without_materialising():
    numel = 2**31 + 5
    view = torch.tensor([7], dtype=torch.uint8).expand(numel)  # 2 GiB of values over one stored byte
    block = bytes([7]) * HASH_CHUNK_BYTES

    def chunks():
        left = numel
        while left:
            yield block[:min(left, len(block))]
            left -= min(left, len(block))

    assert tensor_digest(view) == _expected_digest(view, chunks())


def test_image_digest_past_float32_elements():
    pixels = torch.rand(2400, 2400, 3, generator=torch.Generator().manual_seed(0))  # 17.3 M values
    image = TensorImage(pixels, "big")
    assert image.digest() == hashlib.sha256(pixels.numpy().tobytes()).hexdigest()
    changed = pixels.clone()
    changed[-1, -1, -1] += 0.5
    assert TensorImage(changed, "big").digest() != image.digest()
