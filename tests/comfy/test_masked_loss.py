"""Masked loss: masks from a folder or a MASK batch, cached at latent resolution with the image's crop and flip,
and a loss that learns only what the mask keeps."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from headroom.training.data.cache_store import ShardStore, cache_latents
from headroom.training.data.dataset import DatasetError, dataset_from_folder, dataset_from_tensors
from headroom.training.core.objective import Objective, ObjectiveConfig, SamplingDescriptor
from headroom.training.data.synthetic import generate_shapes
from test_cache_store import CountingVae


def _objective(**config):
    return Objective(SamplingDescriptor("flow"), ObjectiveConfig(**config))


@pytest.mark.parametrize("loss_type", ["mse", "l1", "huber"])
def test_masked_loss_is_the_loss_of_the_kept_region(loss_type):
    g = torch.Generator().manual_seed(0)
    x0, x0_hat = torch.randn(2, 4, 6, 6, generator=g), torch.randn(2, 4, 6, 6, generator=g)
    sigma = torch.tensor([0.3, 0.8])
    objective = _objective(loss_type=loss_type)
    mask = torch.zeros(2, 1, 6, 6)
    mask[:, :, :, 3:] = 1.0  # keep the right half
    masked = objective.loss(x0_hat, x0, sigma, mask=mask)
    right = objective.loss(x0_hat[..., 3:], x0[..., 3:], sigma)
    torch.testing.assert_close(masked, right)
    torch.testing.assert_close(objective.loss(x0_hat, x0, sigma, mask=torch.ones(2, 1, 6, 6)),
                               objective.loss(x0_hat, x0, sigma))
    # What is masked out does not matter at all, and a sample masked out entirely adds nothing.
    changed = x0_hat.clone()
    changed[..., :3] += 5.0
    torch.testing.assert_close(objective.loss(changed, x0, sigma, mask=mask), masked)
    none = torch.zeros(2, 1, 6, 6)
    none[0] = 1.0
    torch.testing.assert_close(objective.loss(x0_hat, x0, sigma, mask=none),
                               objective.loss(x0_hat[:1], x0[:1], sigma[:1]) / 2)


def test_masked_out_weight_lets_what_masks_leave_out_count_a_little():
    """masked_out_weight w: the mask counts as w + (1 - w) * mask (OneTrainer's unmasked weight); 0 is the mask as is,
    1 ignores it; out of range refused."""
    g = torch.Generator().manual_seed(1)
    x0, x0_hat = torch.randn(2, 4, 6, 6, generator=g), torch.randn(2, 4, 6, 6, generator=g)
    sigma = torch.tensor([0.3, 0.8])
    mask = torch.zeros(2, 1, 6, 6)
    mask[:, :, :, 3:] = 1.0
    for loss_type in ("mse", "huber"):
        plain, quarter, whole = (_objective(loss_type=loss_type, masked_out_weight=w) for w in (0.0, 0.25, 1.0))
        torch.testing.assert_close(quarter.loss(x0_hat, x0, sigma, mask=mask),
                                   plain.loss(x0_hat, x0, sigma, mask=0.25 + 0.75 * mask))
        torch.testing.assert_close(whole.loss(x0_hat, x0, sigma, mask=mask), plain.loss(x0_hat, x0, sigma))
        torch.testing.assert_close(quarter.loss(x0_hat, x0, sigma), plain.loss(x0_hat, x0, sigma))  # no mask: whole
    for weight in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"masked_out_weight=.*give 0"):
            ObjectiveConfig(masked_out_weight=weight).validate("flow")


def test_masks_are_cached_at_latent_resolution_with_the_images_crop_and_flip(tmp_path):
    data = generate_shapes(2, (48, 80), seed=3)  # 80 wide, 48 high: the (80, 48) bucket at 64 / 16
    masks = torch.zeros(2, 48, 80)
    masks[:, :, :20] = 1.0  # the left quarter
    masks[1, :8, :] = 0.5
    dataset = dataset_from_tensors(data.images, data.captions, resolution=64, step=16, flip=True, masks=masks)
    cache, report = cache_latents(dataset, ShardStore(tmp_path / "cache"), CountingVae(), "vae", {})
    assert cache.has_masks and len(cache) == 4
    plain, mirrored = cache.mask(0), cache.mask(1)
    assert plain.shape == (1, *cache.latent(0).shape[-2:]) == (1, 6, 10)
    expected = torch.nn.functional.avg_pool2d(masks[0][None, None], 8)[0]
    torch.testing.assert_close(plain, expected)
    torch.testing.assert_close(mirrored, expected.flip(-1))
    torch.testing.assert_close(cache.mask(2), torch.nn.functional.avg_pool2d(masks[1][None, None], 8)[0])
    # A mask is part of the entry: another mask is another entry; no mask keeps the key of before.
    other = dataset_from_tensors(data.images, data.captions, resolution=64, step=16, flip=True, masks=1 - masks)
    _, again = cache_latents(other, ShardStore(tmp_path / "cache"), CountingVae(), "vae", {})
    assert again.misses == 4
    unmasked = dataset_from_tensors(data.images, data.captions, resolution=64, step=16, flip=True)
    plain_cache, _ = cache_latents(unmasked, ShardStore(tmp_path / "cache"), CountingVae(), "vae", {})
    assert not plain_cache.has_masks and plain_cache.mask(0) is None


def test_mask_folder_matches_by_name_and_checks_sizes(tmp_path):
    data = generate_shapes(3, 32, seed=1)
    images, masks = tmp_path / "set", tmp_path / "set_masks"
    images.mkdir()
    masks.mkdir()
    for i in range(3):
        Image.fromarray((data.images[i].numpy() * 255).astype(np.uint8)).save(images / f"img{i}.png")
        (images / f"img{i}.txt").write_text(data.captions[i])
    Image.fromarray(np.full((32, 32), 255, np.uint8)).save(masks / "img0.png")
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(masks / "img1.jpg")
    dataset = dataset_from_folder(images, resolution=32, step=16, mask_folder=masks)
    assert [item.mask is not None for item in dataset.items] == [True, True, False]  # img2: learned whole
    assert dataset.items[1].mask.load().max() == 0.0
    Image.fromarray(np.zeros((16, 32), np.uint8)).save(masks / "img2.png")
    with pytest.raises(DatasetError, match=r"img2.png: mask is 32x16 but its image img2.png is 32x32; resize the mask"):
        dataset_from_folder(images, resolution=32, step=16, mask_folder=masks)
    with pytest.raises(DatasetError, match="mask folder .* does not exist"):
        dataset_from_folder(images, resolution=32, step=16, mask_folder=tmp_path / "nope")
    with pytest.raises(DatasetError, match=r"masks batch \(2, 32, 32\) does not fit images \(3, 32, 32\)"):
        dataset_from_tensors(data.images, data.captions, resolution=32, step=16, masks=torch.ones(2, 32, 32))


def test_masks_and_controls_match_their_image_in_another_case_and_unused_ones_are_noted(tmp_path):
    """Windows and macOS read IMG_0.png and img_0.PNG as one name (a caption is found so): a mask or control image
    differing from its image only in case belongs to it, as Explorer shows them; a name matching no image is noted
    (it was left out silently), and two files differing only in case match neither (ambiguous: the image's error)."""
    data = generate_shapes(3, 32, seed=1)
    images, masks, controls = tmp_path / "set", tmp_path / "set_masks", tmp_path / "set_controls"
    for folder in (images, masks, controls):
        folder.mkdir()
    for i in range(3):
        Image.fromarray((data.images[i].numpy() * 255).astype(np.uint8)).save(images / f"IMG_{i}.png")
        (images / f"IMG_{i}.txt").write_text(data.captions[i])
        Image.fromarray((data.images[i].numpy() * 255).astype(np.uint8)).save(controls / f"img_{i}.PNG")
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(masks / "img_0.png")  # IMG_0's, in another case
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(masks / "IMG_1.png")  # the same name
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(masks / "IMG_9.png")  # no such image
    dataset = dataset_from_folder(images, controls, resolution=32, step=16, mask_folder=masks)
    assert [item.mask is not None for item in dataset.items] == [True, True, False]
    assert [item.control is not None for item in dataset.items] == [True, True, True]
    assert dataset.items[0].mask.load().max() == 0.0
    assert [n for n in dataset.notes if "IMG_9.png: a mask with no image of the same name in the dataset" in n]
    assert len(dataset.notes) == 1

    Image.fromarray(np.zeros((32, 32), np.uint8)).save(controls / "IMG_2.jpg")  # exact name wins over img_2.PNG
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(controls / "Img_1.jpg")  # img_1 / Img_1: ambiguous for IMG_1
    with pytest.raises(DatasetError, match=r"IMG_1.png: no control image named IMG_1\.\*"):
        dataset_from_folder(images, controls, resolution=32, step=16)
    dataset = dataset_from_folder(images, controls, resolution=32, step=16, skip_bad=True)
    assert [item.name for item in dataset.items] == ["IMG_0.png", "IMG_2.png"]
    assert dataset.items[1].control.load().max() == 0.0  # IMG_2.jpg, not img_2.PNG
    assert [n for n in dataset.notes if "img_1.PNG: a control image with no image" in n] == []  # it has one


@pytest.mark.comfyui
def test_the_masked_out_half_is_not_learned(comfyui):
    """Two runs on the same images (a different colour field in each half): one learns the whole image, one
    only the right half. The prediction error on the left half falls for the first and not for the second;
    on the right half it falls for both."""
    from headroom.nodes import cache as cache_nodes
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from test_train_lora_nodes import _init

    generator = torch.Generator().manual_seed(0)
    images = torch.rand(2, 1, 1, 3, generator=generator).expand(2, 32, 32, 3).clone()
    images[:, :, :16] = torch.tensor([[0.9, 0.1, 0.1], [0.1, 0.9, 0.2]])[:, None, None, :]
    masks = torch.zeros(2, 32, 32)
    masks[:, :, 16:] = 1.0
    with torch.inference_mode():
        model, clip, vae = build_tiny_models("sd15", 0)
        texts = None
        caches = {}
        for name, batch_masks in (("whole", None), ("right", masks)):
            dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, "a\nb", 32, 32, "center", False, 0,
                                                                    masks=batch_masks).args[0]
            caches[name] = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
            texts = texts or cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]

    def half_errors(run):
        """Squared x0 error of the left and right latent halves, over fixed noise levels and noise."""
        trainer = run.trainer
        sigma = trainer.objective.sigma_at(torch.tensor([0.3, 0.5, 0.7]))
        left = right = 0.0
        with run.validating(), torch.inference_mode(False), torch.no_grad():  # the model loaded, adapter attached
            for item in (0, 1):
                x0 = trainer._latents([item]).repeat(3, 1, 1, 1)
                noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(item))
                x0_hat = trainer.denoiser.predict(trainer.objective.noisy(x0, noise, sigma), sigma,
                                                  trainer._conds([item]) * 3)
                error = (x0_hat - x0).square()
                left += error[..., :2].mean().item()
                right += error[..., 2:].mean().item()
        return left, right

    results = {}
    for name in ("whole", "right"):
        run = _init(model, caches[name], texts, f"masked_{name}", rank=16, include_conv=True, lr=2e-2, batch_size=2)
        before = half_errors(run)
        with torch.inference_mode():
            T.HeadroomTrainSteps.execute(run, 150)
        after = half_errors(run)
        results[name] = [a / b for a, b in zip(after, before)]  # error after / before, per half
    print(f"error after / before training, (left, right): whole image {results['whole']}, right half only "
          f"{results['right']}")
    assert results["whole"][0] < 0.85 and results["whole"][1] < 0.85
    # the kept half is learned (from half the pixels: 0.84-0.86 of its error is left after 150 steps, the exact figure
    # moving with the optimizer's rounding; untrained it stays at 1) ...
    assert results["right"][1] < 0.9
    assert results["right"][0] > 1.0 > results["whole"][0]  # ... the masked-out half is not (its error even grows)


