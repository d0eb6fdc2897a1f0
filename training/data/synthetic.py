"""Synthetic captioned images: one coloured shape per image, at one cell of a 3x3 grid.

Used by the demo workflow, by tests and by ControlNet work: every image comes with a caption
naming its colour, shape and position, a binary mask of the shape, and a control image (the
mask as white on black) that fixes where the shape must be, so a ControlNet's output can be
scored by IoU against `masks`.

Drawn by hand with coordinate grids in torch: no image library draws exact binary masks
that match the rendered pixels and stays bit-identical across machines and versions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# RGB in 0..1. Kept far apart so the colour of a shape is unambiguous.
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.10, 0.10),
    "green": (0.10, 0.70, 0.20),
    "blue": (0.15, 0.25, 0.90),
    "yellow": (0.95, 0.85, 0.10),
    "purple": (0.60, 0.20, 0.75),
    "orange": (1.00, 0.55, 0.00),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
# POSITIONS[row * 3 + col] names cell (row, col) of the 3x3 grid; row 0 is the top.
POSITIONS: tuple[str, ...] = (
    "top left", "top center", "top right",
    "middle left", "center", "middle right",
    "bottom left", "bottom center", "bottom right",
)
BACKGROUND: tuple[float, float, float] = (0.92, 0.92, 0.92)

# Shape half-size as a fraction of a grid cell, and how far its centre may move off the cell
# centre. 0.40 + 0.08 < 0.5: every shape stays entirely inside its own cell.
_MIN_HALF_SIZE, _MAX_HALF_SIZE, _MAX_OFFSET = 0.26, 0.40, 0.08
MIN_RESOLUTION = 32
# Named sizes (generate_shapes keyword arguments): "default" as above, or "large", near the largest that stay inside
# their cell. With an 8x8 latent the small ones come back as blobs; the pretrained tiny model is trained on "large"
# (workflows/pretrain_tiny.py --shape-sizes), so a dataset that teaches it should use them too.
SIZE_PRESETS: dict[str, dict] = {"default": {}, "large": {"half_size": (0.40, 0.46), "max_offset": 0.04}}


@dataclass(frozen=True)
class ShapeLabel:
    colour: str
    shape: str
    position: str

    @property
    def row(self) -> int:
        return POSITIONS.index(self.position) // 3

    @property
    def col(self) -> int:
        return POSITIONS.index(self.position) % 3

    def caption(self) -> str:
        article = "an" if self.colour[0] in "aeiou" else "a"
        return f"{article} {self.colour} {self.shape} at the {self.position}"


@dataclass
class SyntheticShapes:
    images: torch.Tensor  # [N, H, W, 3] float32 in 0..1 (ComfyUI IMAGE layout)
    captions: list[str]
    control_images: torch.Tensor  # [N, H, W, 3] float32: the shape mask, white on black
    masks: torch.Tensor  # [N, H, W] bool: True where the shape is
    labels: list[ShapeLabel]


def _check_size(name: str, value: int) -> None:
    if not isinstance(value, int) or value < MIN_RESOLUTION or value % 8:
        raise ValueError(
            f"synthetic shapes: {name}={value!r} is not allowed; use a multiple of 8 that is at least {MIN_RESOLUTION}"
        )


def _shape_mask(shape: str, ys: torch.Tensor, xs: torch.Tensor, cy: float, cx: float, r: float) -> torch.Tensor:
    """Boolean mask of `shape` centred at (cy, cx) with half-size r, on pixel-centre grids ys [H,1], xs [1,W]."""
    dy, dx = ys - cy, xs - cx
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    if shape == "square":
        side = 0.85 * r  # a little smaller than the circle so both cover similar areas
        return (dx.abs() <= side) & (dy.abs() <= side)
    if shape == "triangle":
        # Upward equilateral triangle inscribed in the circle of radius r: apex at dy=-r,
        # base at dy=r/2; its centroid is the circle's centre, so the label's cell stays right.
        return (dy <= r / 2) & (dx.abs() <= (dy + r) / math.sqrt(3))
    if shape == "cross":
        arm = 0.35 * r
        return ((dx.abs() <= r) & (dy.abs() <= arm)) | ((dy.abs() <= r) & (dx.abs() <= arm))
    raise ValueError(f"synthetic shapes: unknown shape {shape!r}; known: {', '.join(SHAPES)}")


def parse_colours(text: str) -> list[str] | None:
    """A comma / space separated list of colour names -> the names (None for an empty text: all colours)."""
    names = [name.strip().lower() for name in text.replace(",", " ").split()]
    if not names:
        return None
    unknown = [name for name in names if name not in COLOURS]
    if unknown:
        raise ValueError(f"synthetic shapes: unknown colour(s) {', '.join(map(repr, unknown))}; known: {', '.join(COLOURS)}")
    return list(dict.fromkeys(names))


def generate_shapes(count: int, resolution: int | tuple[int, int], seed: int,
                    colours: list[str] | tuple[str, ...] | None = None,
                    half_size: tuple[float, float] = (_MIN_HALF_SIZE, _MAX_HALF_SIZE),
                    max_offset: float = _MAX_OFFSET) -> SyntheticShapes:
    """`count` images of one coloured shape each; `resolution` is a side or (height, width).

    Deterministic: the same arguments give bit-identical tensors on any machine. The items are
    a seeded permutation of all colour x shape x position combinations (216), so up to 216
    items never repeat a caption; beyond that the permutation starts again with new sizes/offsets.
    `colours` restricts the combinations to those colours (None: all, the same items as before it existed).
    `half_size` (low, high) and `max_offset` are fractions of a cell (defaults: the items as before they existed);
    high + max_offset must stay at most 0.5 so every shape stays inside its own cell.
    """
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"synthetic shapes: count={count!r} must be a positive integer")
    height, width = (resolution, resolution) if isinstance(resolution, int) else resolution
    _check_size("height", height)
    _check_size("width", width)

    if colours is not None:
        unknown = [name for name in colours if name not in COLOURS]
        if unknown or not colours:
            raise ValueError(f"synthetic shapes: colours={list(colours)!r}; choose among {', '.join(COLOURS)}")
    low, high = half_size
    if not 0 < low <= high or high + max_offset > 0.5 or max_offset < 0:
        raise ValueError(f"synthetic shapes: half_size={half_size!r}, max_offset={max_offset!r}: need "
                         "0 < low <= high and high + max_offset <= 0.5 (a shape inside its cell)")
    colour_names = list(dict.fromkeys(colours)) if colours is not None else list(COLOURS)
    generator = torch.Generator().manual_seed(seed)
    n_combos = len(colour_names) * len(SHAPES) * len(POSITIONS)
    combos = torch.cat([torch.randperm(n_combos, generator=generator) for _ in range(math.ceil(count / n_combos))])
    half_sizes = torch.empty(count).uniform_(low, high, generator=generator)
    offsets = torch.empty(count, 2).uniform_(-max_offset, max_offset, generator=generator)

    ys = (torch.arange(height, dtype=torch.float32) + 0.5).unsqueeze(1)
    xs = (torch.arange(width, dtype=torch.float32) + 0.5).unsqueeze(0)
    cell_h, cell_w = height / 3, width / 3

    masks = torch.zeros(count, height, width, dtype=torch.bool)
    images = torch.tensor(BACKGROUND, dtype=torch.float32).repeat(count, height, width, 1)
    labels = []
    for i in range(count):
        combo = int(combos[i])
        colour = colour_names[combo // (len(SHAPES) * len(POSITIONS))]
        shape = SHAPES[(combo // len(POSITIONS)) % len(SHAPES)]
        label = ShapeLabel(colour, shape, POSITIONS[combo % len(POSITIONS)])
        cy = (label.row + 0.5 + float(offsets[i, 0])) * cell_h
        cx = (label.col + 0.5 + float(offsets[i, 1])) * cell_w
        r = float(half_sizes[i]) * min(cell_h, cell_w)
        masks[i] = _shape_mask(shape, ys, xs, cy, cx, r)
        images[i][masks[i]] = torch.tensor(COLOURS[colour], dtype=torch.float32)
        labels.append(label)

    control_images = masks.to(torch.float32).unsqueeze(-1).repeat(1, 1, 1, 3)
    return SyntheticShapes(
        images=images,
        captions=[label.caption() for label in labels],
        control_images=control_images,
        masks=masks,
        labels=labels,
    )


DIRECTIONS: dict[str, tuple[float, float]] = {"left": (0.0, -1.0), "right": (0.0, 1.0), "up": (-1.0, 0.0),
                                              "down": (1.0, 0.0)}


@dataclass
class SyntheticClips:
    clips: torch.Tensor  # [N, F, H, W, 3] float32 in 0..1: each clip's frames in ComfyUI's IMAGE layout
    captions: list[str]


def generate_moving_shapes(count: int, resolution: int | tuple[int, int], frames: int, seed: int) -> SyntheticClips:
    """`count` clips of `frames` frames: one coloured shape sliding from its cell's centre in one of four directions
    (half a cell over the clip), captioned "a red circle at the center moving left". The colour / shape / position
    of clip i are those of generate_shapes' item i; deterministic as it is."""
    if not isinstance(frames, int) or frames < 1:
        raise ValueError(f"synthetic clips: frames={frames!r} must be a positive integer")
    labels = generate_shapes(count, resolution, seed).labels
    height, width = (resolution, resolution) if isinstance(resolution, int) else resolution
    generator = torch.Generator().manual_seed(seed + 1)
    directions = [list(DIRECTIONS)[int(i)] for i in torch.randint(len(DIRECTIONS), (count,), generator=generator)]
    half_sizes = torch.empty(count).uniform_(_MIN_HALF_SIZE, _MAX_HALF_SIZE, generator=generator)
    ys = (torch.arange(height, dtype=torch.float32) + 0.5).unsqueeze(1)
    xs = (torch.arange(width, dtype=torch.float32) + 0.5).unsqueeze(0)
    cell_h, cell_w = height / 3, width / 3
    clips = torch.tensor(BACKGROUND, dtype=torch.float32).repeat(count, frames, height, width, 1)
    for i, label in enumerate(labels):
        r = float(half_sizes[i]) * min(cell_h, cell_w)
        dy, dx = DIRECTIONS[directions[i]]
        for t in range(frames):
            shift = 0.5 * t / max(frames - 1, 1)  # half a cell over the clip: the shape may leave its cell
            mask = _shape_mask(label.shape, ys, xs, (label.row + 0.5 + dy * shift) * cell_h,
                               (label.col + 0.5 + dx * shift) * cell_w, r)
            clips[i, t][mask] = torch.tensor(COLOURS[label.colour], dtype=torch.float32)
    captions = [f"{label.caption()} moving {direction}" for label, direction in zip(labels, directions)]
    return SyntheticClips(clips=clips, captions=captions)
