"""Content-addressed caches of encoder outputs on disk: safetensors shards + a JSON manifest.

Layout of one store (one folder per kind, e.g. `<headroom_cache>/latents`):
    manifest.json                 entry key -> shard file, sha256 of every tensor, byte count, meta
    shards/<name>.safetensors     tensors named "<entry key>/<tensor name>"

- An entry's key is the sha256 of everything its content depends on (`entry_key`): for a latent the
  VAE's weight fingerprint and options, the image (and control image) bytes and the resize/crop/
  bucket/flip plan; for a text entry the text encoder's fingerprint and options and the caption.
  Same inputs -> same key -> a hit, without loading the encoder. Captions are not part of latent
  keys, so editing a caption re-encodes that caption's text and nothing else.
- Writes are atomic: a shard is written to a temp file, fsynced and renamed; the manifest is rewritten
  the same way, and only after its shard is in place. A shard never takes an existing file's name (Windows
  cannot replace a shard still memory-mapped); unlisted shards an hour old are removed when a store opens. A
  cancel or crash leaves every entry listed in the manifest complete, so the next run resumes from there.
  Encoded entries are committed when a shard is full and at least every `COMMIT_SECONDS` (a kill loses at most
  that much encoding, plus the item in flight), so one caching run may write many small shards.
- The manifest is untrusted when read back: entries that are not well-formed, or whose shard is not a
  shard file name of ours, are dropped (and rebuilt); shard files are read only as regular files inside
  `shards/` (training/files.py).
- Before entries are reused their tensors are re-hashed against the manifest: a corrupt or truncated
  shard is found and its entries are encoded again. (This reads every cached byte once per caching
  run: about 5 s per GiB on a 2-core VM, 3.0 s for 626 MiB, docs/benchmarks/cache_and_distributed.md; cheap next
  to encoding.)
- Reads go through `safetensors.safe_open` (memory-mapped) with a few shard handles open at a time,
  so memory does not grow with the number of items read.
- The manifest is rewritten whole after each shard (O(entries) per shard); fine into the 100k-entry
  range. Temp files left by a killed process are never read, and opening the store removes them once
  their writer is gone (training/files.py prune_temp).

`cache_latents` / `cache_text` are the whole caching loop; the ComfyUI nodes only hand in the encoder
as a callable and forward progress and cancel.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from safetensors import safe_open

from .. import os_compat, public_module
from .caption_tags import MAX_WILDCARD_TEXTS, WILDCARD, caption_lines, caption_variants
from .buckets import ENLARGED_NOTE_FACTOR, CropPlan, apply_crop, bucket_for, plan_crop, upscale_factor
from .dataset import Dataset, DatasetError, reduce_factor
from .video import clip_frame_rate, clip_frames, is_video
from .files import (STALE_TEMP_SECONDS, DiskFullError, UntrustedFileError, WriteError, display_path, format_bytes,
                    free_bytes, open_regular, prune_temp, read_json, relative_text, resolve_inside, save_safetensors,
                    write_bytes)

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "headroom-cache-manifest"
MANIFEST_VERSION = 1
DEFAULT_SHARD_BYTES = 16 << 20  # small: a cheap header to reopen on random reads, little lost on a crash
OPEN_SHARDS = 8  # shard handles a reader keeps mapped: bounds its file-backed memory to ~128 MiB
FINGERPRINT_SAMPLES = 1024  # values sampled from each weight tensor
COMMIT_SECONDS = 5.0  # encoded entries wait at most this long (plus one item's encoding) before they are committed
_KEY = re.compile(r"[0-9a-f]{64}")
_SHARD = re.compile(r"[0-9a-f]{40}\.safetensors")  # ShardWriter's names; anything else in a manifest is refused
_TENSOR = re.compile(r"[A-Za-z0-9_.-]{1,100}")


class CacheStoreError(RuntimeError):
    """A cache folder problem (unwritable, disk full); the message names the path and the fix."""

    __module__ = public_module(__name__)  # a clean type name in ComfyUI's error report


# ---------------------------------------------------------------------------------------------------
# Keys and fingerprints


def entry_key(fields: Mapping) -> str:
    """sha256 of canonical JSON of everything an entry's content depends on."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def text_key(caption: str) -> str:
    """The id a LatentCache item uses to find its caption's conditioning in a TextCache."""
    return hashlib.sha256(caption.encode("utf-8")).hexdigest()


def reference_text_key(caption: str, reference_digest: str) -> str:
    """The id of a caption encoded together with a reference image (Qwen-Image-Edit's text path): one per item."""
    return text_key(f"{caption}\x00reference:{reference_digest}")


def _item_text_key(text_cache, latent_cache, index: int) -> str:
    return latent_cache.reference_text_key(index) if getattr(text_cache, "per_reference", False) else \
        latent_cache.text_key(index)


def item_conditioning(text_cache, latent_cache, index: int, draw: int = 0) -> dict[str, torch.Tensor]:
    """Item `index`'s cached conditioning: its caption's, or, where the text cache encoded each caption with its
    item's reference image (`per_reference`), that item's own. `draw` (a random integer, training): picks one of the
    caption's cached tag orders (caption_tags); 0: the caption as written."""
    key = _item_text_key(text_cache, latent_cache, index)
    if draw == 0:
        return text_cache.conditioning(key)
    return text_cache.conditioning(key, draw % text_cache.tag_orders(key))


def longest_text(text_cache, latent_cache) -> int:
    """The most text tokens an item of `latent_cache` trains with (its cached "cross_attn" length, any tag order),
    read from the shards' headers: text encoders that do not pad (Qwen-Image's) give each caption its own length,
    and CLIP gives a caption past 77 tokens another 77."""
    keys = {_item_text_key(text_cache, latent_cache, index) for index in range(len(latent_cache))}
    return max((text_cache.text_length(key) for key in keys), default=0)


# The conditioning entries a start-image node (WanImageToVideo) adds to a prompt, cached per item by `start_encode`.
START_CONDITIONING = ("concat_latent_image", "concat_mask")

HASH_CHUNK_BYTES = 64 << 20  # a strided or expanded tensor is hashed through contiguous pieces of at most this


