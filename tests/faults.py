"""Fault injection for the reliability tests: a disk that is full for chosen files.

Every file Headroom writes is created by `training.data.files._new_file` (a temp file beside its target, or a file
inside a temp checkpoint folder). `disk_full_for(monkeypatch, pattern)` makes the files whose names contain
`pattern` symlinks to /dev/full instead, so whatever writes them - Python, torch.save, safetensors' Rust writer -
gets a real ENOSPC from the kernel, the way a full disk answers. (tests/comfy/test_reliability_faults.py also fills a
real tmpfs where it may mount one.)
"""
from __future__ import annotations

import os
import pathlib

import pytest

FULL_DEVICE = "/dev/full"


def disk_full_for(monkeypatch, pattern: str = "") -> list[pathlib.Path]:
    """From now on new files whose name contains `pattern` ("" = every file) sit on a full disk. Returns the list
    the injected paths are appended to."""
    if not os.path.exists(FULL_DEVICE):
        pytest.skip(f"{FULL_DEVICE} is missing on this system: no way to get a real ENOSPC without mounting")
    from headroom.training.data import files

    real_new_file = files._new_file
    injected: list[pathlib.Path] = []

    def new_file(path):
        path = pathlib.Path(path)
        if pattern not in path.name:
            return real_new_file(path)
        os.symlink(FULL_DEVICE, path)  # opening it for writing opens /dev/full: every write fails with ENOSPC
        injected.append(path)

    monkeypatch.setattr(files, "_new_file", new_file)
    return injected


def snapshot(*folders: pathlib.Path) -> dict[str, bytes]:
    """Every file under `folders` (path -> bytes): compared before and after a failed write."""
    files = {}
    for folder in folders:
        if folder.exists():
            for path in sorted(folder.rglob("*")):
                if path.is_file() and not path.is_symlink():
                    files[str(path)] = path.read_bytes()
    return files


def leftovers(*folders: pathlib.Path) -> list[str]:
    """Temp files or folders (ours, or anything hidden) under `folders`, and any symlink left by the injection."""
    found = []
    for folder in folders:
        if folder.exists():
            found += [str(p) for p in folder.rglob("*") if p.name.startswith(".") or p.is_symlink()]
    return found
