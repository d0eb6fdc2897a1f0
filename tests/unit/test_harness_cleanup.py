"""The integration harness's own cleanup (tests/comfy_harness.py): a killed test process's throw-away ComfyUI base
directory is removed by a later run once it is old, never one a running process may still use."""
import os
import time

from comfy_harness import BASE_PREFIX, STALE_BASE_SECONDS, prune_stale_bases


def test_old_base_directories_are_pruned_and_fresh_ones_kept(tmp_path):
    old, fresh, other = tmp_path / f"{BASE_PREFIX}old", tmp_path / f"{BASE_PREFIX}fresh", tmp_path / "something-else"
    for folder in (old, fresh, other):
        (folder / "output").mkdir(parents=True)
        (folder / "output" / "checkpoint.safetensors").write_bytes(b"x" * 1024)
    stale = time.time() - STALE_BASE_SECONDS - 60
    for folder in (old, other):
        os.utime(folder, (stale, stale))
    assert prune_stale_bases(tmp_path) == [old.name]
    assert not old.exists() and fresh.exists() and other.exists()
