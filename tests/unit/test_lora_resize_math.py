"""Resizing a LoRA state dict (training/core/lora_resize.py): the kept update is the best one of its rank, layers
at or below it are copied bit for bit, every naming the stock loader reads is recognised, broken files are refused
naming the key."""
from __future__ import annotations

import pytest
import torch

from headroom.training.core.lora_resize import PAIR_SUFFIXES, find_pairs, resize_lora


def _pair(out: int, rank: int, inner: int, seed: int = 0, conv: tuple[int, int] | None = None):
    """(up, down) of a random layer; conv: a kernel (up [out, r, 1, 1], down [r, in, kh, kw])."""
    generator = torch.Generator().manual_seed(seed)
    up = torch.randn(out, rank, generator=generator)
    down = torch.randn(rank, inner, *(conv or ()), generator=generator)
    return (up.reshape(out, rank, 1, 1) if conv else up), down


def _update(state: dict, layer: str, up_suffix=".lora_up.weight", down_suffix=".lora_down.weight") -> torch.Tensor:
    """The layer's update as ComfyUI's loader computes it (alpha / rank, flattened), in float64."""
    up, down = state[layer + up_suffix].double(), state[layer + down_suffix].double()
    alpha = state.get(layer + ".alpha")
    scale = float(alpha) / down.shape[0] if alpha is not None else 1.0
    return scale * (up.flatten(1) @ down.flatten(1))