def _contiguous_pieces(tensor: torch.Tensor, limit: int = HASH_CHUNK_BYTES):
    """A tensor's values in C order as contiguous 1-D CPU pieces: views of a contiguous tensor, and bounded
    copies of a strided or expanded one (never the whole of it at once)."""
    if tensor.is_contiguous():
        flat = tensor.reshape(-1)
        step = max(1, limit // max(flat.element_size(), 1))
        for start in range(0, flat.numel(), step):
            yield flat[start:start + step].to("cpu")
        return
    row_bytes = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
    if row_bytes <= limit:
        rows = max(1, limit // max(row_bytes, 1))
        for start in range(0, tensor.shape[0], rows):
            yield tensor[start:start + rows].to("cpu").contiguous().reshape(-1)
    else:
        for index in range(tensor.shape[0]):
            yield from _contiguous_pieces(tensor[index], limit)


def _hash_tensor_bytes(hasher, tensor: torch.Tensor) -> None:
    for piece in _contiguous_pieces(tensor.detach()):
        hasher.update(piece.view(torch.uint8).numpy())


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and raw bytes (the per-entry checksum)."""
    hasher = hashlib.sha256(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    _hash_tensor_bytes(hasher, tensor)
    return hasher.hexdigest()


def sample_indices(numel: int, samples: int) -> torch.Tensor:
    """`samples` evenly spaced flat indices from 0 to numel - 1 (all of them when numel <= samples).

    Integer arithmetic: float32 indices (torch.linspace's default) round past 2**24 elements, which pointed
    the last sample one past the end of every real-size weight."""
    if numel <= samples:
        return torch.arange(numel, dtype=torch.int64)
    if samples <= 1:
        return torch.zeros(max(samples, 0), dtype=torch.int64)
    return torch.arange(samples, dtype=torch.int64) * (numel - 1) // (samples - 1)


_INTEGERS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bytes_as_integers(tensor: torch.Tensor) -> torch.Tensor:
    """A plain floating-point tensor viewed as integers of its element size: the same bytes, so the same
    fingerprint, but indexable on every torch (torch 2.8's CPU implements no indexing for float8, the dtype of
    every fp8 checkpoint)."""
    if type(tensor) is torch.Tensor and tensor.is_floating_point() and tensor.element_size() in _INTEGERS_OF_SIZE:
        return tensor.view(_INTEGERS_OF_SIZE[tensor.element_size()])
    return tensor


def _sample_bytes(tensor: torch.Tensor, samples: int) -> bytes:
    """Raw bytes of up to `samples` evenly strided values of `tensor` (all of it when small), read through the
    tensor's own strides: a strided or expanded view is never copied whole."""
    if tensor.is_meta:
        return b"meta"
    tensor = _same_bytes_as_integers(tensor.detach())
    indices = sample_indices(tensor.numel(), samples).to(tensor.device)
    if tensor.is_contiguous():
        values = tensor.reshape(-1)[indices]
    else:  # gathered through the strides: reshape(-1) would copy the whole view
        values = tensor[torch.unravel_index(indices, tensor.shape)]
    try:
        return _tensor_bytes(values)
    except (RuntimeError, TypeError):  # tensor subclasses (e.g. quantized storage) without a byte view
        return _tensor_bytes(values.to(torch.float32))


def fingerprint_state_dict(state_dict: Mapping[str, object], samples: int = FINGERPRINT_SAMPLES) -> str:
    """A cheap but robust identity of an encoder's weights: every key name, shape and dtype, plus a
    strided sample of each tensor's values.

    Why this is enough: a different architecture or precision changes names/shapes/dtypes; a
    fine-tune, merge or different checkpoint changes (nearly) every value of the tensors it touches,
    so it shows up in the 1024 sampled values of each of them. Only an edit confined to unsampled
    elements of every tensor would go unnoticed, which no training or merging tool produces. Hashing
    every byte would read gigabytes (a T5-XXL is ~10 GB) on every run just to find a cache hit.
    """
    hasher = hashlib.sha256()
    for name in sorted(state_dict):
        value = state_dict[name]
        if isinstance(value, torch.Tensor):
            hasher.update(f"{name}|{tuple(value.shape)}|{value.dtype}\n".encode())
            hasher.update(_sample_bytes(value, samples))
        else:
            hasher.update(f"{name}|{type(value).__name__}\n".encode())
    return hasher.hexdigest()


def fingerprint_value(value: object, samples: int = FINGERPRINT_SAMPLES) -> str:
    """A fingerprint of nested data mixing tensors, numbers, strings, containers and small objects
    (e.g. the weight patches a LoRA loader put on an encoder); tensors are sampled as above."""
    hasher = hashlib.sha256()
    seen: set[int] = set()

    def walk(item: object, depth: int) -> None:
        if isinstance(item, torch.Tensor):
            hasher.update(f"T{tuple(item.shape)}{item.dtype}".encode())
            hasher.update(_sample_bytes(item, samples))
        elif item is None or isinstance(item, (bool, int, float, str)):
            hasher.update(repr(item).encode())
        elif depth > 8 or id(item) in seen:
            hasher.update(type(item).__qualname__.encode())
        elif isinstance(item, Mapping):
            seen.add(id(item))
            hasher.update(b"{")
            for key in sorted(item, key=repr):
                walk(key, depth + 1)
                walk(item[key], depth + 1)
            hasher.update(b"}")
        elif isinstance(item, (list, tuple, set, frozenset)):
            seen.add(id(item))
            hasher.update(b"[")
            for element in (sorted(item, key=repr) if isinstance(item, (set, frozenset)) else item):
                walk(element, depth + 1)
            hasher.update(b"]")
        elif callable(item) and not hasattr(item, "__dict__"):
            hasher.update(getattr(item, "__qualname__", type(item).__qualname__).encode())
        else:  # a plain object: its class and its attributes
            seen.add(id(item))
            hasher.update(type(item).__qualname__.encode())
            walk(dict(vars(item)) if hasattr(item, "__dict__") else repr(item), depth + 1)

    walk(value, 0)
    return hasher.hexdigest()


# ---------------------------------------------------------------------------------------------------
# The store


class ShardStore:
    """One folder of content-addressed entries: see the module docstring for the layout."""

    def __init__(self, root: Path, shard_bytes: int = DEFAULT_SHARD_BYTES, commit_seconds: float | None = None):
        self.root = Path(root)
        self.shard_dir = self.root / "shards"
        self.manifest_path = self.root / MANIFEST_NAME
        self.shard_bytes = shard_bytes
        self.commit_seconds = COMMIT_SECONDS if commit_seconds is None else commit_seconds
        if self.root.exists() and not self.root.is_dir():
            raise CacheStoreError(f"cache folder {display_path(self.root)} is a file, not a folder; remove it or move "
                                  "the cache")
        for folder in (self.root, self.shard_dir):  # what killed writers left behind
            prune_temp(folder)
        self.warnings: list[str] = []  # what was wrong with the manifest as found (reported by the caching runs)
        self.entries: dict[str, dict] = self._read_manifest(self.warnings)
        _prune_unlisted_shards(self.shard_dir, {entry["shard"] for entry in self.entries.values()})

    # -- manifest ------------------------------------------------------------------------------------

    def _read_manifest(self, warnings: list[str] | None = None) -> dict[str, dict]:
        warnings = [] if warnings is None else warnings
        if not os.path.lexists(self.manifest_path):
            return {}
        try:
            data = read_json(self.manifest_path, "cache manifest")
            if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or \
                    data.get("version") != MANIFEST_VERSION or not isinstance(data.get("entries"), dict):
                raise ValueError("not a manifest of this Headroom version")
        except ValueError as error:  # UntrustedFileError is one
            # Never trusted on doubt: every entry is then rebuilt, and the next commit replaces the file.
            warnings.append(f"ignoring the unreadable cache manifest {display_path(self.manifest_path)} ({error}); "
                            "its entries are encoded again")
            log.warning("Headroom cache: %s", warnings[-1])
            return {}
        entries = {key: entry for key, entry in data["entries"].items() if _entry_well_formed(key, entry)}
        if len(entries) != len(data["entries"]):
            warnings.append(f"{display_path(self.manifest_path)} lists {len(data['entries']) - len(entries)} malformed "
                            "entries (edited?); they are encoded again")
            log.warning("Headroom cache: %s", warnings[-1])
        return entries

    def _commit(self, added: Mapping[str, dict], removed: Iterable[str] = ()) -> None:
        """Apply changes on top of the manifest as it is on disk now (another process may have added
        entries meanwhile) and replace it atomically. Shards no entry refers to any more are deleted."""
        removed = set(removed)
        entries = self._read_manifest()
        dropped_shards = {entries[key]["shard"] for key in removed if key in entries}
        for key in removed:
            entries.pop(key, None)
        entries.update(added)
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "entries": entries})
        write_bytes(self.manifest_path, text.encode("utf-8"), "the cache manifest")
        self.entries = entries
        still_used = {entry["shard"] for entry in entries.values()}
        for shard in dropped_shards - still_used:
            try:
                (self.shard_dir / shard).unlink(missing_ok=True)
            except OSError:  # e.g. still memory-mapped on Windows; an unlisted shard is harmless
                pass

    def shard_path(self, shard: str) -> Path:
        """Where a listed shard is: a regular file inside shards/ (a symlink out of it is refused)."""
        return _contained_shard(self.shard_dir, shard)

    # -- verification --------------------------------------------------------------------------------

    def verify(self, keys: Iterable[str]) -> tuple[set[str], list[str]]:
        """Check listed entries against their checksums. Returns (good keys, problems); bad entries are
        dropped from the manifest so they get rebuilt. Keys not in the manifest are simply not good."""
        by_shard: dict[str, list[str]] = {}
        for key in keys:
            if key in self.entries:
                by_shard.setdefault(self.entries[key]["shard"], []).append(key)
        good, bad, problems = set(), [], []
        for shard, shard_keys in sorted(by_shard.items()):
            path = self.shard_dir / shard
            try:
                with safe_open(str(self.shard_path(shard)), framework="pt") as handle:
                    names = set(handle.keys())
                    for key in shard_keys:
                        if self._entry_intact(handle, names, key):
                            good.add(key)
                        else:
                            bad.append(key)
                            problems.append(f"{display_path(path)}: entry {key[:12]} fails its checksum; re-encoding it")
            except Exception as error:  # missing, truncated or garbled file: safetensors raises various types
                bad.extend(shard_keys)
                problems.append(f"{display_path(path)}: unreadable shard ({_short(error)}); re-encoding its "
                                f"{len(shard_keys)} entries")
        if bad:
            for problem in problems:
                log.warning("Headroom cache: %s", problem)
            self._commit({}, removed=bad)
        return good, problems

    def _entry_intact(self, handle, names: set[str], key: str) -> bool:
        for name, digest in self.entries[key]["tensors"].items():
            tensor_name = f"{key}/{name}"
            if tensor_name not in names:
                return False
            try:
                if tensor_digest(handle.get_tensor(tensor_name)) != digest:
                    return False
            except Exception:
                return False
        return True

    # -- writing -------------------------------------------------------------------------------------

    def check_writable(self) -> None:
        """Raise a clear error now rather than after encoding, if entries could not be written."""
        # A shard's temp name: "." + 40 hex digits + ".safetensors" + files.temp_name's 31 characters at most.
        problem = os_compat.path_length_problem(self.shard_dir, 1 + 40 + len(".safetensors") + 31)
        if problem:
            raise CacheStoreError(f"cache folder {display_path(self.root)} cannot hold its shards: {problem}")
        try:
            self.shard_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.shard_dir, prefix=".probe-"):
                pass
        except OSError as error:
            raise CacheStoreError(
                f"cache folder {display_path(self.root)} is not writable ({error.strerror}); fix its permissions or "
                "move the cache folder"
            ) from error

    def writer(self) -> "ShardWriter":
        return ShardWriter(self)


