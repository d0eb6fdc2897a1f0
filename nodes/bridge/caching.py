"""The caching loops (training/data/cache_store.py) on ComfyUI's encoders: the VAE encodes as VAE Encode does, the
CLIP as CLIP Text Encode does; each keyed by its fingerprint and options, its memory recorded, and unloaded after
(as the policy's `encoders` says) whatever happens."""
from __future__ import annotations

import contextlib

import torch

import comfy.model_management

from ...training.data.cache_store import CacheStoreError, cache_latents, cache_text
from ...training.data.caption_tags import TooManyVariants
from ...training.data.files import WriteError
from ...training.memory.memory_stats import PhaseRecorder
from .cache_folders import open_store, with_relocate_hint
from .comfy_model import AS_GIVEN
from .encoders import ProgressForward, encoder_fingerprint, frame_step, spatial_downscale, unbatch, unload_encoder
from .start_image import START_IMAGE_NODES, start_encoder


@contextlib.contextmanager
def _encoding(patcher, policy, recorder: PhaseRecorder, phase: str):
    """One caching phase: recorded, a full cache disk saying how to move the cache, the encoder unloaded after."""
    try:
        with recorder.phase(phase):
            yield
    except (CacheStoreError, WriteError) as error:
        raise with_relocate_hint(error) from error
    finally:
        unload_encoder(patcher, policy)


@contextlib.contextmanager
def _named(node: str, *errors: type[Exception]):
    """Those errors as ValueError naming the node users see (the engine's messages name the caption or file)."""
    try:
        yield
    except errors as error:
        raise ValueError(f"{node}: {error}") from None


def cache_vae_latents(dataset, vae, control_encoding: str = "pixels", policy=None, start_image: str = "none", *,
                      node: str):
    """(LatentCache, summary) of `dataset` encoded by `vae` (cached items reused); with a `start_image` node
    (WanImageToVideo), each item's first frame through that node too (image-to-video: nodes/bridge/start_image.py).
    `node`: the caching node's display name, for messages."""
    vae.throw_exception_if_invalid()
    if start_image not in START_IMAGE_NODES:
        raise ValueError(f"{node}: start_image={start_image!r}: choose one of {', '.join(START_IMAGE_NODES)}")
    node = None if start_image == "none" else start_image
    store = open_store("latents")
    options = {
        "vae": type(vae.first_stage_model).__qualname__,
        "dtype": str(vae.vae_dtype),
        "output_dtype": str(vae.vae_output_dtype()),
    }
    recorder = PhaseRecorder(vae.device)
    with _encoding(vae.patcher, policy, recorder, "caching latents"):
        cache, report = cache_latents(
            dataset, store, vae.encode, encoder_fingerprint(vae.patcher), options,
            control_encoding=control_encoding, progress=ProgressForward(),
            check_interrupt=comfy.model_management.throw_exception_if_processing_interrupted,
            downscale=spatial_downscale(vae), frame_step=frame_step(vae),
            start_image=node, start_encode=start_encoder(node, vae) if node else None,
        )
    cache.memory_phases = recorder.phases  # a training run built on this cache starts its memory record with it
    return cache, report.summary()


# How captions are encoded: as CLIPTextEncode, or with each item's control image as the reference, exactly as a stock
# edit text-encode node does (comfy_extras/nodes_qwen.py: the image's vision tokens join the prompt).
REFERENCE_ENCODINGS = ("none", "TextEncodeQwenImageEdit", "TextEncodeQwenImageEditPlus")


def encode_with_reference(encoding: str, clip, text: str, image: torch.Tensor, vae=None) -> list:
    """The conditioning the stock node `encoding` makes of `text` and one reference image [1, H, W, 3] (with a vae,
    the node appends the image's reference latent too)."""
    from comfy_extras import nodes_qwen

    if encoding == "TextEncodeQwenImageEdit":
        return nodes_qwen.TextEncodeQwenImageEdit.execute(clip, text, vae, image).args[0]
    if encoding == "TextEncodeQwenImageEditPlus":
        return nodes_qwen.TextEncodeQwenImageEditPlus.execute(clip, text, vae, image).args[0]
    raise ValueError(f"reference_encoding={encoding!r}: choose one of {', '.join(REFERENCE_ENCODINGS)}")


