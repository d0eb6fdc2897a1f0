"""Aspect-ratio buckets: equal-area sizes on the model's side step, nearest-aspect assignment,
resize + crop (center / seeded random) and mirroring."""
import math

import pytest
import torch

from headroom.training.data.buckets import apply_crop, make_buckets, nearest_bucket, plan_crop


@pytest.mark.parametrize("resolution,step", [(512, 64), (1024, 64), (1024, 16), (64, 16), (768, 32)])
def test_buckets_are_equal_area_on_the_step_and_symmetric(resolution, step):
    buckets = make_buckets(resolution, step)
    area = resolution * resolution
    assert (resolution, resolution) in buckets
    for width, height in buckets:
        assert width % step == 0 and height % step == 0
        assert width * height <= area
        # The long side is the largest step multiple within the area: one more step would exceed it.
        short, long = min(width, height), max(width, height)
        assert short * (long + step) > area
        assert max(width, height) / min(width, height) <= 4.0
        assert (height, width) in buckets  # portrait and landscape match
    assert len(set(buckets)) == len(buckets)


def test_bucket_list_for_a_known_case():
    assert make_buckets(64, 16) == [(32, 128), (48, 80), (64, 64), (80, 48), (128, 32)]
    assert make_buckets(64, 64) == [(64, 64)]


@pytest.mark.parametrize("resolution,step", [(500, 64), (512, 12), (32, 64)])
def test_bad_bucket_settings_are_rejected_with_the_values(resolution, step):
    with pytest.raises(ValueError, match=str(step)):
        make_buckets(resolution, step)


def test_bucket_side_limits_cut_long_sides_and_drop_short_ones():
    """sides (kohya's min / max_bucket_reso): a long side over the longest is cut to it (less area, as kohya's), a
    bucket with a short side under the shortest is gone; (0, 0) is the plain list; refused: limits off the step, a
    shortest over the longest, a shortest that leaves a resolution no bucket."""
    from headroom.training.data.buckets import bucket_for, check_bucket_sides

    assert make_buckets(64, 16, sides=(0, 0)) == make_buckets(64, 16)
    assert make_buckets(64, 16, sides=(0, 96)) == [(32, 96), (48, 80), (64, 64), (80, 48), (96, 32)]
    assert make_buckets(64, 16, sides=(48, 0)) == [(48, 80), (64, 64), (80, 48)]
    assert make_buckets(64, 16, sides=(0, 48)) == [(16, 48), (32, 48), (48, 16), (48, 32), (48, 48)]
    for sides in ((256, 1024), (512, 1536), (0, 768), (704, 0)):
        buckets = make_buckets(1024, 64, sides=sides)
        assert buckets and all((sides[0] or 64) <= side <= (sides[1] or 4096) for b in buckets for side in b), sides
        assert all(w * h <= 1024 * 1024 for w, h in buckets)
    assert (1024, 1024) in make_buckets(1024, 64, sides=(256, 1024))  # kohya's defaults at 1024: every side <= 1024
    assert bucket_for(256, 64, 64, 16) == (128, 32) and bucket_for(256, 64, 64, 16, sides=(0, 96)) == (96, 32)
    assert bucket_for(256, 64, 64, 16, sides=(48, 0)) == (80, 48)
    # no upscale: the smaller resolutions walked have the same limits, and stop where the shortest leaves none
    assert bucket_for(40, 40, 64, 16, upscale=False, sides=(32, 0)) == (32, 32)
    assert bucket_for(20, 20, 64, 16, upscale=False, sides=(32, 0)) == (32, 32)
    for sides, message in (((24, 0), r"min_bucket_side=24: give 0 \(no limit\) or a multiple of step 16 \(e.g. 16\)"),
                           ((0, 100), r"max_bucket_side=100: .* \(e.g. 96\)"),
                           ((96, 64), r"min_bucket_side=96 is over max_bucket_side=64"),
                           ((80, 0), r"min_bucket_side=80 leaves resolution 64 no bucket .* at most 64")):
        with pytest.raises(ValueError, match=message):
            check_bucket_sides(sides, 16, (64, 128))
    check_bucket_sides((64, 64), 16, (64, 128))


