"""Benchmark: how long Dataset From Folder takes to list a folder, through the node (ComfyUI in-process, on the CPU).

Writes N images with captions into ComfyUI's input folder (a throw-away base directory), then times
`HeadroomDatasetFromFolder.execute` (every image's header read, checked and sized; every caption read) and, for the
first image, `FileImage.size()` alone, which Cache Latents also calls for every item on each run. The node runs
again whenever a file in the folder changes (its fingerprint is the folder's listing), so this is a wait users see.

    python bench/bench_dataset_listing.py [--items 10000] [--width 64 --height 64] [--format png]

Two shapes of question: many small files (`--items 10000`, 64 px: the per-file cost) and a few photos
(`--items 50 --width 4000 --height 3000`: the per-pixel cost of a header read). Prints a Markdown table row
(header first) for docs/benchmarks/cache_and_distributed.md.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
from PIL import Image

from headroom_package import import_headroom_and_comfyui

WORDS = "red green blue square circle cat dog tree house sky sea person car road".split()


def write_images(folder: Path, items: int, width: int, height: int, image_format: str) -> float:
    """N images (smooth gradients with noise, so PNG compresses as a photo does) and captions; their MiB."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 200, width, dtype=np.float32)[None, :, None]
    total = 0
    for i in range(items):
        pixels = (rng.random((height, width, 3), dtype=np.float32) * 40 + ramp).astype(np.uint8)
        path = folder / f"{i:05d}.{image_format}"
        Image.fromarray(pixels).save(path)
        total += path.stat().st_size
        (folder / f"{i:05d}.txt").write_text(", ".join(rng.choice(WORDS, 5, replace=False)), encoding="utf-8")
    return total / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--format", default="png", choices=("png", "jpg", "webp"))
    parser.add_argument("--repeats", type=int, default=3, help="listings timed (the fastest is reported)")
    args = parser.parse_args()
    import_headroom_and_comfyui()
    import folder_paths

    from headroom.nodes.cache import HeadroomDatasetFromFolder
    from headroom.training.data.dataset import FileImage

    folder = Path(folder_paths.get_input_directory()) / "bench_listing"
    mib = write_images(folder, args.items, args.width, args.height, args.format)
    listings = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        dataset = HeadroomDatasetFromFolder.execute(folder.name, 512, 64, "center", False, 0, False).args[0]
        listings.append(time.perf_counter() - started)
        assert len(dataset.items) == args.items, dataset.left_out[:3]
    first = FileImage(folder / f"00000.{args.format}")
    sizes = []
    for _ in range(20):
        started = time.perf_counter()
        first.size()
        sizes.append(time.perf_counter() - started)
    best = min(listings)
    print("| images | size, format | on disk MiB | listing s (fastest of "
          f"{args.repeats}) | ms per image | one image's size() ms |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.items} | {args.width}x{args.height} {args.format} | {mib:.0f} | {best:.2f} "
          f"| {best / args.items * 1000:.2f} | {min(sizes) * 1000:.2f} |")
    print(f"(threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})")


if __name__ == "__main__":
    main()