class ShardWriter:
    """Collects finished entries and writes them as shards: when a shard's worth is pending, and once the oldest
    pending entry waited `commit_seconds`. Used as a context manager: on leaving - normally, on error or on
    cancel - the entries finished so far are written, so work is kept."""

    def __init__(self, store: ShardStore):
        self.store = store
        self.pending: dict[str, tuple[dict[str, torch.Tensor], dict]] = {}
        self.pending_bytes = 0
        self.pending_since = 0.0
        self.bytes_written = 0

    def add(self, key: str, tensors: Mapping[str, torch.Tensor], meta: dict | None = None) -> None:
        tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
        if not self.pending:
            self.pending_since = time.monotonic()
        self.pending[key] = (tensors, dict(meta or {}))
        self.pending_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        if self.pending_bytes >= self.store.shard_bytes or \
                time.monotonic() - self.pending_since >= self.store.commit_seconds:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        store = self.store
        keys = sorted(self.pending)
        name = _free_shard_name(store.shard_dir, keys)
        path = store.shard_dir / name
        tensors, added = {}, {}
        for key in keys:
            entry_tensors, meta = self.pending[key]
            for tensor_name, tensor in entry_tensors.items():
                tensors[f"{key}/{tensor_name}"] = tensor
            added[key] = {
                "shard": name,
                "tensors": {tensor_name: tensor_digest(t) for tensor_name, t in entry_tensors.items()},
                "bytes": sum(t.numel() * t.element_size() for t in entry_tensors.values()),
                "meta": meta,
            }
        save_safetensors(path, tensors, "a cache shard", metadata={"format": "headroom-cache-shard"})
        store._commit(added)  # the manifest last: an entry is listed only once its shard is complete
        self.bytes_written += sum(entry["bytes"] for entry in added.values())
        self.pending.clear()
        self.pending_bytes = 0

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and issubclass(exc_type, WriteError):
            return  # the disk refused a write; do not try again on the way out
        try:
            self.flush()
        except WriteError:
            if exc_type is None:
                raise
            log.exception("Headroom cache: could not keep the entries finished before the interruption")


class _ShardReader:
    """A few memory-mapped shard handles, least recently used closed first. `node`: the caching node that rebuilds
    these shards, for the error a shard changed since it was cached (deleted, replaced) raises."""

    def __init__(self, shard_dir: Path, node: str, max_open: int = OPEN_SHARDS):
        self.shard_dir = Path(shard_dir)
        self.node = node
        self.max_open = max_open
        self._handles: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, shard: str, tensor_name: str) -> torch.Tensor:
        return self._with_handle(shard, tensor_name, lambda handle: handle.get_tensor(tensor_name))

    def shape(self, shard: str, tensor_name: str) -> list[int]:
        """A tensor's shape from its shard's header, its data not read."""
        return self._with_handle(shard, tensor_name, lambda handle: list(handle.get_slice(tensor_name).get_shape()))

    def _with_handle(self, shard: str, tensor_name: str, read):
        again = f"run {self.node} again to rebuild it"
        with self._lock:
            handle = self._handles.get(shard)
            if handle is None:
                try:
                    handle = safe_open(str(_contained_shard(self.shard_dir, shard)), framework="pt")
                except UntrustedFileError as error:  # names the file and what is wrong with it
                    raise CacheStoreError(f"{error}; {again}") from None
                except Exception as error:
                    raise CacheStoreError(f"cache shard {display_path(self.shard_dir / shard)} is unreadable "
                                          f"({_short(error)}); {again}") from None
                self._handles[shard] = handle
                while len(self._handles) > self.max_open:
                    self._handles.popitem(last=False)
            else:
                self._handles.move_to_end(shard)
            try:
                return read(handle)
            except Exception as error:  # the file changed after the caching node checked it against the manifest
                try:  # safetensors' own words name the entry's 64-digit key: said only when it is another fault
                    why = "" if tensor_name not in handle.keys() else f" ({_short(error)})"
                except Exception:
                    why = f" ({_short(error)})"
                raise CacheStoreError(f"cache shard {display_path(self.shard_dir / shard)} does not hold the "
                                      f"{tensor_name.rpartition('/')[2]!r} of entry {tensor_name[:12]} its cache lists"
                                      f"{why}: the file changed after it was cached; {again}") from None

    def close(self) -> None:
        """Drop the open handles; the next read opens its shard again. Windows neither deletes nor replaces a mapped
        file: a run that keeps its caches between calls (ComfyUI keeps node outputs) would hold its last shards
        mapped until ComfyUI drops it, and a user could not delete the cache folder meanwhile. (Tensors already
        read keep their own mapping until they are freed: what training read was copied into its batches.)"""
        with self._lock:
            self._handles.clear()

    def __getstate__(self):  # handles cannot cross processes (e.g. DataLoader workers); reopen there
        return {"shard_dir": self.shard_dir, "node": self.node, "max_open": self.max_open}

    def __setstate__(self, state):
        self.__init__(state["shard_dir"], state["node"], state["max_open"])


