"""The offload policy of a run: where the frozen base lives, how it is stored, what is recomputed, where
optimizer state sits. One policy serves the whole run (caching, training, validation, save).

    OffloadPolicy(vram_budget_gb="auto", base_placement="streamed", checkpointing="blocks")

- vram_budget_gb: the device memory the run may use, in GiB, or "auto": ComfyUI's free memory minus
  `reserve_gb` (the node resolves it; the engine only ever sees a number of bytes).
- base_placement: "resident" (all frozen weights on the device), "partial" (ComfyUI keeps what fits
  resident; the other blocks are streamed), "streamed" (only the non-block weights are resident; every
  block is streamed from host RAM, one block ahead; see weight_streaming.py).
- base_storage: "as_loaded" (ComfyUI's dtype) or a low-bit copy of the block linears: "fp8" / "int8" /
  "nf4" (see lowbit.py; these change the numerics of the frozen base).
- checkpointing: "off", "blocks" (recompute each block in backward), "blocks_cpu_offload" (and keep the
  saved block inputs in host RAM, see activation_offload.py), at checkpoint_depth (1: each block, 2: each child
  of a block...). The training nodes' gradient_checkpointing / checkpoint_depth inputs map into these
  (`run_policy`).
- optimizer_state: "gpu" or "cpu" (the optimizer steps fp32 host copies, see optimizer_parking.py).
- park_optimizer_during_validation: optimizer state and gradients go to host RAM while validating.
- vae_tiled_decode: "auto" (tiled when the VAE plus a full decode would not fit the budget), "on", "off" (the
  stock full decode, which ComfyUI itself retries in tiles after an out-of-memory error).
- encoders: "unload_after_use" (text encoders and VAE are loaded for caching / validation only) or
  "keep_loaded" (they stay loaded after use, as stock nodes leave them, and ComfyUI unloads them when a model
  needs the room: faster repeated validation on a card with memory to spare; not counted in the budget).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Any, Iterator, Sequence

import torch

from .. import public_module
from .activation_offload import enable_offloaded_checkpointing
from .checkpointing import inplace_depth_problem, wrap_blocks
from ..checks import check_finite
from .weight_streaming import WeightStreamer

PLACEMENTS = ("resident", "partial", "streamed")
STORAGES = ("as_loaded", "fp8", "int8", "nf4")
CHECKPOINTING = ("off", "blocks", "blocks_cpu_offload")
OPTIMIZER_STATES = ("gpu", "cpu")
VAE_TILED = ("auto", "on", "off")
ENCODERS = ("unload_after_use", "keep_loaded")
GIB = 1024 ** 3

POLICY_FORMAT = "headroom.offload_policy"


class PolicyError(ValueError):
    """An offload policy value is invalid; the message names the field and the allowed values."""

    __module__ = public_module(__name__)  # a clean type name in ComfyUI's error report


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    vram_budget_gb: float | str = "auto"
    reserve_gb: float = 1.0
    base_placement: str = "resident"
    base_storage: str = "as_loaded"
    checkpointing: str = "off"
    checkpoint_depth: int = 1
    optimizer_state: str = "gpu"
    park_optimizer_during_validation: bool = True
    vae_tiled_decode: str = "auto"
    encoders: str = "unload_after_use"

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        try:
            check_finite("offload policy", vram_budget_gb=self.vram_budget_gb, reserve_gb=self.reserve_gb)
        except ValueError as error:
            raise PolicyError(str(error)) from None
        budget = self.vram_budget_gb
        if isinstance(budget, str):
            if budget != "auto":
                raise PolicyError(f"offload policy: vram_budget_gb={budget!r}: give a number of GiB > 0 or 'auto'")
        elif isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
            raise PolicyError(f"offload policy: vram_budget_gb={budget!r}: give a number of GiB > 0 or 'auto'")
        if isinstance(self.reserve_gb, bool) or not isinstance(self.reserve_gb, (int, float)) or self.reserve_gb < 0:
            raise PolicyError(f"offload policy: reserve_gb={self.reserve_gb!r} must be a number of GiB >= 0")
        for field, allowed in (("base_placement", PLACEMENTS), ("base_storage", STORAGES),
                               ("checkpointing", CHECKPOINTING), ("optimizer_state", OPTIMIZER_STATES),
                               ("vae_tiled_decode", VAE_TILED), ("encoders", ENCODERS)):
            value = getattr(self, field)
            if value not in allowed:
                raise PolicyError(f"offload policy: {field}={value!r} is not one of {', '.join(allowed)}")
        if isinstance(self.checkpoint_depth, bool) or not isinstance(self.checkpoint_depth, int) or self.checkpoint_depth < 1:
            raise PolicyError(f"offload policy: checkpoint_depth={self.checkpoint_depth!r} must be an integer >= 1")
        if not isinstance(self.park_optimizer_during_validation, bool):
            raise PolicyError("offload policy: park_optimizer_during_validation must be true or false")
        if self.base_placement != "resident" and self.checkpointing == "off":
            # Backward needs every frozen weight a block used (to pass gradients through it): without
            # recomputation autograd would keep each streamed block's device copy alive until backward,
            # so the whole base would end up on the device anyway.
            raise PolicyError(
                f"offload policy: base_placement={self.base_placement!r} needs checkpointing 'blocks' or "
                "'blocks_cpu_offload': without it backward keeps every block's weights on the device"
            )

    # --- budget ----------------------------------------------------------------------------------------------
    @property
    def budget_is_auto(self) -> bool:
        return self.vram_budget_gb == "auto"

    def budget_bytes(self, free_bytes: int | None = None) -> int:
        """The bytes the run may use: the explicit budget, or `free_bytes - reserve` for "auto"."""
        if not self.budget_is_auto:
            return int(float(self.vram_budget_gb) * GIB)
        if free_bytes is None:
            raise PolicyError("offload policy: vram_budget_gb='auto' needs the device's free memory to resolve")
        budget = int(free_bytes - self.reserve_gb * GIB)
        if budget <= 0:
            raise PolicyError(
                f"offload policy: 'auto' budget is {free_bytes / GIB:.2f} GiB free minus a reserve of "
                f"{self.reserve_gb} GiB, which leaves nothing: lower reserve_gb or free device memory"
            )
        return budget

    def resolved(self, free_bytes: int) -> "OffloadPolicy":
        """This policy with an "auto" budget turned into GiB (free memory minus the reserve)."""
        if not self.budget_is_auto:
            return self
        return self.replace(vram_budget_gb=round(self.budget_bytes(free_bytes) / GIB, 3))

    # --- derived switches --------------------------------------------------------------------------------
    def decode_tiled(self, needed_bytes: int | None, budget_bytes: int | None) -> bool:
        """The tiled-decode rule, for validation's decode (nodes/train_lora.decode) and the planner's estimate: "on"
        always, "off" never, "auto" when the VAE's weights plus a full decode (`needed_bytes`) exceed the budget
        (None: unknown, not tiled)."""
        if self.vae_tiled_decode == "on":
            return True
        return (self.vae_tiled_decode == "auto" and needed_bytes is not None and budget_bytes is not None
                and needed_bytes > budget_bytes)

    @property
    def checkpointing_enabled(self) -> bool:
        return self.checkpointing != "off"

    @property
    def streams_blocks(self) -> bool:
        return self.base_placement in ("partial", "streamed")

    def replace(self, **changes: Any) -> "OffloadPolicy":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        budget = "auto" if self.budget_is_auto else f"{float(self.vram_budget_gb):g} GiB"
        depth = f" (depth {self.checkpoint_depth})" if self.checkpointing_enabled else ""
        return (f"budget {budget}, base {self.base_placement}/{self.base_storage}, checkpointing "
                f"{self.checkpointing}{depth}, optimizer state on {self.optimizer_state}"
                + (", parked during validation" if self.park_optimizer_during_validation else "")
                + (", encoders kept loaded" if self.encoders == "keep_loaded" else ""))

    # --- JSON ----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": POLICY_FORMAT, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "OffloadPolicy":
        if not isinstance(data, dict):
            raise PolicyError("offload policy: expected a JSON object")
        data = dict(data)
        if data.pop("format", POLICY_FORMAT) != POLICY_FORMAT:
            raise PolicyError(f"offload policy: the JSON is not a {POLICY_FORMAT!r} object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PolicyError(f"offload policy: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "OffloadPolicy":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise PolicyError(f"offload policy: not valid JSON ({error})") from None
        return cls.from_dict(data)


def run_policy(policy: OffloadPolicy | None, gradient_checkpointing: bool = False,
               checkpoint_depth: int = 1) -> OffloadPolicy:
    """The policy a run trains under, resolved once when it opens: the given policy (None: everything resident),
    with the training nodes' `gradient_checkpointing` / `checkpoint_depth` inputs turning on per-block
    checkpointing ("blocks" at that depth) where the policy has none; a policy's own checkpointing takes
    precedence. Everything after (trainer, placement, validation, planner) reads only the policy."""
    if isinstance(checkpoint_depth, bool) or not isinstance(checkpoint_depth, int) or checkpoint_depth < 1:
        raise PolicyError(f"checkpoint_depth={checkpoint_depth} must be >= 1")
    policy = policy if policy is not None else OffloadPolicy()
    if gradient_checkpointing and not policy.checkpointing_enabled:
        policy = policy.replace(checkpointing="blocks", checkpoint_depth=checkpoint_depth)
    return policy


@contextlib.contextmanager
def memory_features(policy: OffloadPolicy, blocks: Sequence[torch.nn.Module], device: torch.device | str, *,
                    inplace_inputs: bool = False, **streamer_options) -> Iterator[WeightStreamer | None]:
    """Everything the policy changes inside the training step, around a run of steps; a drop-in for the
    trainer's `checkpointing.wrap_blocks` call:

        with memory_features(policy, [m for _, m in denoiser.blocks()], denoiser.device,
                             inplace_inputs=getattr(denoiser, "inplace_blocks", False)):
            ... trainer.train_step() ...

    per-block checkpointing (plain, or with the saved block inputs in host RAM; blocks that update their
    inputs in place protected as wrap_blocks does) and streamed blocks ("partial" / "streamed"). Yields
    the WeightStreamer (or None). Low-bit storage (lowbit.LowBitBase), optimizer state in host RAM
    (optimizer_parking.HostOptimizer) and parking during validation (optimizer_parking.parked) live
    across steps and are set up by the caller.
    """
    restores = []
    streamer = None
    try:
        if policy.checkpointing == "blocks":
            restores.append(wrap_blocks(blocks, policy.checkpoint_depth, inplace_inputs=inplace_inputs))
        else:
            problem = inplace_depth_problem(inplace_inputs, policy.checkpoint_depth)
            if policy.checkpointing == "blocks_cpu_offload" and problem is not None:
                raise PolicyError(f"offload policy: {problem}")
            restores.append(wrap_blocks(blocks, None, inplace_inputs=inplace_inputs))
            if policy.checkpointing == "blocks_cpu_offload":
                restores.append(enable_offloaded_checkpointing(blocks, policy.checkpoint_depth))
        if policy.streams_blocks:
            streamer = WeightStreamer(blocks, device, **streamer_options).attach()
        yield streamer
    finally:
        if streamer is not None:
            streamer.detach()
        for restore in reversed(restores):
            restore()