def test_nearest_bucket_follows_aspect_ratio():
    buckets = make_buckets(1024, 64)
    assert nearest_bucket(2000, 2000, buckets) == (1024, 1024)
    wide = nearest_bucket(1920, 1080, buckets)
    tall = nearest_bucket(1080, 1920, buckets)
    assert wide[0] > wide[1] and tall == (wide[1], wide[0])
    best = min(abs(math.log(b[0] / b[1]) - math.log(1920 / 1080)) for b in buckets)
    assert abs(math.log(wide[0] / wide[1]) - math.log(1920 / 1080)) == best


def test_plan_covers_the_bucket_and_centers_the_crop():
    plan = plan_crop((300, 200), (128, 64), "center", seed=0, item_id="a", flip=False)
    assert plan.resized[0] >= 128 and plan.resized[1] >= 64
    assert plan.resized == (128, 85)  # width fits exactly, height overhangs
    assert plan.offset == (0, (85 - 64) // 2)


def test_random_crop_is_seeded_per_item_and_in_bounds():
    plans = {seed: plan_crop((400, 100), (64, 64), "random", seed=seed, item_id="img", flip=False) for seed in range(20)}
    for plan in plans.values():
        assert 0 <= plan.offset[0] <= plan.resized[0] - 64 and plan.offset[1] == 0
    assert plan_crop((400, 100), (64, 64), "random", seed=3, item_id="img", flip=False) == plans[3]
    assert len({plan.offset for plan in plans.values()}) > 1  # seeds differ
    per_item = {plan_crop((400, 100), (64, 64), "random", seed=3, item_id=f"img{i}", flip=False).offset for i in range(20)}
    assert len(per_item) > 1  # items differ too
    with pytest.raises(ValueError, match="crop"):
        plan_crop((10, 10), (8, 8), "top", seed=0, item_id="x", flip=False)


def test_apply_crop_takes_the_planned_window_and_mirrors():
    image = torch.rand(128, 64, 3)  # H=128, W=64
    plan = plan_crop((64, 128), (64, 64), "center", seed=0, item_id="x", flip=False)
    assert plan.resized == (64, 128) and plan.offset == (0, 32)
    out = apply_crop(image, plan)
    assert out.shape == (64, 64, 3) and out.dtype == torch.float32
    assert torch.equal(out, image[32:96])  # no resize needed: the crop is exact pixels
    mirrored = apply_crop(image, plan_crop((64, 128), (64, 64), "center", seed=0, item_id="x", flip=True))
    assert torch.equal(mirrored, out.flip(1))


def test_apply_crop_resizes_within_range():
    image = torch.rand(100, 150, 3)
    plan = plan_crop((150, 100), (64, 48), "center", seed=0, item_id="x", flip=False)
    out = apply_crop(image, plan)
    assert out.shape == (48, 64, 3)
    assert out.min() >= 0 and out.max() <= 1
    # A flat image stays flat through resize + crop.
    flat = apply_crop(torch.full((100, 150, 3), 0.25), plan)
    assert torch.allclose(flat, torch.full_like(flat, 0.25), atol=1e-6)


def test_bucket_for_enlarges_only_when_upscale_is_on():
    """upscale on: the nearest bucket at the resolution (what caches were always keyed by). Off (kohya's
    bucket_no_upscale): an image smaller than that bucket takes the nearest bucket of the largest smaller resolution
    that it covers, so it is never enlarged; larger images are unaffected; an image smaller than every bucket takes the
    smallest."""
    from headroom.training.data.buckets import bucket_for, upscale_factor

    for width in range(24, 400, 37):
        for height in range(24, 400, 41):
            default = nearest_bucket(width, height, make_buckets(128, 16))
            assert bucket_for(width, height, 128, 16) == default
            own = bucket_for(width, height, 128, 16, upscale=False)
            if upscale_factor((width, height), default) <= 1:
                assert own == default, (width, height)
            elif min(width, height) >= 16 and width * height >= 16 * 16:
                assert upscale_factor((width, height), own) <= 1, (width, height, own)
    assert bucket_for(600, 400, 1024, 64) == (1216, 832)  # enlarged 2.03x
    assert bucket_for(600, 400, 1024, 64, upscale=False) == (512, 384)  # resolution 448: its nearest, scaled down
    assert bucket_for(10, 10, 64, 16, upscale=False) == (16, 16)  # nothing smaller: the smallest bucket
