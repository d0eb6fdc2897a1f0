"""The offload policy of a run: where the frozen base lives, how it is stored, what is recomputed, where
optimizer state sits. One policy serves the whole run (caching, training, validation, save).

    OffloadPolicy(vram_budget_gb="auto", base_placement="streamed", checkpointing="blocks")

- vram_budget_gb: the device memory the run may use, in GiB, or "auto": ComfyUI's free memory minus
  `reserve_gb` (the node resolves it; the engine only ever sees a number of bytes).
- base_placement: "resident" (all frozen weights on the device), "partial" (the plan's whole blocks and the
  non-block weights resident, the other blocks streamed; without a plan ComfyUI keeps what fits), "streamed"
  (only the non-block weights are resident; every block streams from host RAM through the ring of device slots;
  see weight_streaming.py).
- base_storage: "as_loaded" (ComfyUI's dtype) or a low-bit copy of the block linears: "fp8" / "int8" /
  "nf4" (see lowbit.py; these change the numerics of the frozen base).
- checkpointing: "off", "blocks" (recompute each block in backward), "blocks_cpu_offload" (and keep the
  saved block inputs in host RAM, see activation_offload.py), at checkpoint_depth (1: each block, 2: each child
  of a block...); checkpoint_blocks: only these blocks (selective checkpointing, the planner's choice; "": all).
  The training nodes' gradient_checkpointing / checkpoint_depth inputs map into these (`run_policy`).
- optimizer_state: "gpu", "cpu" (the optimizer steps fp32 host copies, see optimizer_parking.py) or "streamed" (in
  host RAM, each tensor's state crossing to the card for its step; needs fused_backward: streamed_optimizer_state.py).
- park_optimizer_during_validation: optimizer state and gradients go to host RAM while validating.
- fused_backward: each trained tensor is stepped inside backward and its gradient freed (fused_backward.py).
- trained_weights: "device" or "host" (a full fine-tune's trained weights in host RAM, streamed through the card
  layer by layer, each stepped where its optimizer state is; needs fused_backward: trained_weights_on_host.py).
- vae_tiled_decode: "auto" (tiled when the VAE plus a full decode would not fit the budget), "on", "off" (the
  stock full decode, which ComfyUI itself retries in tiles after an out-of-memory error).
- encoders: "unload_after_use" (text encoders and VAE are loaded for caching / validation only) or
  "keep_loaded" (they stay loaded after use, as stock nodes leave them, and ComfyUI unloads them when a model
  needs the room: faster repeated validation on a card with memory to spare; not counted in the budget).
- host_ram_budget_gb: the host RAM the ComfyUI process may use, in GiB, or "auto" (what it uses plus what the OS
  reports available, less a reserve): the planner fits it beside the device budget (see host_ram.py).
- card: "custom" (the fields above, as given) or a card to fit ("this GPU (auto)", "8 GB" ... "48 GB"): the
  training Init nodes then let the planner choose placement, storage, checkpointing and optimizer state
  (nodes/bridge/run_settings.resolve_policy -> planner.plan_auto); the budget is the card less `reserve_gb`.

Each field carries how the policy node shows it (a NodeInput in the field's metadata, plain data): the node's
inputs are these fields, in order (nodes/memory.HeadroomOffloadPolicy), and its values come back through
`OffloadPolicy.from_node_inputs`.
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
from .host_ram import HOST_RESERVE_BYTES
from ..checks import check_finite
from .trained_weights_on_host import PLACES as TRAINED_WEIGHTS, problem as trained_weights_problem
from .weight_streaming import BasePlacement, WeightStreamer, base_placement

PLACEMENTS = ("resident", "partial", "streamed")
STORAGES = ("as_loaded", "fp8", "int8", "nf4")
CHECKPOINTING = ("off", "blocks", "blocks_cpu_offload")
OPTIMIZER_STATES = ("gpu", "cpu", "streamed")
VAE_TILED = ("auto", "on", "off")
ENCODERS = ("unload_after_use", "keep_loaded")
# The card a run fits (policy field `card`): "custom" is the fields as given; any other is resolved by the planner
# when a training run opens (nodes/bridge/run_settings.resolve_policy). "N GB": a card of N GiB, less reserve_gb.
THIS_GPU = "this GPU (auto)"
CARDS = (THIS_GPU, "8 GB", "12 GB", "16 GB", "24 GB", "48 GB", "custom")
GIB = 1024 ** 3

POLICY_FORMAT = "headroom.offload_policy"


class PolicyError(ValueError):
    """An offload policy value is invalid; the message names the field and the allowed values."""

    __module__ = public_module(__name__)  # a clean type name in ComfyUI's error report


@dataclasses.dataclass(frozen=True)
class NodeInput:
    """How the policy node (nodes/memory.HeadroomOffloadPolicy) shows one field, in plain data: training/ imports
    no ComfyUI, the node turns this into its io input. The node's default is the field's default, except where
    `zero_means` is set: the node's 0 stands for that field value (the budget's "auto"), so its default is 0."""
    kind: str  # "float", "int", "bool", "combo" or "string"
    tooltip: str
    options: tuple[str, ...] = ()  # a combo's values, in the node's order
    min: float | None = None
    max: float | None = None
    step: float | None = None
    zero_means: str | None = None
    optional: bool = False  # appended after workflows were saved: absent from them, the field's default applies
    advanced: bool = False  # folded behind the node's advanced inputs (V3 `advanced`): expert settings

    def node_default(self, field_default: Any) -> Any:
        return 0.0 if self.zero_means is not None and field_default == self.zero_means else field_default

    def field_value(self, node_value: Any) -> Any:
        """The field's value for what the node was given (the node's widget types, cast as the field expects)."""
        if self.zero_means is not None and node_value == 0:
            return self.zero_means
        cast = {"float": float, "int": int, "bool": bool}.get(self.kind)
        return cast(node_value) if cast is not None else node_value


def _field(default: Any, node_input: NodeInput) -> Any:
    return dataclasses.field(default=default, metadata={"node_input": node_input})


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    # Each field carries its node input: the policy node's inputs are these fields, in this order.
    vram_budget_gb: float | str = _field("auto", NodeInput(
        "float", min=0.0, max=4096.0, step=0.25, zero_means="auto",
        tooltip="Device memory the run may use, in GiB. 0 = auto: what ComfyUI can free on its device minus the "
        "reserve, measured when the policy is used."))
    reserve_gb: float = _field(1.0, NodeInput(
        "float", min=0.0, max=64.0, step=0.25, advanced=True,
        tooltip="Kept free for other programs and ComfyUI itself (auto budget only)."))
    base_placement: str = _field("resident", NodeInput(
        "combo", options=PLACEMENTS,
        tooltip="resident: frozen weights on the device; partial: what fits stays, the rest streams; streamed: "
        "every block streams from host RAM one block ahead (needs checkpointing)."))
    base_storage: str = _field("as_loaded", NodeInput(
        "combo", options=STORAGES,
        tooltip="Precision of the frozen block linears: as loaded, or a low-bit copy (fp8; int8 / nf4 need the pip "
        "package bitsandbytes) that changes the numerics."))
    checkpointing: str = _field("off", NodeInput(
        "combo", options=CHECKPOINTING,
        tooltip="blocks: recompute each block in backward; blocks_cpu_offload: also keep the saved block inputs in "
        "host RAM."))
    checkpoint_depth: int = _field(1, NodeInput(
        "int", min=1, max=5, advanced=True,
        tooltip="1: recompute each model block; 2: each child of a block (finer, less memory, more recompute)."))
    optimizer_state: str = _field("gpu", NodeInput(
        "combo", options=OPTIMIZER_STATES,
        tooltip="gpu: optimizer state on the card. cpu: optimizer state and fp32 master weights in host RAM, the "
        "step run there. streamed: the state in host RAM, each tensor's crossing to the card for its step (needs "
        "fused_backward; far faster than cpu for a full fine-tune, at the cost of that traffic every step)."))
    park_optimizer_during_validation: bool = _field(True, NodeInput(
        "bool", advanced=True, tooltip="Move optimizer state and gradients to host RAM while validating."))
    vae_tiled_decode: str = _field("auto", NodeInput(
        "combo", options=VAE_TILED, advanced=True,
        tooltip="VAE decode of validation samples. auto: tiled when the VAE plus a full decode would not fit the "
        "budget; on: always tiled; off: the stock decode (which retries in tiles after running out of memory)."))
    encoders: str = _field("unload_after_use", NodeInput(
        "combo", options=ENCODERS,
        tooltip="unload_after_use: text encoders and VAE leave the device after caching and after each "
        "validation, leaving the most room for training. keep_loaded: they stay loaded, as stock nodes leave "
        "them, and ComfyUI unloads them when a model needs the room; faster repeated validation where memory is "
        "to spare (not counted in the budget)."))
    # Appended last, default "custom": a workflow saved before it existed keeps exactly its policy.
    card: str = _field("custom", NodeInput(
        "combo", options=CARDS, optional=True,
        tooltip="The card to fit. this GPU (auto) / 8-48 GB: when the training run opens, the planner measures the "
        "model and picks the fastest base placement, base storage, checkpointing and optimizer state whose planned "
        "peak fits that card (this GPU: what ComfyUI can free now; N GB: N GiB) less reserve_gb; the plan shows on "
        "the training node. custom: exactly the settings above, budget vram_budget_gb."))
    # Appended after `card`, default "auto": a workflow saved before it existed gets the auto host budget.
    host_ram_budget_gb: float | str = _field("auto", NodeInput(
        "float", min=0.0, max=65536.0, step=1.0, zero_means="auto", optional=True, advanced=True,
        tooltip="Host (system) RAM this ComfyUI process may use, in GiB. 0 = auto: what it uses now plus what the "
        f"OS reports available, less {HOST_RESERVE_BYTES // GIB} GiB. The planner skips policies that would not fit it, and a run that "
        "cannot fit stops before its first step, saying what to change, instead of being killed by the OS."))
    # Appended last, default off: a workflow saved before it existed trains exactly as it did.
    fused_backward: bool = _field(False, NodeInput(
        "bool", optional=True,
        tooltip="Step each trained tensor inside backward as soon as its gradient is ready, then free that gradient: "
        "a full set of gradients never exists (full fine-tuning: 2-4 bytes per trained weight saved). Gradient "
        "clipping then applies to each tensor on its own; needs grad_accumulation 1, one device and a precision "
        "other than fp16. With optimizer_state cpu each tensor is stepped in host RAM, where its state lives."))
    # Appended last, default device: a workflow saved before it existed trains exactly as it did.
    trained_weights: str = _field("device", NodeInput(
        "combo", options=TRAINED_WEIGHTS, optional=True, advanced=True,
        tooltip="Full fine-tuning: where the trained weights live. device: on the card. host: in host RAM, each layer "
        "copied to the card for its forward and backward (needs fused_backward on): with optimizer_state gpu or "
        "streamed each tensor is stepped on the card in backward (its state there, or crossing with it) and the "
        "update copied back; with cpu its "
        "gradient is copied back and stepped in host RAM (far slower for billions of weights). The card holds no "
        "trained weight (but those of trained_weights_card_blocks), at the cost of that traffic every step."))

    # Appended last, default "": a workflow saved before it existed checkpoints every block, as it did.
    checkpoint_blocks: str = _field("", NodeInput(
        "string", optional=True, advanced=True,
        tooltip="Selective checkpointing: the model blocks to recompute (indices in forward order, comma-separated, "
        "e.g. 0,1,5), where checkpointing is on; empty = every block. A card's plan fills this in: the blocks whose "
        "recompute is cheapest per byte saved, until the step fits (blocks streamed from host RAM are always "
        "recomputed)."))
    # Appended last, default "": a workflow saved before it existed keeps every trained weight where trained_weights
    # says, as it did.
    trained_weights_card_blocks: str = _field("", NodeInput(
        "string", optional=True, advanced=True,
        tooltip="With trained_weights host: the model blocks whose trained weights stay on the card all the same "
        "(indices in forward order, comma-separated); empty = none. A card's plan fills this in: as many as fit "
        "beside the step, since each one kept saves its three crossings per step."))

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        try:
            check_finite("offload policy", vram_budget_gb=self.vram_budget_gb, reserve_gb=self.reserve_gb,
                         host_ram_budget_gb=self.host_ram_budget_gb)
        except ValueError as error:
            raise PolicyError(str(error)) from None
        for name in ("vram_budget_gb", "host_ram_budget_gb"):  # a number of GiB > 0, or "auto"
            budget = getattr(self, name)
            if budget != "auto" and (isinstance(budget, (bool, str)) or not isinstance(budget, (int, float))
                                     or not budget > 0):
                raise PolicyError(f"offload policy: {name}={budget!r}: give a number of GiB > 0 or 'auto'")
        if isinstance(self.reserve_gb, bool) or not isinstance(self.reserve_gb, (int, float)) or self.reserve_gb < 0:
            raise PolicyError(f"offload policy: reserve_gb={self.reserve_gb!r} must be a number of GiB >= 0")
        for field in dataclasses.fields(self):  # the combo fields: their values are their node input's options
            allowed = field.metadata["node_input"].options
            value = getattr(self, field.name)
            if field.metadata["node_input"].kind == "combo" and value not in allowed:
                raise PolicyError(f"offload policy: {field.name}={value!r} is not one of {', '.join(allowed)}")
        if isinstance(self.checkpoint_depth, bool) or not isinstance(self.checkpoint_depth, int) or self.checkpoint_depth < 1:
            raise PolicyError(f"offload policy: checkpoint_depth={self.checkpoint_depth!r} must be an integer >= 1")
        for name in ("park_optimizer_during_validation", "fused_backward"):
            if not isinstance(getattr(self, name), bool):
                raise PolicyError(f"offload policy: {name} must be true or false")
        if self.base_placement != "resident" and self.checkpointing == "off":
            # Backward needs every frozen weight a block used (to pass gradients through it): without
            # recomputation autograd would keep each streamed block's device copy alive until backward,
            # so the whole base would end up on the device anyway.
            raise PolicyError(
                f"offload policy: base_placement={self.base_placement!r} needs checkpointing 'blocks' or "
                "'blocks_cpu_offload': without it backward keeps every block's weights on the device"
            )
        if not isinstance(self.checkpoint_blocks, str) or len(self.checkpoint_blocks) > 20000:
            raise PolicyError("offload policy: checkpoint_blocks must be text: block indices, comma-separated")
        parse_blocks(self.checkpoint_blocks)
        if not isinstance(self.trained_weights_card_blocks, str) or len(self.trained_weights_card_blocks) > 20000:
            raise PolicyError("offload policy: trained_weights_card_blocks must be text: block indices, "
                              "comma-separated")
        if parse_blocks(self.trained_weights_card_blocks, "trained_weights_card_blocks") and \
                self.trained_weights != "host":
            raise PolicyError("offload policy: trained_weights_card_blocks keeps these blocks' trained weights on the "
                              "card while the others are in host RAM: set trained_weights host, or clear it")
        problem = trained_weights_problem(self)
        if problem is not None:
            raise PolicyError(f"offload policy: {problem}")
        if self.optimizer_state == "streamed" and not self.fused_backward:
            raise PolicyError("offload policy: optimizer_state 'streamed' brings each tensor's state to the card for "
                              "its step inside backward: it needs fused_backward on (or optimizer_state gpu / cpu)")

    # --- budget ----------------------------------------------------------------------------------------------
    @property
    def fits_card(self) -> bool:
        """The planner chooses placement, storage, checkpointing and optimizer state for `card` when a run opens."""
        return self.card != "custom"

    @property
    def card_gb(self) -> float | None:
        """The card's size in GiB for an "N GB" card (None: this GPU, or custom)."""
        return float(self.card.split()[0]) if self.card.endswith(" GB") else None

    @property
    def budget_is_auto(self) -> bool:
        return self.card == THIS_GPU or (self.card == "custom" and self.vram_budget_gb == "auto")

    def budget_bytes(self, free_bytes: int | None = None) -> int:
        """The bytes the run may use: the card's size less the reserve ("N GB" cards), the explicit budget, or
        `free_bytes - reserve` for "auto" (and "this GPU")."""
        if self.card_gb is not None:
            budget = int((self.card_gb - self.reserve_gb) * GIB)
            if budget <= 0:
                raise PolicyError(f"offload policy: card {self.card!r} less a reserve of {self.reserve_gb} GiB leaves "
                                  "nothing: lower reserve_gb")
            return budget
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
        return self.replace(vram_budget_gb=round(self.budget_bytes(free_bytes) / GIB, 3),
                            card="custom" if self.card == THIS_GPU else self.card)

    # --- derived switches --------------------------------------------------------------------------------
    def decode_tiled(self, needed_bytes: int | None, budget_bytes: int | None) -> bool:
        """The tiled-decode rule, for validation's decode (nodes/bridge/validation.decode) and the planner's estimate: "on"
        always, "off" never, "auto" when the VAE's weights plus a full decode (`needed_bytes`) exceed the budget
        (None: unknown, not tiled)."""
        if self.vae_tiled_decode == "on":
            return True
        return (self.vae_tiled_decode == "auto" and needed_bytes is not None and budget_bytes is not None
                and needed_bytes > budget_bytes)

    @property
    def checkpoint_selection(self) -> frozenset[int] | None:
        """The block indices checkpointing applies to (None: every block; only where checkpointing is on)."""
        return parse_blocks(self.checkpoint_blocks) if self.checkpoint_blocks.strip() else None

    @property
    def trained_card_blocks(self) -> frozenset[int]:
        """The blocks whose trained weights stay on the card with trained_weights host (trained_weights_card_blocks)."""
        return parse_blocks(self.trained_weights_card_blocks, "trained_weights_card_blocks")

    @property
    def checkpointing_enabled(self) -> bool:
        return self.checkpointing != "off"

    @property
    def streams_blocks(self) -> bool:
        return self.placement.stream_blocks

    @property
    def placement(self) -> BasePlacement:
        """What base_placement does: how ComfyUI loads the base and whether blocks stream (one decision:
        weight_streaming.base_placement)."""
        return base_placement(self.base_placement)

    def replace(self, **changes: Any) -> "OffloadPolicy":
        return dataclasses.replace(self, **changes)

    @property
    def optimizer_state_said(self) -> str:
        """Where the optimizer state is, in words: "on gpu", "on cpu", "streamed from host RAM"."""
        return "streamed from host RAM" if self.optimizer_state == "streamed" else f"on {self.optimizer_state}"

    def describe(self) -> str:
        if self.fits_card:
            budget = f"fit to {self.card}"
        else:
            budget = "auto" if self.budget_is_auto else f"{float(self.vram_budget_gb):g} GiB"
        depth = f" (depth {self.checkpoint_depth})" if self.checkpointing_enabled else ""
        if self.checkpointing_enabled and self.checkpoint_selection is not None:
            depth += f", {len(self.checkpoint_selection)} selected blocks"
        return (f"budget {budget}, base {self.base_placement}/{self.base_storage}, checkpointing "
                f"{self.checkpointing}{depth}, optimizer state {self.optimizer_state_said}" + self._kept_by_a_fit()
                + (f" ({len(self.trained_card_blocks)} blocks' on the card)" if self.trained_card_blocks else ""))

    def describe_before_fit(self) -> str:
        """A policy to fit to a card, before a run opens: what the fit keeps. Its base placement, checkpointing and
        optimizer state (and where a full fine-tune's trained weights live) are the planner's to choose when the run
        opens (planner.candidate_policies), so they are not said as if in effect."""
        lower = ", a lower one only if nothing fits" if self.base_storage == "as_loaded" else ""
        return (f"budget fit to {self.card}, base storage {self.base_storage} to start from{lower}"
                + self._kept_by_a_fit())

    def _kept_by_a_fit(self) -> str:
        """The settings a card's fit keeps as they are, in words (", parked during validation, fused backward")."""
        return ((", parked during validation" if self.park_optimizer_during_validation else "")
                + (", encoders kept loaded" if self.encoders == "keep_loaded" else "")
                + (", fused backward" if self.fused_backward else "")
                + (", trained weights in host RAM" if self.trained_weights == "host" else ""))

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

    # --- the policy node -----------------------------------------------------------------------------------
    @classmethod
    def node_inputs(cls) -> list[tuple[str, NodeInput, Any]]:
        """(field name, its NodeInput, the node's default) for every field, in order: the policy node's inputs."""
        return [(f.name, f.metadata["node_input"], f.metadata["node_input"].node_default(f.default))
                for f in dataclasses.fields(cls)]

    @classmethod
    def from_node_inputs(cls, values: dict) -> "OffloadPolicy":
        """The policy for the policy node's input values (one per field, by name)."""
        inputs = {f.name: f.metadata["node_input"] for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(inputs))
        missing = sorted(name for name in set(inputs) - set(values) if not inputs[name].optional)
        if unknown or missing:
            raise PolicyError(f"offload policy: node inputs unknown {unknown}, missing {missing}")
        return cls(**{name: inputs[name].field_value(value) for name, value in values.items()})