# --- clips --------------------------------------------------------------------------------------------------
class VideoVae:
    """frames [F, H, W, 3] -> [1, 4, 1 + (F - 1) // 4, H/8, W/8] by Wan's temporal rule (frame 0 alone, then groups
    of 4 frames per latent frame)."""

    def __call__(self, pixels):
        x = CountingVae()(pixels)  # [F, 4, h, w]
        return torch.cat([x[:1], x[1:].reshape(-1, 4, *x.shape[1:]).mean(1)]).movedim(0, 1)[None]


def _cache_clips(tmp_path, clips, masks, **options):
    from headroom.training.data.video import dataset_from_clips

    dataset = dataset_from_clips(clips, [f"clip {i}" for i in range(len(clips))], resolution=32, step=16, masks=masks,
                                 **options)
    return cache_latents(dataset, ShardStore(tmp_path / "cache"), VideoVae(), "video vae", {}, downscale=8,
                         frame_step=4)[0]


def _pool(mask):
    return torch.nn.functional.avg_pool2d(mask[None, None], 8)[0, 0]


def test_clip_masks_are_reduced_to_the_latent_frames(tmp_path):
    """A mask per frame: each latent frame the mean of the frames it encodes (0; 1-4; 5-8), area-averaged like image
    masks, flipped with the clip; one image mask: every latent frame; frame_stride takes the same frames from the
    mask as from the clip."""
    g = torch.Generator().manual_seed(0)
    clips = [torch.rand(9, 32, 32, 3, generator=g) for _ in range(3)]
    per_frame, image = torch.rand(9, 32, 32, generator=g), torch.rand(32, 32, generator=g)
    cache = _cache_clips(tmp_path, clips, [per_frame, image, None], flip=True)
    expected = torch.stack([_pool(per_frame[0]), _pool(per_frame[1:5].mean(0)), _pool(per_frame[5:9].mean(0))])[None]
    assert cache.latent(0).shape == (4, 3, 4, 4) and cache.mask(0).shape == (1, 3, 4, 4)
    torch.testing.assert_close(cache.mask(0), expected)
    torch.testing.assert_close(cache.mask(1), expected.flip(-1))  # the mirrored copy
    torch.testing.assert_close(cache.mask(2), _pool(image).expand(1, 3, 4, 4))
    assert cache.mask(4) is None

    strided_clip, strided_mask = torch.rand(17, 32, 32, 3, generator=g), torch.rand(17, 32, 32, generator=g)
    cache = _cache_clips(tmp_path, [strided_clip], [strided_mask], frame_stride=2)
    taken = strided_mask[0::2]  # frames 0, 2, ..., 16
    assert cache.latent(0).shape == (4, 3, 4, 4)
    torch.testing.assert_close(cache.mask(0)[0], torch.stack([_pool(taken[0]), _pool(taken[1:5].mean(0)),
                                                              _pool(taken[5:9].mean(0))]))


def test_clip_masks_that_do_not_fit_are_refused(tmp_path):
    from headroom.training.data.video import dataset_from_clips

    clip = torch.rand(9, 32, 32, 3, generator=torch.Generator().manual_seed(1))
    with pytest.raises(DatasetError, match=r"mask of clip 0: 7 mask frames but its clip clip 0 has 9 \(both counted up "
                                           r"to max_frames x frame_stride = 81\); give the mask one frame per frame"):
        _cache_clips(tmp_path, [clip], [torch.ones(7, 32, 32)])
    with pytest.raises(DatasetError, match=r"mask of clip 0: mask is 16x16 but its clip clip 0 is 32x32; resize the "
                                           r"mask to match"):
        _cache_clips(tmp_path, [clip], [torch.ones(9, 16, 16)])
    with pytest.raises(DatasetError, match=r"mask of clip 0: give \[H, W\] \(every frame\) or \[F, H, W\]"):
        dataset_from_clips([clip], ["a"], resolution=32, step=16, masks=[torch.ones(1, 9, 32, 32)])
    with pytest.raises(DatasetError, match=r"1 clips but 2 masks"):
        dataset_from_clips([clip], ["a"], resolution=32, step=16, masks=[None, None])
