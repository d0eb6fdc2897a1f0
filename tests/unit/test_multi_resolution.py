"""Multi-resolution datasets (Dataset.extra_resolutions): every item cached at each size with that size's buckets,
each size's latents exactly those of a dataset at that size alone (the decode shared only where it is the same), the
items at `resolution` keeping their cache keys, and the sizes checked. The nodes' input:
tests/comfy/test_cache_nodes.py."""
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from headroom.training.data.dataset import DatasetError, dataset_from_folder, dataset_from_tensors
from headroom.training.data.synthetic import generate_shapes
from test_cache_store import run_latents


def test_each_item_is_cached_at_every_size_as_a_dataset_of_that_size_alone(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    rng = np.random.default_rng(0)
    # Large enough that the two sizes decode it at different reductions (box reduce): a quarter for 256, a sixteenth
    # for 64.
    for i, (width, height) in enumerate([(1024, 1024), (1024, 768)]):
        Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"image {i}", encoding="utf-8")
    base = dataset_from_folder(folder, resolution=256, step=16, flip=True)
    both = replace(base, extra_resolutions=(64,))
    assert both.resolutions == (256, 64)

    cache, report, vae = run_latents(both, tmp_path / "cache")
    assert len(cache) == 8 and vae.calls == 8  # 2 images x 2 sizes x (plain, mirrored)
    sizes = {bucket: len(indices) for bucket, indices in cache.buckets.items()}
    alone = {size: run_latents(replace(base, resolution=size), tmp_path / f"alone{size}")[0] for size in (256, 64)}
    assert sizes == {**{b: len(i) for b, i in alone[256].buckets.items()},
                     **{b: len(i) for b, i in alone[64].buckets.items()}}
    # Item order: per image, each size (resolution first), each mirror; the same latents as each size alone.
    for image in range(2):
        for k, size in enumerate((256, 64)):
            for flip in range(2):
                index = image * 4 + k * 2 + flip
                assert torch.equal(cache.latent(index), alone[size].latent(image * 2 + flip)), (image, size, flip)
                assert cache.text_key(index) == alone[size].text_key(image * 2 + flip)

    # The items at `resolution` keep their keys: a cache made before extra sizes is hit, only the new size encoded.
    _, report, vae = run_latents(base, tmp_path / "grown")
    assert vae.calls == 4
    _, report, vae = run_latents(both, tmp_path / "grown")
    assert vae.calls == 4 and report.hits == 4 and report.misses == 4


def test_sizes_are_checked():
    data = generate_shapes(1, 64, seed=0)
    dataset = dataset_from_tensors(data.images, data.captions, resolution=64, step=16)
    for sizes, message in [((64,), "64 is given twice"), ((96, 96), "96 is given twice"),
                           ((40,), "40 must be a multiple of step 16 from 64 to 4096 \\(e.g. 64\\)"),
                           ((200,), "200 must be a multiple of step 16 from 64 to 4096 \\(e.g. 192\\)"),
                           ((8192,), "8192 must be a multiple of step 16 from 64 to 4096")]:
        with pytest.raises(DatasetError, match=f"extra_resolutions: {message}"):
            replace(dataset, extra_resolutions=sizes)
