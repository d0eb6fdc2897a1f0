"""Benchmark: read a large latent cache and watch process memory.

Writes N synthetic latents (default 10,000 x [4, 64, 64] float32, an SD1.5 512 px latent) with the
cache store (the same ShardStore / ShardWriter the caching nodes use), then reads every item through
`LatentCache.latent(i)` twice: in order, and in the shuffled order `bucket_batches` gives a trainer.
Reports items/s, the time to re-check every entry's checksum (what a caching node does on an all-hit
run), and how much the resident set (RSS, split into anonymous and file-backed pages)
grows while reading. Page cache is warm (the files were just written); nothing here drops caches.

    python bench/bench_cache_read.py [--items 10000] [--shape 4,64,64] [--dir PATH]

Prints a Markdown table row (header first) to paste into docs/benchmarks/cache_and_distributed.md.
"""
from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from pathlib import Path

import torch


def _import_engine():
    from headroom_package import import_headroom

    import_headroom()
    from headroom.training.data import cache_store

    return cache_store


def memory_kib() -> dict[str, int]:
    """VmRSS / RssAnon / RssFile of this process in KiB (Linux /proc)."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile"):
                values[name] = int(rest.split()[0])
    return values


def read_all(cache, order, sample_every=250):
    """Read cache.latent(i) for i in order; return (seconds, peak memory seen, checksum)."""
    peak = memory_kib()
    total = 0.0
    started = time.perf_counter()
    for count, index in enumerate(order, start=1):
        total += float(cache.latent(index)[0, 0, 0])  # touch the data so nothing is skipped lazily
        if count % sample_every == 0:
            now = memory_kib()
            peak = {key: max(peak[key], now[key]) for key in peak}
    return time.perf_counter() - started, peak, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--shape", default="4,64,64", help="latent shape C,h,w")
    parser.add_argument("--dir", default=None, help="where to write the cache (default: a temp folder, removed)")
    args = parser.parse_args()
    cache_store = _import_engine()
    shape = tuple(int(side) for side in args.shape.split(","))
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="headroom-bench-cache-"))
    torch.manual_seed(0)

    try:
        store = cache_store.ShardStore(root / "latents")
        started = time.perf_counter()
        keys = []
        with store.writer() as writer:
            for i in range(args.items):
                key = cache_store.entry_key({"bench": i, "shape": list(shape)})
                writer.add(key, {"latent": torch.randn(shape)}, {"bucket": [512, 512]})
                keys.append(key)
        write_seconds = time.perf_counter() - started
        shards = len(list((root / "latents" / "shards").glob("*.safetensors")))
        disk_mib = sum(p.stat().st_size for p in (root / "latents" / "shards").iterdir()) / 2**20

        # What an all-hit run of a caching node does before reusing entries: re-hash them all.
        started = time.perf_counter()
        good, _ = cache_store.ShardStore(root / "latents").verify(keys)
        verify_seconds = time.perf_counter() - started
        assert len(good) == args.items

        items = [(key, store.entries[key]["shard"], (shape[2] * 8, shape[1] * 8),
                  cache_store.text_key(f"caption {i}"), False, f"item {i}") for i, key in enumerate(keys)]
        del store, writer
        gc.collect()
        cache = cache_store.LatentCache(root / "latents", items, "bench", shape[0], None)
        before = memory_kib()
        sequential_s, peak_sequential, _ = read_all(cache, range(len(cache)))
        shuffled = [i for batch in cache_store.bucket_batches(cache, batch_size=8, seed=0, epoch=0) for i in batch]
        shuffled_s, peak_shuffled, _ = read_all(cache, shuffled)
        after = memory_kib()
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)

    def growth(peak, key):
        return (peak[key] - before[key]) / 1024

    print("| items | latent | shards (MiB on disk) | write items/s | read in order items/s | read shuffled items/s "
          "| checksum all (hit path) s | RSS before reading MiB | RSS growth, peak in order MiB (anon / file) | RSS growth, peak shuffled MiB "
          "(anon / file) | RSS growth at end MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.items} | {list(shape)} float32 | {shards} ({disk_mib:.0f}) | {args.items / write_seconds:.0f} "
          f"| {args.items / sequential_s:.0f} | {args.items / shuffled_s:.0f} | {verify_seconds:.1f} "
          f"| {before['VmRSS'] / 1024:.0f} "
          f"| {growth(peak_sequential, 'VmRSS'):.1f} ({growth(peak_sequential, 'RssAnon'):.1f} / "
          f"{growth(peak_sequential, 'RssFile'):.1f}) "
          f"| {growth(peak_shuffled, 'VmRSS'):.1f} ({growth(peak_shuffled, 'RssAnon'):.1f} / "
          f"{growth(peak_shuffled, 'RssFile'):.1f}) | {(after['VmRSS'] - before['VmRSS']) / 1024:.1f} |")


if __name__ == "__main__":
    main()