def _free_shard_name(shard_dir: Path, keys: Sequence[str]) -> str:
    """A shard's file name from its entry keys, one no file in `shard_dir` has. Entries re-encoded after their shard
    went bad have the keys of that shard, whose file this process may still have memory-mapped (an earlier
    LatentCache: ComfyUI keeps the last prompt's outputs); Windows refuses to replace a mapped file (WinError 1224)
    or delete it, so the new shard never takes an existing name."""
    text = "\n".join(keys)
    for attempt in range(1000):
        name = hashlib.sha256(f"{text}\n{attempt}".encode() if attempt else text.encode()).hexdigest()[:40]
        if not os.path.lexists(shard_dir / f"{name}.safetensors"):
            return f"{name}.safetensors"
    raise CacheStoreError(f"cache folder {display_path(shard_dir)} holds 1000 shards of the same entries; remove it "
                          "and run the caching node again")


def _prune_unlisted_shards(shard_dir: Path, listed: set[str]) -> None:
    """Remove shard files no manifest entry names that are older than files.STALE_TEMP_SECONDS: a bad shard whose
    removal Windows refused while it was memory-mapped (ShardStore._commit). The age spares a shard another
    process wrote a moment ago and has not listed yet. One still mapped stays until a later run."""
    try:
        entries = list(os.scandir(shard_dir))
    except OSError:
        return
    now = time.time()
    for entry in entries:
        if _SHARD.fullmatch(entry.name) is None or entry.name in listed:
            continue
        try:
            if entry.is_file(follow_symlinks=False) and \
                    now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_SECONDS:
                os.unlink(entry.path)
        except OSError:  # still mapped on Windows, or gone already
            pass


def _entry_well_formed(key, entry) -> bool:
    """A manifest entry as ShardWriter writes it: a sha256 key; a shard file name of ours; tensor names and their
    sha256; a byte count; a meta dict."""
    return (isinstance(key, str) and _KEY.fullmatch(key) is not None and isinstance(entry, dict)
            and isinstance(entry.get("shard"), str) and _SHARD.fullmatch(entry["shard"]) is not None
            and isinstance(entry.get("tensors"), dict) and bool(entry["tensors"])
            and all(isinstance(n, str) and _TENSOR.fullmatch(n) and isinstance(d, str) and _KEY.fullmatch(d)
                    for n, d in entry["tensors"].items())
            and isinstance(entry.get("bytes"), int) and not isinstance(entry["bytes"], bool) and entry["bytes"] >= 0
            and isinstance(entry.get("meta", {}), dict))


def _contained_shard(shard_dir: Path, shard: str) -> Path:
    """A shard named by the manifest (already a checked name): a regular file inside shard_dir, not a symlink."""
    if not isinstance(shard, str) or _SHARD.fullmatch(shard) is None:
        raise UntrustedFileError(f"{str(shard)[:60]!r} is not a cache shard name: refused")
    path = resolve_inside(shard_dir / shard, [shard_dir], "cache shard")
    with open_regular(shard_dir / shard, "cache shard"):
        pass
    return path


def _short(error: BaseException) -> str:
    """An error's first line, with ComfyUI's folders named relatively (libraries put absolute paths in)."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return relative_text(str(error).splitlines()[0][:200]) if str(error) else type(error).__name__


# ---------------------------------------------------------------------------------------------------
# The cache objects the trainer reads (the LATENT_CACHE / TEXT_CACHE values)


class LatentCache:
    """Cached VAE latents (and control images) of a dataset, read lazily from disk.

    Item i is one cropped (and maybe mirrored) variant of a dataset image; with flip enabled each
    image gives two items. `latent(i)` is exactly the VAE's encode output for that item, batch
    dimension removed: [C, h, w] (or [C, t, h, w] for a video VAE).
    """

    def __init__(self, root: Path, items: list[tuple[str, str, tuple[int, int], str, bool, str, str | None]],
                 fingerprint: str, latent_channels: int, control_kind: str | None, masked: list[bool] | None = None,
                 start_image: str | None = None, frame_rates: list[float | None] | None = None,
                 repeats: list[int] | None = None):
        # items: (entry key, shard file, bucket (w, h) or (w, h, frames) of clips, text key, has control, display
        # name, text key with the control image as reference or None)
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.memory_phases: list[dict] = []  # how building it went (memory_stats.PhaseRecorder records)
        self.latent_channels = latent_channels
        self.control_kind = control_kind  # None, "pixels" or "latents"
        self._items = items
        self._masked = list(masked) if masked is not None else [False] * len(items)
        # The stock node whose start-image conditioning every item holds ("WanImageToVideo": image-to-video), or None.
        self.start_image = start_image
        # Frames per second of each clip (its video's rate / frame_stride); None: an image, or unknown.
        self._frame_rates = list(frame_rates) if frame_rates is not None else [None] * len(items)
        # Times per epoch each item is trained on (its dataset item's repeat folder; 1 elsewhere).
        self._repeats = list(repeats) if repeats is not None else [1] * len(items)
        self._reader = _ShardReader(self.root / "shards", "Cache Latents (Headroom)")
        buckets: dict[tuple[int, int], list[int]] = {}
        for index, item in enumerate(items):
            buckets.setdefault(item[2], []).append(index)
        self.buckets = dict(sorted(buckets.items()))

    def release_files(self) -> None:
        """Unmap the shards read so far (_ShardReader.close): at the end of each training or validation call."""
        self._reader.close()

    def __len__(self) -> int:
        return len(self._items)

    def latent(self, index: int) -> torch.Tensor:
        key, shard = self._items[index][:2]
        return self._reader.get(shard, f"{key}/latent")

    def control(self, index: int) -> torch.Tensor | None:
        """Control image pixels [H, W, 3] 0..1 at the bucket size, or its latents; None without control."""
        key, shard, has_control = self._items[index][0], self._items[index][1], self._items[index][4]
        return self._reader.get(shard, f"{key}/control") if has_control else None

    def has_control(self, index: int) -> bool:
        """Whether item `index` has a cached control image (without reading it)."""
        return bool(self._items[index][4])

    def mask(self, index: int) -> torch.Tensor | None:
        """Loss mask [1, h, w] (a video latent's: [1, T, h, w]) 0..1 at latent resolution; None for an item without
        one."""
        return self._reader.get(self._items[index][1], f"{self._items[index][0]}/mask") if self._masked[index] else None

    def start(self, index: int) -> dict[str, torch.Tensor] | None:
        """Item `index`'s start-image conditioning (`start_image` caches): what the stock node adds to the prompt for the
        clip's first frame, batch dimension removed (WanImageToVideo: concat_latent_image [C, T, h, w], concat_mask
        [1, T, h, w]); None without."""
        if self.start_image is None:
            return None
        key, shard = self._items[index][:2]
        return {name: self._reader.get(shard, f"{key}/{name}") for name in START_CONDITIONING}

    def start_frame(self, index: int) -> torch.Tensor | None:
        """Item `index`'s start image [H, W, 3] 0..1 (its first frame, cropped) in `start_image` caches; else None."""
        key, shard = self._items[index][:2]
        return self._reader.get(shard, f"{key}/start_frame") if self.start_image is not None else None

    def repeats(self, index: int) -> int:
        """Times per epoch item `index` is trained on (kohya-style repeat folders; 1 elsewhere)."""
        return self._repeats[index]

    def frame_rate(self, index: int) -> float | None:
        """Frames per second of clip `index` as cached (None: an image, a clip of unknown rate, or an older cache)."""
        return self._frame_rates[index]

    @property
    def has_masks(self) -> bool:
        return any(self._masked)

    def text_key(self, index: int) -> str:
        return self._items[index][3]

    def reference_text_key(self, index: int) -> str:
        """The key of item `index`'s caption encoded with its control image as reference (a TextCache made with
        references); a KeyError naming the item when it has no control image."""
        key = self._items[index][6]
        if key is None:
            raise KeyError(f"{self.name(index)} has no control image to encode its caption with")
        return key

    def bucket(self, index: int) -> tuple[int, int]:
        return self._items[index][2]

    def name(self, index: int) -> str:
        return self._items[index][5]

    def __repr__(self) -> str:
        return f"LatentCache({len(self)} items, {len(self.buckets)} buckets, {display_path(self.root)})"


