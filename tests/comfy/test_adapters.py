"""Adapters: target selection, attach/detach that restores the module tree exactly, and export in
keys ComfyUI's own LoRA loader reproduces (checked against the real comfy.lora / weight_adapter)."""
from __future__ import annotations

import re

import pytest
import torch

from headroom.training.core.adapters import AdapterConfig, AdapterSet, select_targets
from headroom.training.memory.planner import TrainableSpec


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 48)
        self.conv = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.norm = torch.nn.LayerNorm(32)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = torch.nn.Linear(4, 32)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.requires_grad_(False).eval()


def _randomize(adapters: AdapterSet, seed=1):
    """Non-zero adapter weights (LoRA B / LoHa w2_b start at zero, which would make every check trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapters.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.ndim == 1 else 0.0))


def test_attach_and_detach_restore_the_original_modules_exactly():
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    originals = {name: module for name, module in net.named_modules()}
    config = AdapterConfig(rank=4, alpha=8, targets="all_linear", include_conv=True)
    paths = select_targets(net, None, config, ["blocks.0", "blocks.1"])
    assert paths == ["blocks.0.lin", "blocks.0.conv", "blocks.1.lin", "blocks.1.conv"]
    adapters = AdapterSet(net, paths, config)
    x = torch.randn(2, 32)
    reference = net.blocks[0].lin(x)
    adapters.attach(net)
    assert type(net.blocks[0].lin).__module__.startswith("peft")
    torch.testing.assert_close(net.blocks[0].lin(x), reference)  # LoRA B starts at zero: same output
    _randomize(adapters)
    assert not torch.allclose(net.blocks[0].lin(x), reference)
    adapters.detach()
    assert all(module is originals[name] for name, module in net.named_modules())
    assert net.state_dict().keys() == before.keys()
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert not any(p.requires_grad for p in net.parameters()) and not net.training
    assert all(p.dtype == torch.float32 and p.requires_grad for p in adapters.parameters())


def test_state_dict_round_trip_and_seeded_init():
    config = AdapterConfig(kind="loha", rank=2, alpha=2, targets="all_linear")
    first = AdapterSet(Net(), ["blocks.0.lin"], config)
    second = AdapterSet(Net(), ["blocks.0.lin"], config)
    assert all(torch.equal(v, second.state_dict()[k]) for k, v in first.state_dict().items())
    _randomize(first)
    second.load_state_dict(first.state_dict())
    assert all(torch.equal(v, second.state_dict()[k]) for k, v in first.state_dict().items())
    with pytest.raises(ValueError, match="does not match"):
        AdapterSet(Net(), ["blocks.1.lin"], config).load_state_dict(first.state_dict())


def test_full_kind_trains_the_runs_own_copy_of_the_weights():
    """kind full: the run's own copy W' of each trained weight starts as the base's, so the output starts as the base
    layer's exactly; its gradient is the base weight's own (each optimizer step is the full fine-tune's); after a
    change the layer computes with W' alone (the base layer is never called); the base weights are never written; the
    export holds ComfyUI's diff keys, W' - W, nothing else."""
    net, twin = Net(), Net()
    paths = ["blocks.0.lin", "blocks.0.conv"]
    before = {k: v.clone() for k, v in net.state_dict().items()}
    adapters = AdapterSet(net, paths, AdapterConfig(kind="full", rank=1, alpha=1.0))
    adapters.attach(net)
    inputs = {"blocks.0.lin": torch.randn(3, 32), "blocks.0.conv": torch.randn(2, 8, 5, 5)}
    for path in paths:
        layer, reference = net.get_submodule(path), twin.get_submodule(path)
        reference.requires_grad_(True)
        assert torch.equal(layer(inputs[path]), reference(inputs[path]))
        (layer(inputs[path]) ** 2).sum().backward()
        (reference(inputs[path]) ** 2).sum().backward()
        torch.testing.assert_close(layer.full_trained_weight.grad, reference.weight.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(layer.full_trained_bias.grad, reference.bias.grad, rtol=1e-5, atol=1e-6)
        layer.base_layer.register_forward_pre_hook(lambda *_: pytest.fail("the base layer was called"))
    _randomize(adapters)
    with torch.no_grad():
        lin, conv = net.blocks[0].lin, net.blocks[0].conv
        torch.testing.assert_close(lin(inputs["blocks.0.lin"]), torch.nn.functional.linear(
            inputs["blocks.0.lin"], lin.full_trained_weight, lin.full_trained_bias))
        torch.testing.assert_close(conv(inputs["blocks.0.conv"]), conv.base_layer._conv_forward(
            inputs["blocks.0.conv"], conv.full_trained_weight, conv.full_trained_bias))
        exported = adapters.comfy_state_dict(prefix="")
        assert torch.equal(exported["blocks.0.lin.diff"], lin.full_trained_weight - lin.base_layer.weight)
        assert torch.equal(exported["blocks.0.conv.diff_b"], conv.full_trained_bias - conv.base_layer.bias)
    adapters.detach()
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert sorted(adapters.comfy_state_dict(prefix="")) == [
        "blocks.0.conv.diff", "blocks.0.conv.diff_b", "blocks.0.lin.diff", "blocks.0.lin.diff_b"]
    assert adapters.parameter_count() == 48 * 32 + 48 + 16 * 8 * 9 + 16
    # The planner counts the same tensors from the layers' shapes.
    spec = TrainableSpec.of_full_layers([twin.get_submodule(p) for p in paths])
    assert spec.param_count == adapters.parameter_count() and spec.param_bytes() == 4 * spec.param_count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_full_kinds_product_has_torchs_gradients_and_keeps_no_cast_copy(layer, dtype):
    """The trained weight's product (adapters._CastProduct) gives torch's own gradients for the input, the weight
    and its bias (a strided, dilated, grouped conv; a linear on [B, T, C]), and what it keeps for backward is the input
    and the weight itself: no copy cast to the compute dtype (torch's linear / conv would keep one)."""
    from headroom.training.core.adapters import _CastProduct

    torch.manual_seed(0)
    if layer == "linear":
        x, weight, bias, conv = torch.randn(2, 5, 12), torch.randn(7, 12), torch.randn(7), None
        reference = lambda x, w, b: torch.nn.functional.linear(x, w, b)  # noqa: E731
    else:
        x, weight, bias, conv = torch.randn(2, 4, 9, 9), torch.randn(6, 2, 3, 3), torch.randn(6), (2, 1, 2, 2)
        reference = lambda x, w, b: torch.nn.functional.conv2d(x, w, b, *conv)  # noqa: E731
    weight, bias = weight.to(dtype), bias.to(dtype)
    ours = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    theirs = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = _CastProduct.apply(ours[0], ours[1], ours[2], conv)
    expected = reference(theirs[0], theirs[1].float(), theirs[2].float())
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for a, b in zip(ours, theirs):
        assert a.grad.dtype == a.dtype
        torch.testing.assert_close(a.grad, b.grad, **({"rtol": 1e-2, "atol": 1e-2} if a.dtype == torch.bfloat16 else {}))
    assert len(saved) == 2 and saved[0] is ours[0] and saved[1] is ours[1]


@pytest.mark.parametrize("shape", [(5, 12), (2, 5, 12), (2, 3, 5, 12)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_full_kinds_linear_is_torchs_bit_for_bit_and_takes_an_in_place_residual(shape, with_bias):
    """torch's linear returns a [B, T, C] input's product with a bias as a view; out of a custom Function a view cannot
    be changed in place (model code adding a residual with += stopped the step) and FSDP2 warned at every sharded
    layer. The product is torch's bit for bit (under autocast too), not a view, and a residual added in place trains
    through it."""
    from headroom.training.core.adapters import _CastProduct

    torch.manual_seed(0)
    x, weight = torch.randn(shape, requires_grad=True), torch.randn(7, 12, requires_grad=True)
    bias = torch.randn(7, requires_grad=True) if with_bias else None
    out = _CastProduct.apply(x, weight, bias, None)
    assert torch.equal(out, torch.nn.functional.linear(x, weight, bias)) and not out._is_view()
    residual = torch.randn(out.shape)
    out += residual
    out.square().sum().backward()
    expected = [t.detach().clone().requires_grad_(True) for t in (x, weight)]
    (torch.nn.functional.linear(*expected, bias.detach() if with_bias else None) + residual).square().sum().backward()
    torch.testing.assert_close(x.grad, expected[0].grad)
    torch.testing.assert_close(weight.grad, expected[1].grad)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as precision bf16 runs it: in autocast's dtype, as torch's
        mixed = _CastProduct.apply(x, weight, bias, None)
        assert torch.equal(mixed, torch.nn.functional.linear(x, weight, bias)) and mixed.dtype == torch.bfloat16


def test_bad_adapter_settings():
    with pytest.raises(ValueError, match="rank=0 must be a positive integer"):
        AdapterConfig(rank=0).validate()
    with pytest.raises(ValueError, match="adapter kind 'boft'"):
        AdapterConfig(kind="boft").validate()
    with pytest.raises(ValueError, match="kind full trains the weights themselves.*set dropout to 0"):
        AdapterConfig(kind="full", dropout=0.1).validate()
    with pytest.raises(ValueError, match="kind full cannot start from the LoRA file a.safetensors"):
        AdapterConfig(kind="full", init_lora="a.safetensors").validate()
    with pytest.raises(ValueError, match="model has no LoRA target preset \\(presets: sd15, wan\\).*all_linear"):
        select_targets(Net(), None, AdapterConfig(), ["blocks.0"], presets=["sd15", "wan"])
    with pytest.raises(ValueError, match="needs the model's blocks"):
        select_targets(Net(), None, AdapterConfig(targets="all_linear"), [])


class Deep(torch.nn.Module):
    """Twelve blocks, so block 1 and blocks 10 / 11 share a prefix, as in real models."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(12)])
        self.requires_grad_(False)


def test_layers_keeps_the_matching_targets_and_leaves_out_the_excluded():
    net, blocks = Deep(), [f"blocks.{i}" for i in range(12)]
    everything = select_targets(net, None, AdapterConfig(targets="all_linear", include_conv=True), blocks)
    assert len(everything) == 24

    def picked(layers):
        return select_targets(net, None, AdapterConfig(targets="all_linear", include_conv=True, layers=layers), blocks)

    assert picked("") == picked("  \n ") == everything
    assert picked("blocks.1.") == ["blocks.1.lin", "blocks.1.conv"]  # the dot: not blocks 10, 11
    assert picked("blocks.1") == ["blocks.1.lin", "blocks.1.conv", "blocks.10.lin", "blocks.10.conv",
                                  "blocks.11.lin", "blocks.11.conv"]
    assert picked("lin") == [p for p in everything if p.endswith(".lin")]
    assert picked("!conv") == picked("lin")  # excluding only: every other target
    # include several (commas, spaces, lines), then leave some out; regular expressions work
    assert picked("blocks.1., blocks.2.\nblocks.3. !conv") == ["blocks.1.lin", "blocks.2.lin", "blocks.3.lin"]
    # the shell's wildcards, dots literal: ? one character, * any text, [..] one of
    assert picked("blocks.1?.conv") == ["blocks.10.conv", "blocks.11.conv"]
    assert picked("blocks.[05].*conv") == ["blocks.0.conv", "blocks.5.conv"]
    # the filter applies within targets: all_linear without convolutions has no conv to keep
    assert select_targets(net, None, AdapterConfig(targets="all_linear", layers="blocks.0."), blocks) == ["blocks.0.lin"]


def test_layers_refuses_what_would_train_the_wrong_layers():
    net, blocks = Deep(), [f"blocks.{i}" for i in range(12)]

    def pick(layers):
        return select_targets(net, None, AdapterConfig(targets="all_linear", layers=layers), blocks)

    # a name of another naming scheme (diffusers') matches nothing: refused, showing this model's names
    with pytest.raises(ValueError, match=r"LoRA Config layers: 'transformer_blocks' matches none of the 12 layers "
                                         r"targets=all_linear selects \(named like blocks.0.lin, blocks.6.lin, "
                                         r"blocks.11.lin\); these are ComfyUI's layer names"):
        pick("blocks.0., transformer_blocks")
    with pytest.raises(ValueError, match=r"'!norm' matches none of the 12 layers"):
        pick("!norm")  # the LayerNorms are not targets
    with pytest.raises(ValueError, match=r"layers 'lin !blocks' leaves none of the 12 layers .* to train: exclude less"):
        pick("lin !blocks")
    with pytest.raises(ValueError, match=r"'BLOCKS.0.' matches none"):
        pick("BLOCKS.0.")  # case-sensitive on every OS (fnmatch.fnmatch would not be on Windows)
    # refused when the LoRA Config node runs, before any model is seen
    with pytest.raises(ValueError, match="a lone '!' leaves nothing out"):
        AdapterConfig(layers="attn ! mlp").validate()
    with pytest.raises(ValueError, match="65 patterns, over 64"):
        AdapterConfig(layers=" ".join(f"blocks.{i}." for i in range(65))).validate()
    with pytest.raises(ValueError, match="201 characters, over 200"):
        AdapterConfig(layers="a" * 201).validate()


# The pattern=value pairs after the first of the per-layer inputs' tests: conv layers 2, block 1's linear 8.
FIRST_MATCH_TAIL = "conv=2 blocks.1.=8"


def _deep_targets(**settings):
    """(Deep, the config of `settings`, the 24 linear and conv layers targets=all_linear with include_conv selects)."""
    net = Deep()
    config = AdapterConfig(targets="all_linear", include_conv=True, **settings)
    return net, config, select_targets(net, None, config, [f"blocks.{i}" for i in range(12)])


def _check_first_match_wins(per_layer: dict, first, default) -> None:
    """A per-layer input of "blocks.1?.=<first>, " + FIRST_MATCH_TAIL: each layer takes its first matching pair."""
    assert per_layer["blocks.10.lin"] == per_layer["blocks.11.conv"] == first  # blocks.1?. before conv
    assert per_layer["blocks.0.conv"] == per_layer["blocks.1.conv"] == 2 and per_layer["blocks.1.lin"] == 8
    assert per_layer["blocks.0.lin"] == default


@pytest.mark.parametrize("kind", ["lora", "loha", "full"])
def test_layer_lr_scales_give_each_layers_tensors_their_rate(kind):
    """layer_lr_scales: each trained tensor at its layer's scale (the first pattern that matches it, 1 where none
    does), times the LoRA+ ratio for a LoRA's up matrices; refused: a pattern matching no trained layer, malformed
    pairs, scales outside (0, 100]."""
    from headroom.training.core.adapters import layer_lr_scales

    net, config, paths = _deep_targets(kind=kind, rank=2, layer_lr_scales=f"blocks.1?.=0.5, {FIRST_MATCH_TAIL}")
    per_layer = layer_lr_scales(paths, config)
    _check_first_match_wins(per_layer, 0.5, 1.0)
    adapters = AdapterSet(net, paths, config)
    names = [(path, name) for path, layer in adapters.layers.items() for name, _ in adapters._own_parameters(layer)]
    expected = [per_layer[path] for path, _ in names]
    assert adapters.learning_rate_scales() == expected and len(expected) == len(adapters.parameters())
    if kind == "lora":  # LoRA+ on top: the up matrices at 4x their layer's scale
        assert adapters.learning_rate_scales(4.0) == [s * (4.0 if name.startswith("lora_B") else 1.0)
                                                       for s, (_, name) in zip(expected, names)]
    with pytest.raises(ValueError, match=r"LoRA Config layer_lr_scales: 'attn' matches none of the 24 trained layers"):
        layer_lr_scales(paths, AdapterConfig(layer_lr_scales="attn=2"))
    for text, message in (("blocks.1", "'blocks.1' is not pattern=scale"), ("=2", "'=2' is not pattern=scale"),
                          ("lin=fast", "'lin=fast': the scale must be above 0"), ("lin=0", "'lin=0': the scale must be above 0"),
                          ("lin=nan", "'lin=nan': the scale must be above 0"), ("lin=101", "'lin=101': .* at most 100")):
        with pytest.raises(ValueError, match=f"layer_lr_scales: {message}"):
            AdapterConfig(layer_lr_scales=text).validate()


def test_layer_ranks_give_each_layer_its_rank():
    """layer_ranks: each layer at the rank of the first pattern that matches it (the config's where none does); the
    trainable tensors shrink and grow with it; refused: a pattern matching no trained layer, malformed pairs, ranks
    outside 1-1024, kinds without a low-rank size; a saved LoRA of another rank at a layer cannot be continued."""
    from headroom.training.core.adapters import layer_ranks

    net, config, paths = _deep_targets(rank=4, layer_ranks=f"blocks.1?.=1, {FIRST_MATCH_TAIL}")
    ranks = layer_ranks(paths, config)
    _check_first_match_wins(ranks, 1, 4)
    adapters = AdapterSet(net, paths, config)
    for path, layer in adapters.layers.items():
        assert layer.lora_A["default"].weight.shape[0] == layer.lora_B["default"].weight.shape[1] == ranks[path]
        assert layer.scaling["default"] == config.alpha / ranks[path]  # one alpha for all, as kohya's block_dims
    uniform = AdapterSet(Deep(), paths, AdapterConfig(rank=4, targets="all_linear", include_conv=True))
    assert adapters.parameter_count() != uniform.parameter_count()
    with pytest.raises(ValueError, match=r"LoRA Config layer_ranks: 'attn' matches none of the 24 trained layers"):
        layer_ranks(paths, AdapterConfig(layer_ranks="attn=2"))
    for text, message in (("blocks.1", "'blocks.1' is not pattern=rank"), ("lin=0", "'lin=0': the rank must be a "
                          "whole number from 1 to 1024"), ("lin=2.5", "'lin=2.5': the rank"), ("lin=1025", "'lin=1025'"),
                          ("lin=-1", "'lin=-1'"), ("lin=\u00b2", "'lin=\u00b2': the rank"), ("lin=" + "9" * 400, "the pattern "
                          "'lin=9+'... is 404 characters, over 200")):
        with pytest.raises(ValueError, match=f"layer_ranks: {message}"):
            AdapterConfig(layer_ranks=text).validate()
    for kind, why in (("oft", "its rank is the block size"), ("full", "it trains the weights themselves")):
        with pytest.raises(ValueError, match=f"layer_ranks sets a low-rank size per layer, and kind {kind} has none "
                                             f"\\({why}"):
            AdapterConfig(kind=kind, layer_ranks="lin=2").validate()
    # continuing a saved LoRA: each layer's rank must be the file's there, and the message says which input to change
    saved = {path: (layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach(), 1.0)
             for path, layer in adapters.layers.items()}
    with pytest.raises(ValueError, match=r"has rank 2 at blocks.0.conv; set the LoRA config's rank to 2 to continue it"):
        uniform.start_from(saved, "saved.safetensors")
    with pytest.raises(ValueError, match=r"has rank 4 at blocks.1.lin; set the LoRA config's layer_ranks to give it "
                                         r"rank 4 there \(now 8\) to continue it"):
        AdapterSet(Deep(), paths, AdapterConfig(rank=4, targets="all_linear", include_conv=True,
                                                layer_ranks="blocks.1.lin=8")).start_from(
            {path: (torch.zeros(4, 1), torch.zeros(1, 4), 1.0) for path in ["blocks.1.lin"]}, "saved.safetensors")
    same = AdapterSet(Deep(), paths, config)
    same.start_from(saved, "saved.safetensors")
    assert all(torch.equal(same.layers[p].lora_B["default"].weight, adapters.layers[p].lora_B["default"].weight)
               for p in paths)


@pytest.mark.parametrize("kind", ["lora", "dora", "loha", "lokr"])
def test_layer_alphas_give_each_layer_its_alpha(kind):
    """layer_alphas: each layer's alpha the first pattern's that matches it (the config's where none does), its scale
    that alpha / its rank, with layer_ranks too (kohya's conv_dim + conv_alpha); refused: a pattern matching no trained
    layer, malformed pairs, alphas outside (0, 4096] or not written in ASCII digits, kinds oft and full. A saved LoRA
    whose layers have other alphas is continued with the same effect (its up rescaled by the file's scale over the
    layer's)."""
    from headroom.training.core.adapters import layer_alphas, layer_ranks

    net, config, paths = _deep_targets(kind=kind, rank=4, alpha=4.0, layer_alphas=f"blocks.1?.=0.5, {FIRST_MATCH_TAIL}",
                                       layer_ranks="conv=8")
    alphas, ranks = layer_alphas(paths, config), layer_ranks(paths, config)
    _check_first_match_wins(alphas, 0.5, 4.0)
    adapters = AdapterSet(net, paths, config)
    for path, layer in adapters.layers.items():
        alpha = layer.lora_alpha["default"] if kind in ("lora", "dora") else layer.alpha["default"]
        assert alpha == alphas[path] and layer.scaling["default"] == alphas[path] / ranks[path]
    assert {layer.scaling["default"] for layer in adapters.layers.values()} == {0.5 / 4, 0.5 / 8, 2 / 8, 8 / 4, 1.0}
    with pytest.raises(ValueError, match=r"LoRA Config layer_alphas: 'attn' matches none of the 24 trained layers"):
        layer_alphas(paths, AdapterConfig(layer_alphas="attn=2"))
    for text, message in (("blocks.1", "'blocks.1' is not pattern=alpha"), ("lin=0", "'lin=0': the alpha must be above "
                          "0 and at most 4096"), ("lin=4097", "'lin=4097'"), ("lin=-1", "'lin=-1'"), ("lin=nan", "'lin=nan'"),
                          ("lin=inf", "'lin=inf'"), ("lin=1_0", "'lin=1_0'"), ("lin=\u0661", "'lin=\u0661': the alpha"),
                          ("lin=1e999", "'lin=1e999'")):
        with pytest.raises(ValueError, match=f"layer_alphas: {message}"):
            AdapterConfig(layer_alphas=text).validate()
    for bad_kind, why in (("oft", "its alpha is the constraint of the rotations"),
                          ("full", "it trains the weights themselves")):
        with pytest.raises(ValueError, match=f"layer_alphas sets the alpha of a low-rank scale per layer, and kind "
                                             f"{bad_kind} has none \\({why}"):
            AdapterConfig(kind=bad_kind, rank=4, layer_alphas="lin=2").validate()
    if kind != "lora":
        return
    # continuing a saved LoRA of these alphas with one alpha for all: the same product, so the same effect
    _randomize(adapters)
    saved = {path: (layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach(),
                    layer.scaling["default"]) for path, layer in adapters.layers.items()}
    uniform = AdapterSet(Deep(), paths, AdapterConfig(rank=4, alpha=4.0, targets="all_linear", include_conv=True,
                                                      layer_ranks="conv=8"))
    uniform.start_from(saved, "saved.safetensors")
    for path, layer in uniform.layers.items():
        product = layer.lora_B["default"].weight.flatten(1) @ layer.lora_A["default"].weight.flatten(1)
        original = adapters.layers[path]
        expected = original.lora_B["default"].weight.flatten(1) @ original.lora_A["default"].weight.flatten(1)
        torch.testing.assert_close(product * layer.scaling["default"], expected * original.scaling["default"])


@pytest.mark.comfyui
@pytest.mark.parametrize("kind,rank,layer_ranks,layer_alphas", [
    ("lora", 4, "", ""), ("dora", 4, "", ""), ("loha", 3, "", ""), ("lokr", 2, "", ""), ("lokr", 8, "", ""),
    ("oft", 4, "", ""), ("oft", 16, "", ""), ("full", 1, "", ""), ("lora", 4, "conv=2", ""), ("dora", 4, "lin=8", ""),
    ("loha", 3, "conv=5", ""), ("lokr", 8, "lin=2", ""), ("lora", 4, "conv=2", "conv=1"), ("dora", 4, "", "lin=0.5"),
    ("loha", 3, "conv=5", "conv=2.5"), ("lokr", 8, "", "lin=32")])
def test_export_is_reproduced_by_comfyui_lora_loading(comfyui, kind, rank, layer_ranks, layer_alphas):
    """peft's forward == the base layer run with the weight ComfyUI's stock LoRA path computes from our file; with
    layer_ranks / layer_alphas, a layer of another rank or alpha (its scale its alpha / its rank) too."""
    import comfy.lora

    net = Net()
    paths = ["blocks.0.lin", "blocks.0.conv"]
    adapters = AdapterSet(net, paths, AdapterConfig(kind=kind, rank=rank, alpha=rank * 1.5, layer_ranks=layer_ranks,
                                                    layer_alphas=layer_alphas))
    if layer_ranks or layer_alphas:
        pattern, _, other = layer_ranks.partition("=")
        expected_ranks = {path: int(other) if pattern and pattern in path else rank for path in paths}
        pattern, _, other = layer_alphas.partition("=")
        expected_alphas = {path: float(other) if pattern and pattern in path else rank * 1.5 for path in paths}
        assert {path: layer.r["default"] for path, layer in adapters.layers.items()} == expected_ranks
        assert {path: layer.scaling["default"] for path, layer in adapters.layers.items()} == {
            path: expected_alphas[path] / expected_ranks[path] for path in paths}
    _randomize(adapters)
    exported = adapters.comfy_state_dict(prefix="diffusion_model.")
    key_map = {f"diffusion_model.{p}": f"diffusion_model.{p}.weight" for p in paths}
    patches = comfy.lora.load_lora(exported, key_map)
    biases = [f"diffusion_model.{p}.bias" for p in paths] if kind == "full" else []  # full: the biases too
    assert sorted(patches) == sorted([*key_map.values(), *biases])
    adapters.attach(net)
    inputs = {"blocks.0.lin": torch.randn(3, 32), "blocks.0.conv": torch.randn(2, 8, 5, 5)}
    for path in paths:
        layer = net.get_submodule(path)
        base = layer.get_base_layer()
        key = f"diffusion_model.{path}.weight"
        merged = comfy.lora.calculate_weight([(1.0, patches[key], 1.0, None, None)], base.weight.detach().clone(), key)
        bias_key = f"diffusion_model.{path}.bias"
        bias = base.bias if bias_key not in patches else comfy.lora.calculate_weight(
            [(1.0, patches[bias_key], 1.0, None, None)], base.bias.detach().clone(), bias_key)
        if isinstance(base, torch.nn.Linear):
            expected = torch.nn.functional.linear(inputs[path], merged, bias)
        else:
            expected = base._conv_forward(inputs[path], merged, bias)
        with torch.no_grad():
            actual = layer(inputs[path])
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.comfyui
@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_layer_ranks_of_kohyas_conv_dim_give_the_3x3_convolutions_their_rank(comfyui, family):
    """docs/COMING_FROM.md maps kohya's conv_dim (LoCon) to include_conv with these layer_ranks: every 3x3
    convolution of the UNet blocks (ResBlocks, down- and upsamplers) at that rank, the 1x1 ones (skip connections,
    SD1.5's transformer projections) and the linear layers at the rank, as kohya's network does."""
    from headroom.nodes.bridge import families
    from headroom.nodes.bridge.tiny_models import build_tiny_model_patcher
    from headroom.training.core.adapters import layer_ranks

    root = build_tiny_model_patcher(family, 0).model.diffusion_model
    config = AdapterConfig(rank=16, include_conv=True, layer_ranks="in_layers=8 out_layers=8 .op=8 .conv=8")
    paths = select_targets(root, families.lora_preset(family), config, [])
    ranks = layer_ranks(paths, config)
    modules = {path: root.get_submodule(path) for path in paths}
    three = {p for p, m in modules.items() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3)}
    assert three and any(p.endswith(".op") for p in three) and any(p.endswith(".conv") for p in three)
    assert {p for p, rank in ranks.items() if rank == 8} == three
    assert any(isinstance(m, torch.nn.Conv2d) and m.kernel_size == (1, 1) for p, m in modules.items() if ranks[p] == 16)


@pytest.mark.comfyui
def test_family_presets_pick_the_documented_layers(comfyui):
    from headroom.nodes.bridge import families
    from headroom.nodes.bridge.comfy_model import model_blocks, model_family
    from headroom.nodes.bridge.tiny_models import build_tiny_model_patcher

    picked = {}
    for family in ("sd15", "sd2", "sdxl", "sd3", "flux", "flux2", "chroma", "zimage", "qwen_image",
                   "hidream", "hunyuan_image", "krea2", "hidream_o1", "ideogram4", "wan21", "hunyuan_video15", "ltx2"):
        model = build_tiny_model_patcher(family, 0).model
        assert model_family(model) == family
        blocks = [n for n, _ in model_blocks(model.diffusion_model)]
        preset = families.lora_preset(family)
        picked[family] = select_targets(model.diffusion_model, preset, AdapterConfig(), blocks)
        with_conv = select_targets(model.diffusion_model, preset, AdapterConfig(include_conv=True), blocks)
        everything = select_targets(model.diffusion_model, preset, AdapterConfig(targets="all_layers"), blocks)
        assert set(picked[family]) <= set(with_conv) <= set(everything)
    assert all(p.rsplit(".", 2)[-2] in ("attn1", "attn2") or p.endswith("to_out.0") for p in picked["sd15"])
    assert len(picked["sd15"]) == 4 * 2 * len([p for p in picked["sd15"] if p.endswith("attn1.to_q")])
    assert any(".0.conv" in p or "in_layers" in p for p in
               select_targets(build_tiny_model_patcher("sd15", 0).model.diffusion_model, families.lora_preset("sd15"),
                              AdapterConfig(include_conv=True), []))
    assert all(p.startswith("joint_blocks.") and p.split(".")[2] in ("context_block", "x_block") for p in picked["sd3"])
    assert sorted({p.split(".", 3)[3] for p in picked["sd3"]}) == ["attn.proj", "attn.qkv", "mlp.fc1", "mlp.fc2"]
    flux_single = [p for p in picked["flux"] if p.startswith("single_blocks.")]
    assert sorted({p.split(".", 2)[2] for p in flux_single}) == ["linear1", "linear2"]
    assert sorted({p.split(".", 2)[2] for p in picked["flux"] if p.startswith("double_blocks.")}) == [
        "img_attn.proj", "img_attn.qkv", "img_mlp.0", "img_mlp.2", "txt_attn.proj", "txt_attn.qkv", "txt_mlp.0",
        "txt_mlp.2"]
    # Flux.2: the same block layers (its MLPs' gated in-projection is mlp.0); its shared modulation layers
    # (double_stream_modulation_*, single_stream_modulation) stay frozen.
    assert sorted({re.sub(r"^(double|single)_blocks\.\d+\.", "", p) for p in picked["flux2"]}) == [
        "img_attn.proj", "img_attn.qkv", "img_mlp.0", "img_mlp.2", "linear1", "linear2", "txt_attn.proj",
        "txt_attn.qkv", "txt_mlp.0", "txt_mlp.2"]
    assert len(picked["flux2"]) == 8 + 2 * 2 and not any("modulation" in p for p in picked["flux2"])
    # Z-Image: the main layers only (not the refiners, not the modulation), as musubi-tuner's default.
    assert {p.split(".", 2)[0] for p in picked["zimage"]} == {"layers"}
    assert sorted({p.split(".", 2)[2] for p in picked["zimage"]}) == [
        "attention.out", "attention.qkv", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    assert len(picked["zimage"]) == 5 * 2
    assert sorted({p.split(".", 2)[2] for p in picked["qwen_image"]}) == [
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k", "attn.to_out.0",
        "attn.to_q", "attn.to_v", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]
    # Wan: self- and cross-attention projections and the feed-forward of each block (musubi-tuner's default).
    assert sorted({p.split(".", 2)[2] for p in picked["wan21"]}) == [
        "cross_attn.k", "cross_attn.o", "cross_attn.q", "cross_attn.v", "ffn.0", "ffn.2", "self_attn.k", "self_attn.o",
        "self_attn.q", "self_attn.v"]
    assert len(picked["wan21"]) == 10 * 2
    # HunyuanVideo 1.5: Flux's block layers (one double, one single block in the tiny model); the modulation, the text
    # refiner and the byT5 / vision mappers stay frozen.
    assert sorted({re.sub(r"^(double|single)_blocks\.\d+\.", "", p) for p in picked["hunyuan_video15"]}) == [
        "img_attn.proj", "img_attn.qkv", "img_mlp.0", "img_mlp.2", "linear1", "linear2", "txt_attn.proj",
        "txt_attn.qkv", "txt_mlp.0", "txt_mlp.2"]
    # LTX-2: the video stream's self- / text cross-attention and feed-forward of each block; the audio stream, the
    # audio <-> video cross-attention and the connectors stay frozen.
    assert sorted({p.split(".", 2)[2] for p in picked["ltx2"]}) == [
        "attn1.to_k", "attn1.to_out.0", "attn1.to_q", "attn1.to_v", "attn2.to_k", "attn2.to_out.0", "attn2.to_q",
        "attn2.to_v", "ff.net.0.proj", "ff.net.2"]
    assert len(picked["ltx2"]) == 10 * 2
    # SD2 / SDXL: the UNet attention projections as SD1's; Chroma: Flux's layers (its blocks have no modulation)
    for family in ("sd2", "sdxl"):
        assert picked[family] and all(p.rsplit(".", 2)[-2] in ("attn1", "attn2") or p.endswith("to_out.0")
                                      for p in picked[family])
    assert not any(p.startswith("input_blocks.1.") for p in picked["sdxl"])  # SDXL: no attention at the first level
    assert {p.split(".", 2)[2] for p in picked["chroma"]} == {p.split(".", 2)[2] for p in picked["flux"]}
    assert not any(p.startswith("distilled_guidance_layer") for p in picked["chroma"])
    # HiDream: attention of both streams and the shared / text feed-forwards; the routed experts stay frozen.
    assert sorted({re.sub(r"^(double|single)_stream_blocks\.\d+\.block\.", "", p) for p in picked["hidream"]}) == [
        "attn1.to_k", "attn1.to_k_t", "attn1.to_out", "attn1.to_out_t", "attn1.to_q", "attn1.to_q_t", "attn1.to_v",
        "attn1.to_v_t", "ff_i.shared_experts.w1", "ff_i.shared_experts.w2", "ff_i.shared_experts.w3", "ff_t.w1",
        "ff_t.w2", "ff_t.w3"]
    assert not any("experts." in p and "shared_experts" not in p for p in picked["hidream"])
    # HunyuanImage 2.1: Flux's block layers; the text refiner, the byT5 mapper and the modulation stay frozen.
    assert {p.split(".", 2)[2] for p in picked["hunyuan_image"]} == {p.split(".", 2)[2] for p in picked["flux"]}
    assert len(picked["hunyuan_image"]) == 8 + 2
    # Krea 2: every Linear of the main blocks (attention with its gate, SwiGLU MLP); the embedders, the text-fusion
    # blocks and the final layer stay frozen. Its blocks have no modulation Linear, so all_linear picks the same.
    assert {p.split(".", 2)[0] for p in picked["krea2"]} == {"blocks"}
    assert sorted({p.split(".", 2)[2] for p in picked["krea2"]}) == [
        "attn.gate", "attn.wk", "attn.wo", "attn.wq", "attn.wv", "mlp.down", "mlp.gate", "mlp.up"]
    assert len(picked["krea2"]) == 8 * 2
    krea2 = build_tiny_model_patcher("krea2", 0).model.diffusion_model
    assert select_targets(krea2, families.lora_preset("krea2"), AdapterConfig(targets="all_linear"),
                          [n for n, _ in model_blocks(krea2)]) == picked["krea2"]
    # Ideogram 4: attention (fused qkv, o) and SwiGLU feed-forward of every block, as musubi-tuner's Ideogram 4 LoRA;
    # the blocks' adaLN modulation (which all_linear adds), the embedders and the final layer stay frozen.
    assert {p.split(".", 2)[0] for p in picked["ideogram4"]} == {"layers"}
    assert sorted({p.split(".", 2)[2] for p in picked["ideogram4"]}) == [
        "attention.o", "attention.qkv", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    assert len(picked["ideogram4"]) == 5 * 2
    ideogram4 = build_tiny_model_patcher("ideogram4", 0).model.diffusion_model
    all_linear = select_targets(ideogram4, families.lora_preset("ideogram4"), AdapterConfig(targets="all_linear"),
                                [n for n, _ in model_blocks(ideogram4)])
    assert sorted(set(all_linear) - set(picked["ideogram4"])) == ["layers.0.adaln_modulation",
                                                                  "layers.1.adaln_modulation"]
    # HiDream-O1 (musubi-tuner's text-to-image targets): every Linear of the Qwen3-VL decoder layers, the pixel patch
    # embedding and the unpatchify; the vision tower, the timestep embedder and the token embeddings stay frozen. Its
    # blocks are the decoder's layers (no top-level ModuleList), which all_linear takes without the patch layers.
    assert sorted({re.sub(r"^language_model\.layers\.\d+\.", "", p) for p in picked["hidream_o1"]}) == [
        "final_layer2.linear", "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj",
        "self_attn.q_proj", "self_attn.v_proj", "x_embedder.proj1", "x_embedder.proj2"]
    assert len(picked["hidream_o1"]) == 7 * 2 + 3
    hidream_o1 = build_tiny_model_patcher("hidream_o1", 0).model.diffusion_model
    assert [n for n, _ in model_blocks(hidream_o1)] == ["language_model.layers.0", "language_model.layers.1"]
    assert select_targets(hidream_o1, families.lora_preset("hidream_o1"), AdapterConfig(targets="all_linear"),
                          [n for n, _ in model_blocks(hidream_o1)]) == [p for p in picked["hidream_o1"]
                                                                         if p.startswith("language_model.")]
