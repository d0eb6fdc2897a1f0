"""kohya-style repeat folders (`<repeats>_<name>` subfolders of a dataset folder, training/data/dataset.py): which
folders are read, the captions of images without a caption file, the control folder's mirror, the folder listing's
signature, the repeats the latent cache keeps, and an epoch that trains each item as often as it repeats. The node's
text and a run on ComfyUI's tiny model: tests/comfy/test_cache_nodes.py."""
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from headroom.training.core.trainer import TrainConfig, _Batches
from headroom.training.data.cache_store import ShardStore, cache_latents
from headroom.training.data.dataset import Dataset, DatasetError, dataset_from_folder, folder_signature
from memory_caches import MemoryLatentCache
from test_cache_store import CountingVae


def write_images(folder: Path, names: list[str], captions: dict[str, str], size=32, seed=0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name in names:
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(folder / f"{name}.png")
        if name in captions:
            (folder / f"{name}.txt").write_text(captions[name], encoding="utf-8")


def read(folder: Path, **options) -> Dataset:
    return dataset_from_folder(folder, resolution=32, step=32, **options)


def kohya_layout(root: Path) -> Path:
    """img/10_ohwx dog (3 images, one without a caption file), img/1_style (2 images), a subfolder that is no repeat
    folder (left alone) and a 0_ folder (no repeats: not one)."""
    images = root / "img"
    write_images(images / "10_ohwx dog", ["a", "b", "c"], {"a": "ohwx dog, sitting", "b": "ohwx dog, running"})
    for cache in ("a.npz", "b_0032x0032_sdxl.npz", "c_te.npz"):  # kohya's caches beside the images: passed over
        (images / "10_ohwx dog" / cache).write_bytes(b"PK\x03\x04")
    write_images(images / "1_style", ["d", "e"], {"d": "a painting", "e": "a sketch"}, seed=1)
    write_images(images / "backup", ["old"], {"old": "old"}, seed=2)
    write_images(images / "0_none", ["z"], {"z": "z"}, seed=3)
    return images


def test_a_folder_of_repeat_folders_reads_each_with_its_repeats_and_folder_name_captions(tmp_path):
    images = kohya_layout(tmp_path)
    write_images(tmp_path / "elsewhere", ["far"], {"far": "far"})
    (images / "5_link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)  # not entered, as folder lists
    dataset = read(images)
    # In the order folders are read (numbers by value: 1_ before 10_)
    assert [(item.name, item.caption, item.repeats) for item in dataset.items] == [
        ("1_style/d.png", "a painting", 1), ("1_style/e.png", "a sketch", 1),
        ("10_ohwx dog/a.png", "ohwx dog, sitting", 10), ("10_ohwx dog/b.png", "ohwx dog, running", 10),
        ("10_ohwx dog/c.png", "ohwx dog", 10)]  # no caption file: the folder's name after N_, as kohya does
    assert [(f.name, f.repeats, f.images, f.named_captions) for f in dataset.repeat_folders] == [
        ("1_style", 1, 2, 0), ("10_ohwx dog", 10, 3, 1)]
    assert dataset.unread_repeat_folders == () and dataset.warnings == ()


def test_a_folder_with_images_of_its_own_reads_only_them_and_warns_about_its_repeat_folders(tmp_path):
    images = kohya_layout(tmp_path)
    write_images(images, ["own"], {"own": "its own image"})
    dataset = read(images)
    assert [(item.name, item.repeats) for item in dataset.items] == [("own.png", 1)]  # as before repeat folders
    assert dataset.repeat_folders == () and dataset.unread_repeat_folders == ("1_style", "10_ohwx dog")
    assert any("'1_style', '10_ohwx dog' look like kohya repeat folders but are not read" in warning and
               "'1_<name>'" in warning for warning in dataset.warnings)


def test_repeat_folder_problems_name_the_folder_and_the_fix(tmp_path):
    images = tmp_path / "img"
    write_images(images / "2024_trip", ["a"], {"a": "a"})
    with pytest.raises(DatasetError, match=r"2024_trip: a repeat folder named for 2024 repeats .*at most 500.*"
                                           r"rename it, e.g. '10_trip'"):
        read(images)

    images = kohya_layout(tmp_path / "with_control")
    controls = tmp_path / "with_control" / "canny"
    write_images(controls / "10_ohwx dog", ["a", "b", "c"], {})
    with pytest.raises(DatasetError, match=r"control folder .*canny has no subfolder '1_style': with repeat folders, "
                                           r"give the control folder the same subfolders"):
        read(images, control_folder=controls)
    write_images(controls / "1_style", ["d", "e"], {}, seed=1)
    dataset = read(images, control_folder=controls)
    assert [item.control.path.relative_to(controls).as_posix() for item in dataset.items] == [
        "1_style/d.png", "1_style/e.png", "10_ohwx dog/a.png", "10_ohwx dog/b.png", "10_ohwx dog/c.png"]

    empty = tmp_path / "empty"
    (empty / "5_nothing").mkdir(parents=True)
    with pytest.raises(DatasetError, match="no usable images"):
        read(empty)
    write_images(empty / "5_nothing", ["x"], {})
    (empty / "5_nothing" / "x.webm").write_bytes(b"not an image")
    with pytest.raises(DatasetError, match=r"(?s)1 problem\(s\).*x.webm: unsupported file type"):
        read(empty)
    assert [item.name for item in read(empty, skip_bad=True).items] == ["5_nothing/x.png"]


def test_the_folder_signature_sees_files_in_repeat_folders(tmp_path):
    images = kohya_layout(tmp_path)
    before = folder_signature(images)
    assert folder_signature(images) == before
    (images / "10_ohwx dog" / "c.txt").write_text("now captioned")
    assert folder_signature(images) != before
    changed = folder_signature(images)
    (images / "backup" / "old.txt").write_text("not a repeat folder: not read, not listed")
    assert folder_signature(images) == changed


def test_the_latent_cache_keeps_each_items_repeats_and_an_epoch_trains_each_that_often(tmp_path):
    dataset = read(kohya_layout(tmp_path), flip=True)  # two items per image (mirrored), both with its repeats
    cache, _ = cache_latents(dataset, ShardStore(tmp_path / "latents"), CountingVae(), "fp-vae", {})
    assert [cache.repeats(i) for i in range(len(cache))] == [1] * 4 + [10] * 6

    batches = _Batches(cache, None, list(range(len(cache))), TrainConfig(batch_size=4, seed=0))
    epoch = [item for index in range(batches.per_epoch) for item in batches[index]]
    assert Counter(epoch) == {i: cache.repeats(i) for i in range(len(cache))}
    again = [item for index in range(batches.per_epoch) for item in batches[index]]
    assert again == epoch  # the same (seed, epoch): the same batches
    held_out = _Batches(cache, None, list(range(len(cache) - 2)), TrainConfig(batch_size=4, seed=0))
    assert sum(len(held_out[i]) for i in range(held_out.per_epoch)) == 4 + 40  # the last 2 items held out


def test_a_cache_without_repeat_folders_batches_as_before():
    latents = [torch.zeros(4, 4, 4) for _ in range(6)]
    cache = MemoryLatentCache(latents, [f"k{i}" for i in range(6)])
    batches = _Batches(cache, None, list(range(6)), TrainConfig(batch_size=2, seed=3))
    assert batches.per_epoch == 3 and sorted(i for b in range(3) for i in batches[b]) == list(range(6))


def test_kohya_caption_files_are_read_where_there_is_no_txt(tmp_path):
    """kohya sd-scripts' default caption_extension is .caption: such captions are read (a .txt beside one wins), never
    reported as unsupported files; a .caption with no image is noted as a .txt one is."""
    images = tmp_path / "img" / "5_ohwx"
    write_images(images, ["a", "b", "c"], {"a": "from txt"})
    (images / "b.caption").write_text("from caption", encoding="utf-8")
    (images / "a.caption").write_text("not read: a.txt wins", encoding="utf-8")
    (images / "orphan.caption").write_text("no image", encoding="utf-8")
    dataset = read(tmp_path / "img")
    assert [(item.name, item.caption) for item in dataset.items] == [
        ("5_ohwx/a.png", "from txt"), ("5_ohwx/b.png", "from caption"), ("5_ohwx/c.png", "ohwx")]
    assert dataset.repeat_folders[0].named_captions == 1  # only c has neither file
    assert len(dataset.notes) == 1 and "orphan.caption: a caption with no image" in dataset.notes[0]

    flat = tmp_path / "flat"
    write_images(flat, ["x", "y"], {"x": "x as txt"})
    (flat / "y.caption").write_text("y as caption", encoding="utf-8")
    assert [item.caption for item in read(flat).items] == ["x as txt", "y as caption"]
    (flat / "y.caption").unlink()
    with pytest.raises(DatasetError, match=r"y.png: no caption file; write the caption into .*y\.txt"):
        read(flat)


def test_with_a_default_caption_images_without_a_caption_file_take_it(tmp_path):
    """A flat folder of uncaptioned images (a style or a subject trained on its trigger word alone): the node passes
    its trigger word as the default caption; without one, the missing caption's message says so. In repeat folders
    the folder's name stays the caption, as kohya's."""
    flat = tmp_path / "flat"
    write_images(flat, ["x", "y", "z"], {"x": "a caption of its own"})
    dataset = read(flat, default_caption="sks_style")
    assert [item.caption for item in dataset.items] == ["a caption of its own", "sks_style", "sks_style"]
    assert dataset.default_captions == 2 and [item.name for item in dataset.items] == ["x.png", "y.png", "z.png"]
    with pytest.raises(DatasetError, match=r"y.png: no caption file; write the caption into .*y\.txt \(or set "
                                           r"trigger_word: files without a caption file are then captioned with it"):
        read(flat)
    kohya = read(kohya_layout(tmp_path / "kohya"), default_caption="sks_style")
    assert kohya.items[-1].caption == "ohwx dog" and kohya.default_captions == 0