class TextCache:
    """Cached text-encoder conditioning per caption (plus the empty prompt), read lazily from disk.

    `conditioning(key)` is ComfyUI's CLIPTextEncode result `[[cond, {extras}]]` flattened: "cross_attn"
    is `cond` and every tensor extra keeps its name ("pooled_output", ...); the batch dimension of 1
    that ComfyUI gives a single prompt is removed (cross_attn [T, D], pooled_output [D]).
    """

    def __init__(self, root: Path, entries: dict[str, list[tuple[str, str, tuple[str, ...]]]], empty_key: str,
                 fingerprint: str, reference_encoding: str | None = None, tag_shuffling: dict | None = None,
                 captions: dict[str, str] | None = None):
        # entries: text key -> [(entry key, shard file, tensor names) per tag order, the caption as written first]
        self.root = Path(root)
        # text key -> the caption as the dataset gave it (a saved LoRA's tag counts: caption_tags.tag_frequency)
        self.captions = dict(captions or {})
        self.fingerprint = fingerprint
        # The stock node whose encoding of a caption with a reference image this cache holds, per item
        # (Qwen-Image-Edit's TextEncodeQwenImageEdit); None: per caption, as CLIPTextEncode.
        self.reference_encoding = reference_encoding
        self.per_reference = reference_encoding is not None
        # {"shuffles", "keep"(, "dropout")} of caption_tags.tag_orders where captions were cached in several tag
        # orders, else None: part of a run's configuration (a resumed run trains on the same orders).
        self.tag_shuffling = tag_shuffling
        self.memory_phases: list[dict] = []  # how building it went (memory_stats.PhaseRecorder records)
        self._entries = entries
        self._empty_key = empty_key
        self._reader = _ShardReader(self.root / "shards", "Cache Text (Headroom)")

    def release_files(self) -> None:
        """Unmap the shards read so far (_ShardReader.close): at the end of each training or validation call."""
        self._reader.close()

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        return list(self._entries)

    def tag_orders(self, key: str) -> int:
        """How many tag orders of the caption are cached (1: as written only)."""
        return len(self._entries[key]) if key in self._entries else 1

    def conditioning(self, key: str, order: int = 0) -> dict[str, torch.Tensor]:
        """The caption's conditioning; `order` > 0: one of its other tag orders (0 .. tag_orders(key) - 1)."""
        if key not in self._entries:
            raise KeyError(
                f"caption {key[:12]} is not in this text cache: the LATENT_CACHE and TEXT_CACHE were made from "
                "different datasets; cache the text of the same dataset"
            )
        entry, shard, names = self._entries[key][order]
        return {name: self._reader.get(shard, f"{entry}/{name}") for name in names}

    def text_length(self, key: str) -> int:
        """The most tokens of the caption's cached conditioning ("cross_attn" [T, D]) over its tag orders."""
        if key not in self._entries:
            self.conditioning(key)  # its KeyError: a caption of another dataset
        shapes = [self._reader.shape(shard, f"{entry}/cross_attn") for entry, shard, names in self._entries[key]
                  if "cross_attn" in names]
        return max((shape[0] for shape in shapes if shape), default=0)

    def empty_conditioning(self) -> dict[str, torch.Tensor]:
        return self.conditioning(self._empty_key)

    def __repr__(self) -> str:
        return f"TextCache({len(self)} prompts, {display_path(self.root)})"


