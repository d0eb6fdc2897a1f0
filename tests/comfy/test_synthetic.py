"""Synthetic shapes: deterministic, well-formed, and the captions describe what was drawn."""
import pytest
import torch

from headroom.training.data.synthetic import BACKGROUND, COLOURS, POSITIONS, SHAPES, generate_shapes


def test_same_seed_gives_identical_bytes_and_other_seeds_differ():
    first = generate_shapes(12, 64, seed=7)
    again = generate_shapes(12, 64, seed=7)
    other = generate_shapes(12, 64, seed=8)
    assert first.images.numpy().tobytes() == again.images.numpy().tobytes()
    assert first.control_images.numpy().tobytes() == again.control_images.numpy().tobytes()
    assert first.captions == again.captions
    assert not torch.equal(first.images, other.images)
    assert first.captions != other.captions


def test_shapes_dtypes_and_ranges():
    data = generate_shapes(5, 48, seed=0)
    assert data.images.shape == (5, 48, 48, 3) and data.images.dtype == torch.float32
    assert data.control_images.shape == (5, 48, 48, 3) and data.control_images.dtype == torch.float32
    assert data.masks.shape == (5, 48, 48) and data.masks.dtype == torch.bool
    assert len(data.captions) == 5
    assert 0.0 <= data.images.min() and data.images.max() <= 1.0
    # Control image: exactly the mask, white on black, on all three channels.
    assert set(data.control_images.unique().tolist()) == {0.0, 1.0}
    assert torch.equal(data.control_images, data.masks.float().unsqueeze(-1).expand(-1, -1, -1, 3))


def test_non_square_resolution():
    data = generate_shapes(3, (32, 96), seed=1)
    assert data.images.shape == (3, 32, 96, 3)
    assert data.masks.shape == (3, 32, 96)


def test_items_do_not_repeat_until_every_combination_was_used():
    n_combos = len(COLOURS) * len(SHAPES) * len(POSITIONS)
    data = generate_shapes(n_combos, 32, seed=3)
    assert len(set(data.captions)) == n_combos


