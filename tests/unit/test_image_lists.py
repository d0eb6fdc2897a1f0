"""Datasets from image lists (training/data/dataset.py dataset_from_image_list), as ComfyUI's own dataset nodes give
them: images of different sizes, one caption each, control images and masks alike; mismatches named. Through a
real server with the stock nodes: tests/server/test_stock_dataset_nodes.py."""
import pytest
import torch

from headroom.training.data.dataset import DatasetError, dataset_from_image_list


def test_each_image_of_each_element_is_an_item_with_its_caption_control_and_mask():
    images = [torch.rand(1, 48, 96, 3), torch.rand(2, 64, 64, 3)]
    controls = [torch.rand(1, 48, 96, 3), torch.rand(2, 64, 64, 3)]
    masks = [torch.ones(48, 96), torch.zeros(2, 64, 64)]
    dataset = dataset_from_image_list(images, ["wide", "square a\n\n  alt line ", "square b"], controls,
                                      resolution=64, step=16, masks=masks)
    assert [(item.name, item.caption, item.image.size()) for item in dataset.items] == [
        ("image 0", "wide", (96, 48)), ("image 1", "square a\nalt line", (64, 64)), ("image 2", "square b", (64, 64))]
    assert torch.equal(dataset.items[2].image.load(), images[1][1])
    assert torch.equal(dataset.items[0].control.load(), controls[0][0])
    assert dataset.items[0].mask.load().min() == 1 and dataset.items[1].mask.load().max() == 0
    one_mask = dataset_from_image_list([torch.rand(1, 32, 32, 3)] * 2, ["a", "b"], resolution=64, step=16,
                                       masks=[torch.ones(1, 32, 32)])
    assert all(item.mask is not None for item in one_mask.items)  # one mask for all


def test_mismatches_are_named():
    images = [torch.rand(1, 32, 32, 3), torch.rand(1, 32, 48, 3)]
    with pytest.raises(DatasetError, match="2 images but 1 captions; give one caption per image"):
        dataset_from_image_list(images, ["a"], resolution=64, step=16)
    with pytest.raises(DatasetError, match="control_images: 2 images for 2 images, or of other sizes"):
        dataset_from_image_list(images, ["a", "b"], [torch.rand(1, 32, 32, 3)] * 2, resolution=64, step=16)
    with pytest.raises(DatasetError, match="masks: 2 masks for 2 images, or of other sizes"):
        dataset_from_image_list(images, ["a", "b"], resolution=64, step=16, masks=[torch.ones(32, 32)] * 2)
    with pytest.raises(DatasetError, match=r"images list element 1 must be an IMAGE \[B, H, W, 3\]"):
        dataset_from_image_list([images[0], torch.rand(32, 32)], ["a", "b"], resolution=64, step=16)
