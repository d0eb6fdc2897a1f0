"""The pixel classifier reads colour, position and shape off clean synthetic images (no ComfyUI needed)."""
import pytest
import torch
from headroom.training.core.shape_classifier import (
    Reading,
    classify,
    colour_fraction,
    nearest_colour,
    score,
)
from headroom.training.data.synthetic import BACKGROUND, COLOURS, generate_shapes


@pytest.mark.parametrize("resolution", [64, 128, 512])
def test_clean_images_are_read_correctly(resolution):
    data = generate_shapes(216 if resolution < 512 else 48, resolution, seed=1)
    assert score(data.images, data.labels) == {"colour": 1.0, "position": 1.0, "shape": 1.0}


def test_every_palette_colour_is_its_own_nearest():
    assert all(nearest_colour(rgb) == name for name, rgb in COLOURS.items())
    assert nearest_colour((0.5, 0.5, 0.5)) is None  # grey: no colour


def test_blank_image_reads_nothing_and_fractions():
    blank = torch.tensor(BACKGROUND).repeat(64, 64, 1)
    assert classify(blank) == Reading(None, None, None)
    data = generate_shapes(216, 64, seed=2)
    green = [i for i, label in enumerate(data.labels) if label.colour == "green"]
    assert colour_fraction(data.images[green], "green") == 1.0
    assert colour_fraction(torch.stack([blank, data.images[green[0]]]), "green") == 0.5


def test_errors_are_clear():
    with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
        classify(torch.zeros(1, 64, 64, 3))
    with pytest.raises(ValueError, match="unknown colour"):
        colour_fraction(torch.zeros(1, 64, 64, 3), "teal")