def bucket_batches(latent_cache: LatentCache, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch of batches: items shuffled within each bucket, cut into batches (the last batch of a
    bucket may be smaller), and the batches shuffled; the same (seed, epoch) gives the same batches."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    rng = random.Random(seed * 1_000_003 + epoch)
    batches = []
    for bucket in sorted(latent_cache.buckets):
        indices = list(latent_cache.buckets[bucket])
        rng.shuffle(indices)
        batches.extend(indices[start:start + batch_size] for start in range(0, len(indices), batch_size))
    rng.shuffle(batches)
    return batches


# ---------------------------------------------------------------------------------------------------
# Caching loops


@dataclass
class CacheReport:
    """What a caching run did, for the node's summary output."""

    kind: str
    items: int = 0
    buckets: int = 0
    hits: int = 0
    misses: int = 0
    bytes_total: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what else the run did (text: the tag orders cached)

    def summary(self) -> str:
        lines = [
            f"{self.kind}: {self.items} items"
            + (f" in {self.buckets} buckets" if self.buckets else "")
            + f", {self.hits} hits / {self.misses} encoded, {format_bytes(self.bytes_total, largest='GiB')} cached "
            f"({format_bytes(self.bytes_written, largest='GiB')} written), {self.seconds:.1f} s"
        ]
        lines += self.notes
        lines += [f"warning: {warning}" for warning in self.warnings]
        return "\n".join(lines)


def _no_interrupt() -> None:
    pass


def _no_progress(done: int, total: int) -> None:
    pass


@dataclass
class _PlannedLatent:
    item_index: int
    key: str
    plan: CropPlan
    text_key: str
    reduce: int  # the image is decoded reduced by this factor (dataset.reduce_factor)
    reference_text_key: str | None = None  # the caption with the control image as its reference
    frames: tuple[int, ...] | None = None  # a clip's frame indices (training/data/video.py); None: an image
    frame_rate: float | None = None  # the clip's frames per second (not in the key: the latent does not depend on it)


def _bucket_key(plan: CropPlan, frames: tuple[int, ...] | None) -> tuple[int, ...]:
    """The batch bucket of an item: (width, height), and the frame count for clips of more than one frame (a batch
    stacks latents of one shape)."""
    return plan.bucket if frames is None or len(frames) == 1 else (*plan.bucket, len(frames))


def _pixels(entry: _PlannedLatent) -> int:
    """What an entry's tensors scale with: its bucket's area, times its frames for a clip."""
    width, height = entry.plan.bucket
    return width * height * (len(entry.frames) if entry.frames is not None else 1)


# How far the estimate of the entries still to encode may pass the free space before a cache node refuses them (10 %:
# Cache Latents scales the first entry by pixels, and an item with a mask that the first lacks is a little larger; Cache
# Text scales it by tokens, and a text's pooled output does not grow with them).
ROOM_ESTIMATE_SLACK = 1.1


def _refuse_without_room(writer: "ShardWriter", needed: int, node: str, rest: str, one: str) -> None:
    """After a cache node wrote its first new entry: `needed` bytes for the entries still to encode (`rest`, as told;
    `one`: the first's size and what it was) against the free space on the cache's disk. Where they would not fit
    (beyond the estimate's slack), a DiskFullError now, not after hours of encoding with the disk full meanwhile for
    every other program; what was encoded is kept (written before the refusal: the writer keeps nothing on its way out
    of a WriteError)."""
    store = writer.store
    free = free_bytes(store.root)
    if free is None or needed <= free * ROOM_ESTIMATE_SLACK:
        return
    writer.flush()
    raise DiskFullError(
        f"disk full: {node} needs about {format_bytes(needed)} more for the {rest} still to encode ({one}), and "
        f"{format_bytes(free)} is free on the disk of {display_path(store.root)}. Free space on that disk, then queue "
        "again; what was encoded so far is kept.")


def _check_latent_room(writer: "ShardWriter", first: _PlannedLatent, first_bytes: int,
                       rest: Sequence[_PlannedLatent]) -> None:
    """Cache Latents' items still to encode, sized as its first new one scaled by their pixels (_pixels), against the
    disk (a ControlNet dataset's control images are cached as pixels: 12 MiB an image at 1024 px)."""
    needed = first_bytes * sum(_pixels(entry) for entry in rest) // max(_pixels(first), 1)
    width, height = first.plan.bucket
    _refuse_without_room(writer, needed, "Cache Latents (Headroom)", f"{len(rest)} item(s)",
                         f"{format_bytes(first_bytes)} for one of {width}x{height}")


TOKEN_COUNT_SAMPLE = 2000  # the most texts _check_text_room tokenizes to size the rest


def _check_text_room(writer: "ShardWriter", first: str, first_bytes: int, rest: Sequence[str],
                     text_tokens: Callable[[str], int] | None) -> None:
    """Cache Text's texts still to encode, sized as its first new one scaled by their token counts (`text_tokens`, the
    encoder's tokenizer: padded encoders such as CLIP give every short text the same count, unpadded ones such as
    Qwen's do not, and the first is often the empty prompt), or each as large as the first without a count (captions
    encoded with reference images, whose vision tokens the text alone does not count). A Flux caption is 4 MiB in
    fp32 (256 T5 tokens x 4096), a Wan one 8 MiB, and tag orders multiply them. Past TOKEN_COUNT_SAMPLE texts, an
    even sample of them is counted and scaled (tokenizing takes 0.1-0.3 ms a text: 200,000 tag orders would take a
    minute)."""
    tokens = max(text_tokens(first), 1) if text_tokens is not None else None
    if tokens is None:
        needed, one = first_bytes * len(rest), f"{format_bytes(first_bytes)} for the first"
    else:
        counted = rest if len(rest) <= TOKEN_COUNT_SAMPLE else \
            [rest[i * len(rest) // TOKEN_COUNT_SAMPLE] for i in range(TOKEN_COUNT_SAMPLE)]
        needed = first_bytes * sum(text_tokens(text) for text in counted) * len(rest) // (tokens * len(counted))
        one = f"{format_bytes(first_bytes)} for one of {tokens} token" + ("s" if tokens != 1 else "")
    _refuse_without_room(writer, needed, "Cache Text (Headroom)", f"{len(rest)} text(s)", one)


def cache_latents(
    dataset: Dataset,
    store: ShardStore,
    encode: Callable[[torch.Tensor], torch.Tensor],
    fingerprint: str,
    encoder_options: Mapping,
    *,
    control_encoding: str = "pixels",
    progress: Callable[[int, int], None] = _no_progress,
    check_interrupt: Callable[[], None] = _no_interrupt,
    downscale: int = 1,
    frame_step: int | None = None,
    start_image: str | None = None,
    start_encode: Callable[[torch.Tensor], Mapping[str, torch.Tensor]] | None = None,
) -> tuple[LatentCache, CacheReport]:
    """Encode every (cropped, maybe mirrored) dataset image that is not cached yet.

    `encode(pixels [1, H, W, 3]) -> latents [1, C, ...]` is called only for misses, one item at a
    time; `check_interrupt()` is called before each one (a cancel raises there, after the entries
    finished so far are written). Control images are stored as pixels at the bucket size, or as
    latents from the same `encode` with control_encoding="latents". `downscale`: image px per latent px of the
    encoder (8; Flux.2's VAE: 16): a bucket side it does not divide is refused before anything is encoded (the VAE
    would crop it silently). Clips (training/data/video.py) are encoded whole, `encode(frames [F, H, W, 3])`, as
    stock VAE Encode encodes a video; `frame_step`: pixel frames per latent frame of a video encoder (clips are cut to
    frame_step * k + 1 frames), None for an image encoder (clips must then be one frame). `start_image` (a stock node's
    name) with `start_encode(frames [F, H, W, 3]) -> {START_CONDITIONING name: tensor}`: each item's start-image
    conditioning (image-to-video: its first frame through that node) is cached beside its latent, with the frame.
    """
    if (start_image is None) != (start_encode is None):
        raise ValueError("start_image and start_encode go together")
    if control_encoding not in ("pixels", "latents"):
        raise ValueError(f"control_encoding must be 'pixels' or 'latents', got {control_encoding!r}")
    started = time.monotonic()
    report = CacheReport(kind="latents", warnings=list(dataset.warnings))

    planned: list[_PlannedLatent] = []
    enlarged: dict[int, float] = {}  # item -> how much its image is enlarged for its largest bucket, where it is
    for index, item in enumerate(dataset.items):
        try:
            image_digest = item.image.digest()
            size = item.image.size()
            control_digest = item.control.digest() if item.control is not None else None
            mask_digest = item.mask.digest() if item.mask is not None else None
        except DatasetError as error:  # e.g. too many pixels: the message names the file
            _skip_or_raise(dataset, str(error), report)
            continue
        except (OSError, ValueError, SyntaxError) as error:
            _skip_or_raise(dataset, f"{item.image.describe()}: cannot be read ({_short(error)}); re-export or remove "
                           "it", report)
            continue
        frames = rate = None
        if is_video(item.image):
            try:
                available = item.image.frame_count(dataset.max_frames * dataset.frame_stride)
                frames = tuple(clip_frames(available, dataset.max_frames, dataset.frame_stride, frame_step or 1))
                rate = clip_frame_rate(item.image, dataset.frame_stride)
            except DatasetError as error:
                _skip_or_raise(dataset, str(error), report)
                continue
            if not frames:
                _skip_or_raise(dataset, f"{item.image.describe()}: has no frames; remove it", report)
                continue
            if frame_step is None and len(frames) > 1:
                raise DatasetError(f"{item.image.describe()}: a clip of {len(frames)} frames, but this VAE encodes single "
                                   "images; cache clips with a video model's VAE (Wan), or set max_frames to 1 to train "
                                   "on each clip's first frame")
        if item.mask is not None:
            try:
                _check_mask(item, size, dataset, available if frames is not None else None)
            except DatasetError as error:
                _skip_or_raise(dataset, str(error), report)
                continue
        # One item per size (resolution, then the extra ones) and mirror; an item's key is its crop's, so the items
        # at `resolution` keep the keys they had before extra sizes existed.
        for bucket, flip in dict.fromkeys((bucket_for(*size, resolution, dataset.step, dataset.upscale,
                                                      dataset.bucket_sides), flip)
                                          for resolution in dataset.resolutions
                                          for flip in ((False, True) if dataset.flip else (False,))):
            plan = plan_crop(size, bucket, dataset.crop, dataset.seed, image_digest, flip)
            factor = upscale_factor(size, bucket)
            if factor >= ENLARGED_NOTE_FACTOR:
                enlarged[index] = max(enlarged.get(index, 0.0), factor)
            reduce = reduce_factor(size, plan.resized)
            key = entry_key({
                "kind": "latent", "encoder": fingerprint, "options": dict(encoder_options),
                "image": image_digest, "crop": plan.key_params(),
                "control": control_digest, "control_encoding": control_encoding if control_digest else None,
                **({"decode_reduce": reduce} if reduce > 1 else {}),  # keys of images decoded whole are unchanged
                **({"mask": mask_digest} if mask_digest else {}),  # keys of items without a mask are unchanged
                **({"frames": list(frames)} if frames is not None else {}),  # image keys are unchanged
                **({"start_image": start_image} if start_image else {}),  # keys without a start image are unchanged
            })
            planned.append(_PlannedLatent(index, key, plan, text_key(item.caption), reduce,
                                          reference_text_key(item.caption, control_digest) if control_digest else None,
                                          frames, rate))

    if enlarged:
        most = max(enlarged, key=enlarged.get)
        report.notes.append(
            f"{len(enlarged)} image(s) smaller than their bucket, enlarged {ENLARGED_NOTE_FACTOR:g}x or more (most: "
            f"{dataset.items[most].name}, {enlarged[most]:.2f}x); enlarged images teach softness: "
            + ("turn upscale_small_images off on the dataset node to train them in smaller buckets, or lower "
               "resolution" if dataset.upscale else "they are smaller than the smallest bucket"))
    odd = sorted({p.plan.bucket for p in planned if p.plan.bucket[0] % downscale or p.plan.bucket[1] % downscale})
    if odd:
        sizes = ", ".join(f"{w}x{h}" for w, h in odd)
        raise DatasetError(f"bucket size(s) {sizes} are not multiples of this VAE's {downscale}x downscale (it would "
                           f"crop them); set the dataset's step (and resolution) to a multiple of {downscale}")

    good, problems = store.verify(p.key for p in planned)
    report.warnings += store.warnings + problems
    misses = [p for p in planned if p.key not in good]
    report.hits, report.misses = len(planned) - len(misses), len(misses)
    progress(report.hits, len(planned))

    failed_items: set[int] = set()
    if misses:
        store.check_writable()
        # ((item index, decode reduction), pixels, control pixels, mask pixels): the variants of an item decoded at one
        # reduction (mirrored ones; sizes that decode it alike) share a decode
        loaded: tuple | None = None
        sized = False
        with store.writer() as writer:
            for done, entry in enumerate(misses, start=1):
                check_interrupt()
                item = dataset.items[entry.item_index]
                if entry.item_index in failed_items:
                    continue
                if loaded is None or loaded[0] != (entry.item_index, entry.reduce):
                    try:
                        loaded = ((entry.item_index, entry.reduce),
                                  item.image.load_frames(list(entry.frames), entry.reduce)
                                  if entry.frames is not None else item.image.load(entry.reduce),
                                  item.control.load(entry.reduce) if item.control is not None else None,
                                  _load_mask(item.mask, entry))
                    except DatasetError as error:
                        failed_items.add(entry.item_index)
                        _skip_or_raise(dataset, str(error), report)
                        continue
                    except (OSError, ValueError, SyntaxError) as error:
                        failed_items.add(entry.item_index)
                        _skip_or_raise(dataset, f"{item.image.describe()}: cannot be decoded ({_short(error)}); "
                                                "re-export or remove it", report)
                        continue
                _, pixels, control_pixels, mask_pixels = loaded
                if entry.frames is not None:  # [F, H, W, 3]: every frame cropped alike, encoded as one clip
                    sample = torch.stack([apply_crop(frame, entry.plan) for frame in pixels])
                else:
                    sample = apply_crop(pixels, entry.plan).unsqueeze(0)
                tensors = {"latent": _single(encode(sample), item.name)}
                if start_encode is not None:
                    start = start_encode(sample)
                    tensors.update({name: _single(start[name], item.name) for name in START_CONDITIONING})
                    tensors["start_frame"] = sample[0]
                if mask_pixels is not None:  # one image (every frame), or the clip's frames cropped alike
                    cropped = apply_crop(mask_pixels, entry.plan) if mask_pixels.ndim == 3 else \
                        torch.stack([apply_crop(frame, entry.plan) for frame in mask_pixels])
                    tensors["mask"] = latent_mask(cropped, tensors["latent"], frame_step, item.mask.describe())
                if control_pixels is not None:
                    control = apply_crop(control_pixels, entry.plan)
                    tensors["control"] = control if control_encoding == "pixels" else _single(
                        encode(control.unsqueeze(0)), item.name)
                meta = {"bucket": list(_bucket_key(entry.plan, entry.frames)), "name": item.name}
                if entry.frame_rate is not None:  # a record only: reuse reads the rate from the dataset again
                    meta["frame_rate"] = entry.frame_rate
                writer.add(entry.key, tensors, meta)
                progress(report.hits + done, len(planned))
                if not sized:  # the first new entry sizes the rest
                    sized = True
                    _check_latent_room(writer, entry, sum(t.numel() * t.element_size() for t in tensors.values()),
                                       misses[done:])
        report.bytes_written = writer.bytes_written

    kept = [p for p in planned if p.item_index not in failed_items]
    if not kept:
        raise DatasetError("no dataset item could be cached:\n- " + "\n- ".join(report.warnings))
    entries = store.entries
    items = [
        (p.key, entries[p.key]["shard"], _bucket_key(p.plan, p.frames), p.text_key,
         "control" in entries[p.key]["tensors"], dataset.items[p.item_index].name, p.reference_text_key)
        for p in kept
    ]
    cache = LatentCache(store.root, items, fingerprint, latent_channels=0,
                        control_kind=control_encoding if dataset.has_control else None,
                        masked=["mask" in entries[p.key]["tensors"] for p in kept], start_image=start_image,
                        frame_rates=[p.frame_rate for p in kept],
                        repeats=[dataset.items[p.item_index].repeats for p in kept])
    cache.latent_channels = int(cache.latent(0).shape[0])
    # The node's output outlives the call (ComfyUI keeps it): the shard just read is unmapped again, or Windows could
    # not delete the cache folder until a run released it
    cache.release_files()
    report.items, report.buckets = len(cache), len(cache.buckets)
    report.bytes_total = sum(entries[p.key]["bytes"] for p in kept)
    report.seconds = time.monotonic() - started
    return cache, report


def _check_mask(item, size: tuple[int, int], dataset: Dataset, clip_frames_read: int | None) -> None:
    """A mask fits its item: the item's size; for a clip, one image or as many frames as the clip (both counted up to
    the frames the clip's selection reads, max_frames x frame_stride)."""
    mask = item.mask
    mask_size = mask.size()
    if mask_size != tuple(size):
        raise DatasetError(f"{mask.describe()}: mask is {mask_size[0]}x{mask_size[1]} but its "
                           f"{'clip' if clip_frames_read is not None else 'image'} {item.image.describe()} is "
                           f"{size[0]}x{size[1]}; resize the mask to match")
    if not is_video(mask):
        return
    if clip_frames_read is None:
        raise DatasetError(f"{mask.describe()}: a clip of masks for the image {item.image.describe()}; give an image "
                           "its mask as one image")
    limit = dataset.max_frames * dataset.frame_stride
    mask_frames = mask.frame_count(limit)
    if mask_frames != clip_frames_read:
        raise DatasetError(f"{mask.describe()}: {mask_frames} mask frames but its clip {item.image.describe()} has "
                           f"{clip_frames_read} (both counted up to max_frames x frame_stride = {limit}); give the "
                           "mask one frame per frame of the clip, or one image for every frame")


def _load_mask(mask, entry: _PlannedLatent) -> torch.Tensor | None:
    """A mask's pixels: [H, W, 3] for an image mask, [F, H, W, 3] (the clip's selected frames) for a clip of masks."""
    if mask is None:
        return None
    return mask.load_frames(list(entry.frames), entry.reduce) if is_video(mask) else mask.load(entry.reduce)


def latent_mask(mask_pixels: torch.Tensor, latent: torch.Tensor, frame_step: int | None = None,
                what: str = "the mask") -> torch.Tensor:
    """A loss mask 0..1 at the latent's resolution, each latent cell the mean of the pixels it covers (area averaging:
    no cell is weighted by a single pixel); the mask's grey value is its mean over channels.

    mask_pixels: [bucket_h, bucket_w, 3], one image (for a clip: every frame), or [F, bucket_h, bucket_w, 3], a clip's
    frames. Image latent [C, h, w] -> [1, h, w]; video latent [C, T, h, w] -> [1, T, h, w], each latent frame the mean of
    the frames it encodes by the video VAE's temporal rule (`frame_step` pixel frames per latent frame after the
    first: Wan's latent frame 0 is frame 0, latent frame k frames 4k-3..4k)."""
    if latent.ndim not in (3, 4):
        raise DatasetError(f"loss masks need image latents [C, h, w] or video latents [C, T, h, w]; this VAE gives "
                           f"{list(latent.shape)}")
    grey = mask_pixels.to(torch.float32).mean(dim=-1)
    if grey.ndim == 3:  # a clip's frames -> one mask per latent frame
        step = frame_step or 1
        if (grey.shape[0] - 1) % step or latent.ndim != 4 or 1 + (grey.shape[0] - 1) // step != latent.shape[1]:
            count = latent.shape[1] if latent.ndim == 4 else 1
            raise DatasetError(f"{what}: {grey.shape[0]} mask frames do not make the {count} latent frame(s) of its "
                               f"clip ({list(latent.shape)}, {step} frames per latent frame)")
        later = grey[1:].reshape(-1, step, *grey.shape[1:]).mean(dim=1)
        grey = torch.cat([grey[:1], later])
    else:
        grey = grey[None].expand(latent.shape[1] if latent.ndim == 4 else 1, -1, -1)
    mask = F.interpolate(grey[:, None], size=tuple(latent.shape[-2:]), mode="area")[:, 0].clamp_(0.0, 1.0)
    return mask[None].contiguous() if latent.ndim == 4 else mask


def _single(latents: torch.Tensor, name: str) -> torch.Tensor:
    if latents.shape[0] != 1:
        raise ValueError(f"{name}: the encoder returned a batch of {latents.shape[0]} for one image")
    return latents[0]


def _skip_or_raise(dataset: Dataset, problem: str, report: CacheReport) -> None:
    if not dataset.skip_bad:
        raise DatasetError(f"{problem}; or enable skip_bad on the dataset node to leave it out")
    report.warnings.append(f"skipped {problem}")


def cache_text(
    captions: Iterable[str],
    store: ShardStore,
    encode: Callable[[str], Mapping[str, torch.Tensor]],
    fingerprint: str,
    encoder_options: Mapping,
    *,
    progress: Callable[[int, int], None] = _no_progress,
    check_interrupt: Callable[[], None] = _no_interrupt,
    references: Sequence | None = None,
    encode_with_reference: Callable[[str, torch.Tensor], Mapping[str, torch.Tensor]] | None = None,
    reference_encoding: str | None = None,
    tag_shuffles: int = 0,
    keep_tags: int = 0,
    tag_dropout: float = 0.0,
    text_tokens: Callable[[str], int] | None = None,
) -> tuple[TextCache, CacheReport]:
    """Encode every distinct caption, and the empty prompt, that is not cached yet.

    `encode(text) -> {"cross_attn": [T, D], extra name: tensor, ...}` is called only for misses. With `references`
    (one image source per caption: each item's control image), every caption is encoded with its reference as
    `encode_with_reference(text, pixels [H, W, 3])` and cached per (caption, reference), found by
    `reference_text_key`; `reference_encoding` names how (the stock node), and the empty prompt stays text only.
    With `tag_shuffles`, each caption's other tag orders (caption_tags.tag_orders, the first `keep_tags` in place)
    are encoded too, with the same reference, under the caption's key; with `tag_dropout`, each other order leaves
    out each of its shuffled tags with that probability. A caption of several lines (alternative captions) is
    cached line by line under its key (caption_tags.caption_variants), each line with its tag orders.
    `text_tokens(text)`: how many tokens the encoder makes of a text, to size the texts still to encode after the
    first (_check_text_room); without it, each is sized as the first.
    """
    started = time.monotonic()
    report = CacheReport(kind="text")
    captions = list(captions)

    def entry_of(caption: str, reference_digest: str | None = None) -> str:
        fields = {"kind": "text", "encoder": fingerprint, "options": dict(encoder_options), "caption": caption}
        if reference_digest is not None:
            fields.update(reference=reference_digest, reference_encoding=reference_encoding)
        return entry_key(fields)

    # text key -> [(text, reference image source or None, entry key) per tag order, the caption as written first], in
    # order; the empty prompt (caption dropout) is always text only, as written.
    empty_key = text_key("")
    wanted = {empty_key: [("", None, entry_of(""))]}
    if references is None:
        for caption in captions:
            if text_key(caption) not in wanted:
                wanted[text_key(caption)] = [(text, None, entry_of(text)) for text in caption_variants(
                    caption, tag_shuffles, keep_tags, tag_dropout)]
    else:
        if len(references) != len(captions) or any(source is None for source in references):
            raise DatasetError("encoding captions with reference images needs a control image for every item; give "
                               "the dataset one (Dataset from Images' control_images, Dataset from Folder's "
                               "control_folder)")
        for caption, source in zip(captions, references):
            digest = source.digest()
            if reference_text_key(caption, digest) not in wanted:
                wanted[reference_text_key(caption, digest)] = [
                    (text, source, entry_of(text, digest))
                    for text in caption_variants(caption, tag_shuffles, keep_tags, tag_dropout)]

    encodings = [order for orders in wanted.values() for order in orders]
    good, problems = store.verify(entry for _, _, entry in encodings)
    report.warnings += store.warnings + problems
    misses = [order for order in encodings if order[2] not in good]
    report.hits, report.misses = len(encodings) - len(misses), len(misses)
    progress(report.hits, len(encodings))
    if misses:
        store.check_writable()
        with store.writer() as writer:
            for done, (text, source, entry) in enumerate(misses, start=1):
                check_interrupt()
                tensors = dict(encode(text) if source is None else encode_with_reference(text, source.load()))
                if "cross_attn" not in tensors:
                    raise ValueError("the text encoder gave no 'cross_attn' tensor")
                writer.add(entry, tensors)
                progress(report.hits + done, len(encodings))
                if done == 1 and len(misses) > 1:  # the first new entry sizes the rest
                    _check_text_room(writer, text, sum(t.numel() * t.element_size() for t in tensors.values()),
                                     [text for text, _, _ in misses[1:]], None if source is not None else text_tokens)
        report.bytes_written = writer.bytes_written

    entries = store.entries
    table = {key: [(entry, entries[entry]["shard"], tuple(entries[entry]["tensors"])) for _, _, entry in orders]
             for key, orders in wanted.items()}
    cache = TextCache(store.root, table, empty_key=empty_key, fingerprint=fingerprint,
                      reference_encoding=reference_encoding if references is not None else None,
                      tag_shuffling=_tag_shuffling(tag_shuffles, keep_tags, tag_dropout),
                      captions={text_key(caption): caption for caption in captions})
    report.items = len(encodings)
    report.bytes_total = sum(entries[entry]["bytes"] for _, _, entry in encodings)
    several = len({text_key(caption) for caption in captions if len(caption_lines(caption)) > 1})
    if several:
        report.notes.append(f"{several} caption(s) of several lines: each line cached as an alternative caption; "
                            "training picks one per item and step")
    wildcards = len({text_key(caption) for caption in captions if WILDCARD.search(caption)})
    if wildcards:
        report.notes.append(f"{wildcards} caption(s) with {{a|b}} wildcards: each text they make cached (at most "
                            f"{MAX_WILDCARD_TEXTS} per line); training picks one per item and step")
    if tag_shuffles:
        shuffled = sum(len(orders) > 1 for key, orders in wanted.items() if key != empty_key)
        report.notes.append(f"tag shuffling: {shuffled} of {len(wanted) - 1} captions cached in "
                            f"{sum(len(orders) for orders in wanted.values()) - 1} tag orders in all (keep_tags "
                            f"{keep_tags}" + (f", tag_dropout {tag_dropout:g}" if tag_dropout else "") +
                            "); training picks one order per item and step")
        if not shuffled:
            report.warnings.append(f"tag_shuffles={tag_shuffles}, but no caption has two or more comma-separated "
                                   f"tags after its first {keep_tags}: every caption is cached as written (set "
                                   "tag_shuffles to 0 for captions in sentences)")
    report.seconds = time.monotonic() - started
    return cache, report


def _tag_shuffling(shuffles: int, keep: int, dropout: float) -> dict | None:
    """What a text cache's tag orders were drawn with, as runs store it ("dropout" only where used, so runs stored
    before it existed resume), or None without tag orders."""
    if not shuffles:
        return None
    return {"shuffles": shuffles, "keep": keep, **({"dropout": dropout} if dropout else {})}