def flat_conditioning(conditioning, what: str, instead: str, dropped: set[str] | None = None
                      ) -> dict[str, torch.Tensor]:
    """One prompt's CLIP Text Encode result `[[cond, {extras}]]` as the text cache holds it (TextCache.conditioning):
    "cross_attn" and every tensor extra without the batch dimension of 1, an extra given without one kept as given
    and marked, a bool flag as a 0-d tensor; the names of other entries (hooks: a sampling-time feature, not part of
    the text embedding) added to `dropped`. Several conditionings (scheduled hooks, one per keyframe) are refused:
    "`what` has scheduled hooks ...; `instead`"."""
    if len(conditioning) != 1:
        raise ValueError(f"{what} has scheduled hooks, which give one conditioning per keyframe; {instead}")
    cond, extras = conditioning[0]
    tensors = {"cross_attn": unbatch(cond)}
    for name, value in extras.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] != 1:
            # An entry the encoder gives without a batch dimension (one prompt's entries have a batch of 1), such
            # as Anima's t5xxl_ids [tokens]: kept as given and marked, so the model gets it as the stock node
            # gives it (comfy_model.model_inputs) rather than with a batch dimension added.
            tensors[name] = value
            tensors[name + AS_GIVEN] = torch.tensor(True)
        elif isinstance(value, torch.Tensor):
            tensors[name] = unbatch(value)
        elif isinstance(value, bool):  # a flag extra_conds reads (LTX-2's unprocessed_ltxav_embeds): a 0-d tensor
            tensors[name] = torch.tensor(value)
        elif value is not None and dropped is not None:
            dropped.add(name)
    return tensors


def cache_clip_text(dataset, clip, policy=None, reference_encoding: str = "none", *, node: str, tag_shuffles: int = 0,
                    keep_tags: int = 0, tag_dropout: float = 0.0):
    """(TextCache, summary) of the dataset's captions and the empty prompt encoded by `clip` (cached ones reused);
    with a `reference_encoding` node, each caption is encoded with its item's control image by that node; with
    `tag_shuffles`, other orders of each caption's tags too (with `tag_dropout`, some tags left out of them;
    cache_store.cache_text). `node`: the caching node's
    display name, for messages."""
    store = open_store("text")
    options = {
        "text_encoder": type(clip.cond_stage_model).__qualname__,
        "tokenizer": type(clip.tokenizer).__qualname__,
        "layer_idx": clip.layer_idx,
        "tokenizer_options": repr(sorted(clip.tokenizer_options.items())),
    }
    dropped: set[str] = set()

    def encode(text: str) -> dict[str, torch.Tensor]:
        # Exactly CLIPTextEncode: tokenize, then encode_from_tokens_scheduled -> [[cond, {extras}]].
        return flatten(clip.encode_from_tokens_scheduled(clip.tokenize(text)))

    def text_tokens(text: str) -> int:
        # What the text's entry grows with: the longest token sequence the CLIP's tokenizer makes of it over its
        # encoders (a long CLIP caption's chunks of 77 together; Flux's T5 sequence rather than its CLIP-L one).
        counts = [sum(len(chunk) for chunk in chunks if isinstance(chunk, (list, tuple)))
                  for chunks in clip.tokenize(text).values() if isinstance(chunks, (list, tuple))]
        return max(counts, default=1)

    def encode_reference(text: str, image: torch.Tensor) -> dict[str, torch.Tensor]:
        return flatten(encode_with_reference(reference_encoding, clip, text, image.unsqueeze(0)))

    def flatten(conditioning) -> dict[str, torch.Tensor]:
        return flat_conditioning(conditioning, f"{node}: this CLIP", "remove the hooks from the CLIP before caching",
                                 dropped)

    recorder = PhaseRecorder(clip.patcher.load_device)
    with_references = reference_encoding != "none"
    with _encoding(clip.patcher, policy, recorder, "caching text"), _named(node, TooManyVariants):
        cache, report = cache_text(
            [item.caption for item in dataset.items], store, encode, encoder_fingerprint(clip.patcher), options,
            progress=ProgressForward(),
            check_interrupt=comfy.model_management.throw_exception_if_processing_interrupted,
            references=[item.control for item in dataset.items] if with_references else None,
            encode_with_reference=encode_reference if with_references else None,
            reference_encoding=reference_encoding if with_references else None,
            tag_shuffles=tag_shuffles, keep_tags=keep_tags, tag_dropout=tag_dropout, text_tokens=text_tokens,
        )
    cache.memory_phases = recorder.phases
    if dropped:
        report.warnings.append(f"non-tensor conditioning entries not cached: {', '.join(sorted(dropped))}")
    return cache, report.summary()
