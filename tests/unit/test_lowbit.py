"""Low-bit frozen base: quantisation error, the on-the-fly product and its gradient, swapping in and out,
and LoRA training on top of it against its own reference (the same dequantised weights held in fp32)."""
from __future__ import annotations

import sys

import pytest
import torch

from headroom.training.core.adapters import AdapterConfig, AdapterSet, select_targets
from headroom.training.memory.checkpointing import wrap_blocks
from headroom.training.checks import MissingPackageError
from headroom.training.memory.lowbit import (STORAGES, LowBitBase, LowBitLinear, check_available, dequantize, quantize,
                                             storage_installed)
from headroom.training.memory.weight_streaming import WeightStreamer

MAX_RELATIVE_ERROR = {"fp8": 0.04, "int8": 0.01, "nf4": 0.12}


def frozen_linear(out_features=40, in_features=48, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features).requires_grad_(False)


@pytest.mark.parametrize("storage", STORAGES)
def test_quantisation_error_is_bounded(storage):
    weight = frozen_linear(96, 72).weight  # 72 wide: not a multiple of the NF4 block (see lowbit.py)
    restored = dequantize(quantize(weight, storage), storage, weight.shape, torch.float32)
    error = (restored - weight).norm() / weight.norm()
    assert 0 < error < MAX_RELATIVE_ERROR[storage]


@pytest.mark.parametrize("storage", STORAGES)
def test_product_and_input_gradient_match_the_dequantised_weight(storage):
    source = frozen_linear()
    layer = LowBitLinear(source, storage, "cpu")
    weight = layer.weight  # the dequantised weight, what the layer computes with
    x = torch.randn(3, 7, 48, requires_grad=True)
    out = layer(x)
    grad = torch.randn_like(out)
    (out * grad).sum().backward()
    expected_x = x.detach().clone().requires_grad_(True)
    expected = torch.nn.functional.linear(expected_x, weight, source.bias)
    (expected * grad).sum().backward()
    assert torch.equal(out, expected)
    torch.testing.assert_close(x.grad, expected_x.grad, rtol=1e-6, atol=1e-6)
    assert layer.packed_bytes() < source.weight.numel() * source.weight.element_size() / 2


def test_backward_keeps_only_the_packed_weight():
    layer = LowBitLinear(frozen_linear(), "nf4", "cpu")
    saved = []

    def pack(tensor):
        saved.append((tensor.dtype, tuple(tensor.shape)))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(torch.randn(2, 48, requires_grad=True))
    assert all(dtype != torch.float32 or shape != (40, 48) for dtype, shape in saved)  # no fp32 weight copy
    assert (torch.uint8, tuple(layer.weight_q.shape)) in saved


def test_base_swaps_in_and_out_the_same_modules():
    root = torch.nn.Sequential(frozen_linear(8, 8), torch.nn.ReLU(), torch.nn.Sequential(frozen_linear(8, 8, seed=1)))
    originals = [root[0], root[2][0]]
    base = LowBitBase(root, "fp8", "cpu", prefixes=["2"])
    assert root[0] is originals[0] and isinstance(root[2][0], LowBitLinear)
    replacement = root[2][0]
    base.detach()
    assert root[2][0] is originals[1]
    base.attach()
    assert root[2][0] is replacement
    assert base.packed_bytes() < base.original_bytes()


def test_clear_errors():
    root = torch.nn.Sequential(frozen_linear(8, 8))
    with pytest.raises(ValueError, match="not one of"):
        LowBitBase(root, "int4", "cpu")
    with pytest.raises(ValueError, match="no frozen Linear"):
        LowBitBase(torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1)), "fp8", "cpu")
    patched = frozen_linear(8, 8)
    patched.weight_function = [lambda w: w * 2]  # what ComfyUI's LoRA-in-lowvram patching leaves on a module
    with pytest.raises(ValueError, match="weight patches"):
        LowBitBase(torch.nn.Sequential(patched), "fp8", "cpu")
    base = LowBitBase(root, "fp8", "cpu")
    root[0] = torch.nn.Identity()
    with pytest.raises(RuntimeError, match="replaced by someone else"):
        base.detach()