def parse_blocks(text: str, field: str = "checkpoint_blocks") -> frozenset[int]:
    """Block indices from "0, 3,5" (policy checkpoint_blocks, trained_weights_card_blocks); "" is none. Anything else
    is a PolicyError naming `field`."""
    indices = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or len(part) > 6:
            raise PolicyError(f"offload policy: {field}: {part[:20]!r} is not a block index (0, 1, ...)")
        indices.add(int(part))
    return frozenset(indices)


def format_blocks(indices) -> str:
    """The policy's checkpoint_blocks text for a set of block indices."""
    return ",".join(str(i) for i in sorted(indices))


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
    blocks = list(blocks)
    try:
        # A full fine-tune's placement names the base layers it never reads (`unread`): they stay in host RAM, which
        # takes the streamer's whole-block placement whatever the policy's (resident: every block kept, none streamed).
        if policy.placement.stream_blocks or streamer_options.get("unread"):
            streamer = WeightStreamer(blocks, device, **streamer_options).attach()
        selected = policy.checkpoint_selection
        if selected is not None and streamer is not None:
            # A streamed block is always recomputed: without it autograd keeps its device copy until backward. Which
            # blocks stream is ComfyUI's load's choice (what it left in host RAM: the streamer's non-empty slots).
            selected = selected | streamer.streamed_blocks()
        if policy.checkpointing == "blocks":
            restores.append(wrap_blocks(blocks, policy.checkpoint_depth, inplace_inputs=inplace_inputs,
                                        selected=selected))
        else:
            problem = inplace_depth_problem(inplace_inputs, policy.checkpoint_depth)
            if policy.checkpointing == "blocks_cpu_offload" and problem is not None:
                raise PolicyError(f"offload policy: {problem}")
            restores.append(wrap_blocks(blocks, None, inplace_inputs=inplace_inputs))
            if policy.checkpointing == "blocks_cpu_offload":
                if selected is not None and max(selected, default=0) >= len(blocks):
                    raise PolicyError(f"offload policy: checkpoint_blocks {sorted(selected)} are not among this "
                                      f"model's {len(blocks)} blocks")
                chosen = blocks if selected is None else [blocks[i] for i in sorted(selected)]
                restores.append(enable_offloaded_checkpointing(chosen, policy.checkpoint_depth))
        yield streamer
    finally:
        if streamer is not None:
            streamer.detach()
        for restore in reversed(restores):
            restore()
