"""A pixel classifier for synthetic-shape images: reads colour, position and shape off the pixels.

Used to score what a model draws (tests, the demo): no learned weights, so its verdicts do not depend on
any model. On one image [H, W, 3] in 0..1 (ComfyUI IMAGE layout):

- foreground: pixels farther than FOREGROUND_DISTANCE from the synthetic background grey;
- colour: the palette colour whose hue is nearest the hue of the foreground's median RGB (None when the
  foreground is grey: saturation below MIN_SATURATION);
- position: the 3x3 cell holding the foreground's centroid;
- shape: each shape's template (training/synthetic.py's own drawing) is placed on the foreground's bounding
  box, sized from its width (give or take a pixel); the template with the highest IoU against the foreground wins.

Clean images of generate_shapes are classified correctly (tests/unit/test_shape_classifier.py).
"""
from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass

import torch

from ..data.synthetic import BACKGROUND, COLOURS, POSITIONS, SHAPES, ShapeLabel, _shape_mask

FOREGROUND_DISTANCE = 0.25
MIN_SATURATION = 0.25
MIN_PIXELS = 4
# Template width / r for each shape (see synthetic._shape_mask): where its bounding box puts r and centre.
_WIDTH_OVER_R = {"circle": 2.0, "square": 1.7, "triangle": math.sqrt(3), "cross": 2.0}


@dataclass(frozen=True)
class Reading:
    """What the classifier read off one image; a field is None when it could not tell."""

    colour: str | None
    position: str | None
    shape: str | None

    def matches(self, label: ShapeLabel) -> dict[str, bool]:
        return {"colour": self.colour == label.colour, "position": self.position == label.position,
                "shape": self.shape == label.shape}


def _hue(rgb: tuple[float, float, float]) -> tuple[float, float]:
    h, _, s = colorsys.rgb_to_hls(*rgb)
    return h * 360.0, s


_PALETTE_HUES = {name: _hue(rgb)[0] for name, rgb in COLOURS.items()}


def nearest_colour(rgb: tuple[float, float, float]) -> str | None:
    hue, saturation = _hue(rgb)
    if saturation < MIN_SATURATION:
        return None
    return min(_PALETTE_HUES, key=lambda name: min(abs(hue - _PALETTE_HUES[name]), 360 - abs(hue - _PALETTE_HUES[name])))


def foreground_mask(image: torch.Tensor) -> torch.Tensor:
    background = torch.tensor(BACKGROUND, dtype=torch.float32)
    return (image.float() - background).norm(dim=-1) > FOREGROUND_DISTANCE


def _best_shape(mask: torch.Tensor) -> str:
    height, width = mask.shape
    rows = torch.nonzero(mask.any(dim=1)).flatten()
    cols = torch.nonzero(mask.any(dim=0)).flatten()
    top, bottom = int(rows[0]), int(rows[-1]) + 1
    left, right = int(cols[0]), int(cols[-1]) + 1
    cx = (left + right) / 2
    ys = (torch.arange(height, dtype=torch.float32) + 0.5).unsqueeze(1)
    xs = (torch.arange(width, dtype=torch.float32) + 0.5).unsqueeze(0)
    scores = {}
    for shape in SHAPES:
        best = 0.0
        for extra in (-1.0, -0.5, 0.0, 0.5, 1.0):  # the pixel box is up to a pixel off the drawn width
            r = (right - left + extra) / _WIDTH_OVER_R[shape]
            cy = top + r if shape == "triangle" else (top + bottom) / 2  # the triangle's apex is r above its centre
            template = _shape_mask(shape, ys, xs, cy, cx, r)
            union = float((template | mask).sum())
            best = max(best, float((template & mask).sum()) / max(union, 1.0))
        scores[shape] = best
    return max(scores, key=scores.get)


def classify(image: torch.Tensor) -> Reading:
    """Colour, position and shape of the one shape in `image` [H, W, 3] (0..1)."""
    if image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"shape classifier: expected one image [H, W, 3], got {tuple(image.shape)}")
    mask = foreground_mask(image)
    if int(mask.sum()) < MIN_PIXELS:
        return Reading(None, None, None)
    height, width = mask.shape
    pixels = image.float()[mask]
    colour = nearest_colour(tuple(float(v) for v in pixels.median(dim=0).values))
    coords = torch.nonzero(mask).float() + 0.5
    cy, cx = coords.mean(dim=0).tolist()
    row = min(int(cy / (height / 3)), 2)
    col = min(int(cx / (width / 3)), 2)
    return Reading(colour, POSITIONS[row * 3 + col], _best_shape(mask))


def score(images: torch.Tensor, labels: list[ShapeLabel]) -> dict[str, float]:
    """Fraction of images whose colour / position / shape reading matches its label, in 0..1."""
    if len(images) != len(labels) or not labels:
        raise ValueError(f"shape classifier: {len(images)} images for {len(labels)} labels")
    hits = {"colour": 0, "position": 0, "shape": 0}
    for image, label in zip(images, labels):
        for key, ok in classify(image).matches(label).items():
            hits[key] += ok
    return {key: value / len(labels) for key, value in hits.items()}


def colour_fraction(images: torch.Tensor, colour: str) -> float:
    """Fraction of images whose shape the classifier reads as `colour`, in 0..1."""
    if colour not in COLOURS:
        raise ValueError(f"shape classifier: unknown colour {colour!r}; known: {', '.join(COLOURS)}")
    return sum(classify(image).colour == colour for image in images) / max(len(images), 1)
