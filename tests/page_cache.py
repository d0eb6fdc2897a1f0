"""How much of a file sits in Linux's page cache now: mincore(2) over a fresh read-only mapping of it (Linux only;
the checkpoints' drop from the cache is checked with it: training/os_compat.open_to_write)."""
from __future__ import annotations

import ctypes
import mmap
import os


def cached_bytes(path: str | os.PathLike) -> int:
    size, page = os.path.getsize(path), mmap.PAGESIZE
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    with open(path, "rb") as handle:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, handle.fileno(), 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap of {path}")
    try:
        resident = (ctypes.c_ubyte * ((size + page - 1) // page))()
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), resident) != 0:
            raise OSError(ctypes.get_errno(), f"mincore of {path}")
    finally:
        libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
    return sum(flag & 1 for flag in resident) * page
