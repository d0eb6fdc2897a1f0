"""The arithmetic of Merge LoRAs (training/core/lora_merge.py): the exact sum as stacked factors, a lower rank as the
sum's truncated SVD, energy per layer, a sum already small enough kept exact."""
from __future__ import annotations

import pytest
import torch

from headroom.training.core.lora_merge import Update, merge_updates
from headroom.training.core.lora_resize import counted


def _update(out: int, inner: int, rank: int, scale: float, seed: int) -> Update:
    generator = torch.Generator().manual_seed(seed)
    return Update(torch.randn(out, rank, generator=generator, dtype=torch.float64),
                  torch.randn(rank, inner, generator=generator, dtype=torch.float64), scale)


def _sum(updates: list[Update]) -> torch.Tensor:
    return sum(u.scale * u.up @ u.down for u in updates)


def test_the_exact_merge_is_the_sum_of_the_updates_with_the_ranks_added():
    updates = [_update(24, 40, 4, 0.5, 0), _update(24, 40, 3, -1.25, 1)]
    merged, report = merge_updates({"w.weight": updates})
    up, down = merged["w.weight"]
    assert up.shape == (24, 7) and down.shape == (7, 40)
    torch.testing.assert_close(up @ down, _sum(updates), rtol=1e-12, atol=1e-12)
    assert report.ranks == {"w.weight": (7, 7)}
    assert "the exact sum of the files' updates" in report.summary()


def test_a_lower_rank_is_the_truncated_svd_of_the_sum_and_energy_picks_per_layer():
    updates = {"a.weight": [_update(32, 48, 6, 1.0, 2), _update(32, 48, 6, 0.3, 3)],
               "b.weight": [_update(16, 20, 2, 1.0, 4), _update(16, 20, 2, 1.0, 5)]}
    merged, report = merge_updates(updates, rank=3)
    for weight, pieces in updates.items():
        total = _sum(pieces)
        u, s, vh = torch.linalg.svd(total, full_matrices=False)
        up, down = merged[weight]
        assert up.shape[1] == 3
        torch.testing.assert_close(up @ down, (u[:, :3] * s[:3]) @ vh[:3], rtol=1e-9, atol=1e-9)
        assert report.energy[weight] == pytest.approx(float((s[:3] ** 2).sum() / (s ** 2).sum()))
    assert "2 reduced from the sum of their ranks" in report.summary()

    merged, report = merge_updates(updates, energy=0.9)
    for weight, pieces in updates.items():
        s = torch.linalg.svdvals(_sum(pieces))
        share = torch.cumsum(s ** 2, 0) / (s ** 2).sum()
        kept = merged[weight][0].shape[1]
        assert share[kept - 1] >= 0.9 and (kept == 1 or share[kept - 2] < 0.9), (weight, kept)


def test_a_sum_at_or_below_the_rank_asked_for_keeps_the_exact_factors():
    updates = [_update(8, 8, 2, 2.0, 6), _update(8, 8, 1, 1.0, 7)]
    merged, report = merge_updates({"w.weight": updates}, rank=5)
    up, down = merged["w.weight"]
    assert torch.equal(up, torch.cat([u.up * u.scale for u in updates], 1))
    assert torch.equal(down, torch.cat([u.down for u in updates]))
    assert report.ranks["w.weight"] == (3, 3)


@pytest.mark.parametrize("rank,energy", [(-1, 0.0), (0, 1.5), (0, -0.1)])
def test_out_of_range_settings_are_refused(rank, energy):
    with pytest.raises(ValueError, match="rank must be 0 or more and energy in"):
        merge_updates({"w.weight": [_update(4, 4, 1, 1.0, 8)]}, rank=rank, energy=energy)


def test_counts_read_as_english():
    assert (counted(1, "layer"), counted(0, "layer"), counted(3, "LoRA layer")) == \
        ("1 layer", "0 layers", "3 LoRA layers")