@pytest.mark.parametrize("storage", ["int8", "nf4"])
def test_missing_bitsandbytes_is_a_clear_error(monkeypatch, storage):
    """bitsandbytes is optional (installing it may change the user's torch): a low-bit storage that needs it names
    the setting and the pip line, before any weight is swapped."""
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed
    root = torch.nn.Sequential(frozen_linear(8, 8))
    linear = root[0]
    with pytest.raises(MissingPackageError, match=rf"offload policy base_storage '{storage}' needs the pip package "
                       r"'bitsandbytes', which is not installed\. Install it into ComfyUI's Python: python -m pip "
                       r"install bitsandbytes \(Windows portable build, in its folder: python_embeded\\python\.exe -m "
                       r"pip install bitsandbytes\), then restart ComfyUI; or choose base_storage 'fp8'"):
        LowBitBase(root, storage, "cpu")
    assert root[0] is linear
    assert not storage_installed(storage) and storage_installed("fp8")
    LowBitBase(root, "fp8", "cpu").detach()  # pure torch: no package needed


def test_a_broken_bitsandbytes_says_reinstall(monkeypatch):
    from headroom.training import checks

    real = checks.importlib.import_module

    def broken(name):
        if name.startswith("bitsandbytes"):
            raise OSError("libbitsandbytes_cuda.so: cannot open shared object file")
        return real(name)

    monkeypatch.setattr(checks.importlib, "import_module", broken)
    with pytest.raises(MissingPackageError, match=r"installed but does not import \(libbitsandbytes_cuda.so.*"
                       r"Close ComfyUI \(Windows keeps a loaded package's files locked\), then reinstall it.*"
                       r"python -m pip install --force-reinstall --no-deps bitsandbytes.*then start ComfyUI again"):
        check_available("int8")
    check_available("fp8")


class Net(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = torch.nn.ModuleList([
            torch.nn.ModuleDict({"a": torch.nn.Linear(48, 96), "b": torch.nn.Linear(96, 48)}) for _ in range(2)])
        self.requires_grad_(False)

    def forward(self, x):
        for block in self.blocks:
            x = x + block["b"](torch.nn.functional.gelu(block["a"](x)))
        return x


class BlockCall(torch.nn.Module):
    """Blocks must be modules that are *called* for checkpointing and streaming: wrap the ModuleDicts."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return x + self.block["b"](torch.nn.functional.gelu(self.block["a"](x)))


def lora_train(net, steps=4, blocks=None):
    config = AdapterConfig(rank=4, alpha=4, targets="all_linear")
    adapters = AdapterSet(net, select_targets(net, None, config, ["blocks.0", "blocks.1"]), config)
    adapters.attach(net)
    optimizer = torch.optim.AdamW(adapters.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    calls = blocks or [lambda x, b=b: x + b["b"](torch.nn.functional.gelu(b["a"](x))) for b in net.blocks]
    for _ in range(steps):
        x = torch.randn(6, 48, generator=g)
        for call in calls:
            x = call(x)
        (x - 1).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    adapters.detach()
    return adapters.state_dict()


@pytest.mark.parametrize("storage", STORAGES)
def test_lora_on_low_bit_base_matches_its_own_reference(storage):
    net = Net()
    base = LowBitBase(net, storage, "cpu", prefixes=["blocks"])
    dequantised = {path: module.weight.clone() for path, module in base.replacements.items()}
    trained = lora_train(net)
    base.detach()

    reference = Net()  # the same architecture with the dequantised weights materialised in fp32
    with torch.no_grad():
        for path, weight in dequantised.items():
            reference.get_submodule(path).weight.copy_(weight)
    expected = lora_train(reference)
    for key in expected:
        relative = (trained[key] - expected[key]).norm() / expected[key].norm()
        assert relative <= 1e-3, (key, float(relative))


def test_low_bit_base_streams_and_checkpoints_bitwise():
    results = []
    for features in (False, True):
        net = Net()
        LowBitBase(net, "nf4", "cpu", prefixes=["blocks"])
        calls = [BlockCall(b) for b in net.blocks]
        if features:
            restore = wrap_blocks(calls, 1)
            with WeightStreamer(calls, "cpu", exercise_on_cpu=True) as streamer:
                results.append(lora_train(net, blocks=calls))
            restore()
            assert streamer.max_on_device <= 2
        else:
            results.append(lora_train(net, blocks=calls))
    for key in results[0]:
        assert torch.equal(results[0][key], results[1][key]), key