def _best(update: torch.Tensor, rank: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(update, full_matrices=False)
    return (u[:, :rank] * s[:rank]) @ vh[:rank]


def test_a_layer_above_the_rank_becomes_its_best_approximation_of_that_rank():
    up, down = _pair(96, 16, 80)
    state = {"diffusion_model.a.lora_up.weight": up, "diffusion_model.a.lora_down.weight": down,
             "diffusion_model.a.alpha": torch.tensor(8.0)}
    resized, report = resize_lora(state, rank=4)
    layer = "diffusion_model.a"
    assert resized[layer + ".lora_up.weight"].shape == (96, 4) and resized[layer + ".lora_down.weight"].shape == (4, 80)
    assert float(resized[layer + ".alpha"]) == 4.0  # scale 1: the singular values are in the weights
    assert resized[layer + ".lora_up.weight"].dtype == torch.float32
    before = _update(state, layer)
    after = _update(resized, layer)
    torch.testing.assert_close(after, _best(before, 4), rtol=1e-5, atol=1e-5)
    s = torch.linalg.svdvals(before)
    assert report.ranks[layer] == (16, 4)
    assert report.energy[layer] == pytest.approx(float((s[:4] ** 2).sum() / (s ** 2).sum()), rel=1e-6)
    assert "1 layer resized: rank 16 -> 4-4" in report.summary()


def test_layers_at_or_below_the_rank_are_copied_bit_for_bit():
    up, down = _pair(64, 8, 64, seed=1)
    small_up, small_down = _pair(64, 2, 64, seed=2)
    state = {"x.lora_up.weight": up, "x.lora_down.weight": down, "x.alpha": torch.tensor(3.0),
             "y.lora_up.weight": small_up, "y.lora_down.weight": small_down}
    resized, report = resize_lora(state, rank=8)
    assert all(resized[k] is state[k] for k in state)
    assert sorted(report.kept_as_is) == ["x", "y"]
    assert report.alphas == {"x": 3.0, "y": 2.0}  # y has no alpha: the loader's scale 1 is alpha = rank
    assert "nothing resized" in report.summary()


def test_energy_keeps_the_fewest_directions_holding_that_share_and_rank_caps_it():
    # An update with known singular values 8, 4, 2, 1, 0.5, ...: shares of the squared norm 0.75, 0.9375, 0.984, 0.996, ...
    q1, _ = torch.linalg.qr(torch.randn(50, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(40, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64))
    values = torch.tensor([8.0 / 2 ** i for i in range(8)], dtype=torch.float64)
    state = {"m.lora_up.weight": (q1 * values).float(), "m.lora_down.weight": q2.T.float().contiguous()}
    assert resize_lora(state, energy=0.9)[1].ranks["m"] == (8, 2)
    assert resize_lora(state, energy=0.98)[1].ranks["m"] == (8, 3)
    assert resize_lora(state, energy=0.99)[1].ranks["m"] == (8, 4)
    assert resize_lora(state, energy=0.99, rank=2)[1].ranks["m"] == (8, 2)
    assert resize_lora(state, energy=1.0)[1].ranks["m"][1] <= 8


def test_convolution_layers_resize_in_the_shape_the_loader_flattens():
    up, down = _pair(32, 8, 16, seed=5, conv=(3, 3))
    state = {"c.lora_up.weight": up, "c.lora_down.weight": down, "c.alpha": torch.tensor(8.0)}
    one_by_one_up, one_by_one_down = _pair(32, 8, 16, seed=6, conv=(1, 1))
    state |= {"p.lora_up.weight": one_by_one_up, "p.lora_down.weight": one_by_one_down}
    resized, report = resize_lora(state, rank=3)
    assert resized["c.lora_up.weight"].shape == (32, 3, 1, 1) and resized["c.lora_down.weight"].shape == (3, 16, 3, 3)
    torch.testing.assert_close(_update(resized, "c"), _best(_update(state, "c"), 3), rtol=1e-5, atol=1e-5)
    assert report.convolutions == {"c": (3, 3.0)}  # kohya's conv_dim layers: kernels over 1x1 only


@pytest.mark.parametrize("up_suffix,down_suffix", PAIR_SUFFIXES)
def test_every_naming_the_stock_loader_reads_is_resized(up_suffix, down_suffix):
    up, down = _pair(24, 6, 20, seed=6)
    state = {f"layer{up_suffix}": up.half(), f"layer{down_suffix}": down.half()}
    resized, report = resize_lora(state, rank=2)
    assert report.ranks == {"layer": (6, 2)} and set(resized) == set(state)
    assert resized[f"layer{up_suffix}"].dtype == torch.float16  # each layer as the file stores it by default
    assert "layer.alpha" not in resized  # a file without alphas is read at scale 1: none added
    best = _best(_update(state, "layer", up_suffix, down_suffix), 2)
    torch.testing.assert_close(_update(resized, "layer", up_suffix, down_suffix), best, rtol=2e-3, atol=2e-3)


def test_what_is_no_plain_pair_is_copied_and_counted():
    up, down = _pair(16, 8, 16, seed=7)
    mid_up, mid_down = _pair(16, 4, 16, seed=8, conv=(1, 1))
    state = {"a.lora_up.weight": up, "a.lora_down.weight": down, "a.dora_scale": torch.ones(16, 1),
             "b.hada_w1_a": torch.ones(16, 4), "b.hada_w1_b": torch.ones(4, 16), "c.diff": torch.ones(16),
             "t.lora_up.weight": mid_up, "t.lora_down.weight": mid_down, "t.lora_mid.weight": torch.ones(4, 4, 3, 3)}
    resized, report = resize_lora(state, rank=2, dtype=torch.bfloat16)
    assert resized["a.lora_up.weight"].shape == (16, 2) and resized["a.lora_up.weight"].dtype == torch.bfloat16
    assert all(resized[k] is state[k] for k in ("a.dora_scale", "b.hada_w1_a", "b.hada_w1_b", "c.diff",
                                                  "t.lora_up.weight", "t.lora_down.weight", "t.lora_mid.weight"))
    assert report.tucker == ["t"] and report.other_tensors == 4
    summary = report.summary()
    assert "1 LoCon layer with a Tucker core" in summary and "4 other tensors" in summary


def test_a_rank_beyond_the_layers_sizes_and_an_untrained_layer_resize_cleanly():
    up, down = _pair(4, 12, 6, seed=9)  # rank 12 on a 4 x 6 weight: at most 4 directions exist
    state = {"w.lora_up.weight": up, "w.lora_down.weight": down,
             "z.lora_up.weight": torch.zeros(8, 16), "z.lora_down.weight": torch.randn(16, 8)}
    resized, report = resize_lora(state, rank=8)
    assert report.ranks["w"] == (12, 4) and report.ranks["z"] == (16, 1)
    torch.testing.assert_close(_update(resized, "w"), _update(state, "w"), rtol=1e-5, atol=1e-5)
    assert not torch.any(_update(resized, "z"))


@pytest.mark.parametrize("state,message", [
    ({"a.lora_up.weight": torch.ones(4, 2)}, "a.lora_up.weight has no a.lora_down.weight"),
    ({"a.lora_up.weight": torch.ones(4, 2), "a.lora_down.weight": torch.ones(3, 4)}, "do not multiply"),
    ({"a.lora_up.weight": torch.full((4, 2), float("nan")), "a.lora_down.weight": torch.ones(2, 4)}, "NaN"),
    ({"a.lora_up.weight": torch.ones(4, 2), "a.lora_down.weight": torch.ones(2, 4, dtype=torch.int64)},
     "a.lora_down.weight is not a floating-point matrix"),
    ({"a.lora_up.weight": torch.ones(4, 2), "a.lora_down.weight": torch.ones(2, 4), "a.alpha": torch.ones(2)},
     "a.alpha must be one number"),
    ({"a.lora_up.weight": torch.ones(4, 2), "a.lora_down.weight": torch.ones(2, 4), "a.alpha": torch.tensor(float("inf"))},
     "alpha must be a finite number"),
    ({"a.hada_w1_a": torch.ones(4, 2)}, "no plain LoRA layers"),
])
def test_a_broken_file_is_refused_naming_the_key(state, message):
    with pytest.raises(ValueError, match=message):
        resize_lora(state, rank=1)


def test_a_resized_layer_beyond_fp16s_range_is_refused_naming_the_way_out():
    up, down = _pair(16, 8, 16, seed=10)
    state = {"a.lora_up.weight": up.half(), "a.lora_down.weight": down.half(), "a.alpha": torch.tensor(1e12)}
    with pytest.raises(ValueError, match="a: its resized weights exceed torch.float16's range .* fp32 or bf16"):
        resize_lora(state, rank=2)
    assert torch.isfinite(resize_lora(state, rank=2, dtype=torch.float32)[0]["a.lora_up.weight"]).all()


def test_rank_or_energy_must_be_given():
    state = {"a.lora_up.weight": torch.ones(4, 2), "a.lora_down.weight": torch.ones(2, 4)}
    for settings in ({"rank": 0}, {"energy": 1.5}, {"rank": 2, "energy": float("nan")}):
        with pytest.raises(ValueError):
            resize_lora(state, **settings)
    assert find_pairs(state)["a"].alpha is None
