"""The LATENT_CACHE / TEXT_CACHE contracts (training/data/cache_store.py) in memory, for engine tests with toy models."""
from __future__ import annotations


class MemoryLatentCache:
    def __init__(self, latents, text_keys, buckets=None, controls=None, control_kind=None):
        # controls: each item's cached control (pixels [8h, 8w, 3] or a latent), of `control_kind` ("pixels" /
        # "latents"), as a cache with control images holds them (controlnet_build.check_control_cache)
        self._latents, self._keys, self._controls = latents, text_keys, controls
        self.buckets = buckets or {(32, 32): list(range(len(latents)))}
        self.latent_channels, self.fingerprint = latents[0].shape[0], "memory"
        self.control_kind = control_kind if controls is not None else None

    def __len__(self):
        return len(self._latents)

    def latent(self, i):
        return self._latents[i]

    def text_key(self, i):
        return self._keys[i]

    def repeats(self, i):
        return 1

    def control(self, i):
        return None if self._controls is None else self._controls[i]

    def name(self, i):
        return f"item {i}"

    def release_files(self):  # nothing mapped
        pass


class MemoryTextCache:
    def __init__(self, conds, empty, orders=None, captions=None):
        # orders: key -> the conditionings of the caption's other tag orders (TextCache.tag_orders); captions: key ->
        # the text each key was encoded from (TextCache.captions: what a run training the text encoder encodes)
        self._conds, self._empty, self.fingerprint = conds, empty, "memory"
        self._orders = orders or {}
        self.captions = captions or {}
        self.tag_shuffling = None

    def keys(self):
        return list(self._conds)

    def conditioning(self, key, order=0):
        return self._conds[key] if order == 0 else self._orders[key][order - 1]

    def tag_orders(self, key):
        return 1 + len(self._orders.get(key, ()))

    def text_length(self, key):  # TextCache.text_length
        return max(c["cross_attn"].shape[0] for c in [self._conds[key], *self._orders.get(key, ())])

    def empty_conditioning(self):
        return self._empty

    def release_files(self):  # nothing mapped
        pass