@pytest.mark.parametrize("resolution", [32, 64, (48, 80)])
def test_captions_match_the_drawn_shape(resolution):
    data = generate_shapes(60, resolution, seed=11)
    height, width = data.masks.shape[1:]
    ys = torch.arange(height, dtype=torch.float32).view(-1, 1) + 0.5
    xs = torch.arange(width, dtype=torch.float32).view(1, -1) + 0.5
    background = torch.tensor(BACKGROUND)
    for image, mask, caption, label in zip(data.images, data.masks, data.captions, data.labels):
        assert caption.split() == ["an" if label.colour == "orange" else "a", label.colour, label.shape, "at", "the",
                                   *label.position.split()]
        assert mask.sum() >= 8, f"shape too small to see: {caption}"
        # Position: the mask's centroid lies in the grid cell the caption names.
        centroid_y = float((ys * mask).sum() / mask.sum())
        centroid_x = float((xs * mask).sum() / mask.sum())
        assert POSITIONS[int(centroid_y // (height / 3)) * 3 + int(centroid_x // (width / 3))] == label.position, caption
        # Colour: every pixel inside the mask has the named colour, every pixel outside is background.
        assert torch.equal(image[mask], torch.tensor(COLOURS[label.colour]).expand(int(mask.sum()), 3)), caption
        assert torch.equal(image[~mask], background.expand(int((~mask).sum()), 3)), caption


def test_shape_names_match_the_mask_geometry():
    """Tell the shapes apart by how much of their bounding box they fill."""
    data = generate_shapes(120, 96, seed=5)
    fill_by_shape = {shape: [] for shape in SHAPES}
    for mask, label in zip(data.masks, data.labels):
        rows, cols = mask.any(1).nonzero(), mask.any(0).nonzero()
        box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
        fill_by_shape[label.shape].append(float(mask.sum() / box))
    for shape, expected_low, expected_high in [
        ("square", 0.99, 1.0),  # fills its box
        ("circle", 0.70, 0.86),  # pi/4 ~ 0.785
        ("cross", 0.45, 0.70),  # two bars of width 0.35 r: about 0.58
        ("triangle", 0.38, 0.62),  # half its box
    ]:
        assert fill_by_shape[shape], f"no {shape} drawn"
        assert all(expected_low <= fill <= expected_high for fill in fill_by_shape[shape]), (shape, fill_by_shape[shape])


@pytest.mark.parametrize("bad", [{"count": 0}, {"resolution": 30}, {"resolution": 24}, {"resolution": (64, 36)}])
def test_bad_arguments_say_what_is_wrong(bad):
    arguments = {"count": 2, "resolution": 64, "seed": 0} | bad
    with pytest.raises(ValueError, match="synthetic shapes"):
        generate_shapes(**arguments)


@pytest.mark.comfyui
def test_node_execute_in_comfyui(comfyui):
    from headroom.nodes.data import HeadroomSyntheticDataset

    schema = HeadroomSyntheticDataset.define_schema()
    assert [output.id for output in schema.outputs] == ["images", "captions", "control_images"]
    output = HeadroomSyntheticDataset.execute(count=3, resolution=64, seed=2)
    images, captions, control_images = output.result
    expected = generate_shapes(3, 64, seed=2)
    assert torch.equal(images, expected.images)
    assert torch.equal(control_images, expected.control_images)
    assert captions.split("\n") == expected.captions
    assert HeadroomSyntheticDataset.validate_inputs(resolution=64) is True
    assert "multiple of 8" in HeadroomSyntheticDataset.validate_inputs(resolution=60)
    # sizes: the named presets the pretrained tiny model's script also uses
    from headroom.training.data.synthetic import SIZE_PRESETS

    large = HeadroomSyntheticDataset.execute(count=3, resolution=64, seed=2, sizes="large").result
    assert torch.equal(large[0], generate_shapes(3, 64, seed=2, **SIZE_PRESETS["large"]).images)
    assert large[2].sum() > control_images.sum()  # bigger shapes, more mask pixels
    with pytest.raises(ValueError, match="sizes='huge'; choose one of default, large"):
        HeadroomSyntheticDataset.execute(count=1, resolution=64, seed=0, sizes="huge")


def test_colours_restrict_the_items_and_default_is_unchanged():
    from headroom.training.data.synthetic import parse_colours

    assert generate_shapes(9, 64, seed=3).captions == generate_shapes(9, 64, seed=3, colours=None).captions
    green = generate_shapes(40, 64, seed=3, colours=["green"])
    assert {label.colour for label in green.labels} == {"green"}
    assert len(set(green.captions)) == 36  # every green shape x position before any repeats
    assert parse_colours(" Green, red ") == ["green", "red"] and parse_colours("") is None
    with pytest.raises(ValueError, match="unknown colour"):
        parse_colours("green, teal")
    with pytest.raises(ValueError, match="choose among"):
        generate_shapes(4, 64, seed=0, colours=["teal"])


def test_shape_sizes_default_is_unchanged_and_large_shapes_stay_in_their_cell():
    from headroom.training.core.shape_classifier import score

    default = generate_shapes(24, 64, seed=4)
    explicit = generate_shapes(24, 64, seed=4, half_size=(0.26, 0.40), max_offset=0.08)
    assert torch.equal(default.images, explicit.images) and default.captions == explicit.captions
    large = generate_shapes(216, 64, seed=4, half_size=(0.40, 0.46), max_offset=0.04)
    assert large.captions == generate_shapes(216, 64, seed=4).captions  # sizes never change the items
    assert large.masks.flatten(1).sum(1).float().mean() > 1.5 * default.masks.flatten(1).sum(1).float().mean()
    for mask, label in zip(large.masks, large.labels):  # every pixel centre inside its own cell of the 3x3 grid
        rows, cols = torch.nonzero(mask.any(1)).flatten() + 0.5, torch.nonzero(mask.any(0)).flatten() + 0.5
        cell = 64 / 3
        assert label.row * cell <= rows.min() and rows.max() <= (label.row + 1) * cell, label
        assert label.col * cell <= cols.min() and cols.max() <= (label.col + 1) * cell, label
    assert score(large.images, large.labels) == {"colour": 1.0, "position": 1.0, "shape": 1.0}
    for half_size, max_offset in (((0.40, 0.48), 0.04), ((0.3, 0.2), 0.0), ((0.0, 0.3), 0.0), ((0.3, 0.4), -0.1)):
        with pytest.raises(ValueError, match="half_size"):
            generate_shapes(2, 64, seed=0, half_size=half_size, max_offset=max_offset)
