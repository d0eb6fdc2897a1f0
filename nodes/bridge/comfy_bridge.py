"""The run: the TRAINING_RUN value (`TrainingRun`) between the engine (training/) and ComfyUI's model objects.

A `TrainingRun` is composed of
- a `RunRecord`: the run directory (checked against the run's configuration), the holdout split, the per-phase
  memory record;
- a `Placement`: the training clone of the MODEL, where its frozen base lives (low-bit object patches, ComfyUI's
  load as the policy places it) and its release;
- what the run trains, a strategy of its own module: `run_lora.LoraTraining` (adapters on the clone) or
  `run_controlnet.ControlNetTraining` (a ControlNet next to it). The strategy builds the trainable and the
  denoiser, and owns save / apply / sampling conditioning / metadata; the run owns what every run does (train to a
  step, events, failure handling, validation loss, history, weights).
The offload policy is resolved once, when the run opens (training/memory/policy.run_policy), and every part reads
`run.policy`. The MODEL as the engine sees it: nodes/bridge/comfy_model.py; the planner's description: nodes/bridge/planning.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import pathlib
import statistics
import sys
import time

import torch

import comfy.model_management
import comfy.patcher_extension
import comfy.utils

from ...training.core.adapters import adapter_layer_types
from ...training.memory.checkpointing import inplace_depth_problem, pinned_reading
from ...training.checks import named
from ...training.data.files import WriteError, open_regular
from ...training.memory.lowbit import LowBitBase, LowBitLinear
from ...training.memory import pinned_host
from ...training import os_compat
from ...training.memory.memory_stats import PhaseRecorder, process_rss_bytes
from ...training.memory.oom import is_out_of_memory, out_of_memory
from ...training.memory.policy import OffloadPolicy
from ...training.memory.weight_streaming import BasePlacement, base_placement, validation_placement
from ...training.core.distributed import is_main_process
from ...training.core.run_dir import RunDir, RunFolderError
from ...training.core.scalar_log import ScalarLog
from ...training.core.trainer import StepReport, Trainer
from .comfy_model import (base_fingerprint, comfy_pinned_block_keys, data_fingerprint, model_blocks,
                          quantized_weights_for_inference, replace_inference_tensors, training_blocks,
                          training_code_paths)
from .memory_fallback import FallbackWatch
from .planning import comfy_pins_host_memory, next_plan_for, pinnable_host_bytes, run_plan

STEP_EVENT = "headroom.train.step"  # read by js/headroom_live.js and workflows/headroom_run.py
VALIDATE_EVENT = "headroom.validate"
STOPPED_EVENT = "headroom.train.stopped"  # a cancel stopped training: the step the run is at, and whether it is saved
# Settings added after runs were first stored: a run folder without them trained with these values and resumes.
CONFIG_ADDED_LATER = {"session.train.objective.loss_type": "mse", "session.train.objective.huber_delta": 0.1,
                      "session.train.ema_decay": 0.0, "session.train.prior_ratio": 0.0,
                      "session.reference": "none", "session.train.objective.noise_min": 0.0,
                      "session.train.objective.noise_max": 1.0, "session.adapter.full_precision": "fp32",
                      "session.train.objective.masked_out_weight": 0.0, "session.optimizer.loraplus_lr_ratio": 1.0,
                      "session.optimizer.scale_weight_norms": 0.0, "session.adapter.layers": "",
                      "session.adapter.layer_lr_scales": "", "session.adapter.layer_ranks": "",
                      "session.adapter.layer_alphas": "",
                      "session.train.objective.ip_noise_gamma": 0.0,
                      "session.train.objective.multires_noise_iterations": 0,
                      "session.train.objective.multires_noise_discount": 0.3,
                      "session.train.objective.noise_offset_random_strength": False,
                      "session.train.objective.ip_noise_gamma_random_strength": False,
                      "session.controlnet_precision": "fp32", "session.text_encoder_lr": None}
# Settings older run folders store that are no longer part of what a run is: checkpointing is the policy's (resolved
# when a run opens, training/memory/policy.run_policy) and changes no weight, so a run resumes whatever it was.
CONFIG_REMOVED_LATER = ("session.train.gradient_checkpointing", "session.train.checkpoint_depth")
# Stored values an earlier version wrote for what is now named otherwise: an SD2 model's family was sd15 before
# nodes/bridge/families/sd2.py, a Chroma model's flux before chroma.py; the presets train the same layers, so such runs resume.
CONFIG_RENAMED = {"session.family": {"sd2": "sd15", "chroma": "flux"}}
# Which weights / Save use: auto = the EMA when the run keeps one (TrainingRun.weights).
WEIGHT_CHOICES = ("auto", "trained", "ema")


# --- progress and events ----------------------------------------------------------------------------------
def node_id(node_cls) -> str | None:
    """The id of the node executing now (its hidden unique_id), which events name so the editor finds the node."""
    return getattr(node_cls.hidden, "unique_id", None) if getattr(node_cls, "hidden", None) is not None else None


def node_name(node_cls) -> str:
    """The name users see, for error messages: the node's display name (ComfyUI runs a copy of the class, named
    '...Clone', so the class name is not it)."""
    return node_cls.define_schema().display_name


@contextlib.contextmanager
def said_by(node: str):
    """Errors inside as node `node` says them (training.checks.named): a ValueError stays one; a WriteError (the disk
    full, a file another program holds, a path Windows cannot take) keeps its own type, which ComfyUI's report shows."""
    try:
        yield
    except ValueError as error:
        raise ValueError(named(node, str(error))) from error
    except WriteError as error:
        raise type(error)(named(node, str(error))) from error


def run_and_step(run) -> str:
    """How a node's text names the run and step its result belongs to: "run 'my_lora', step 400"."""
    return f"run '{run.run_dir.name}', step {run.step}"


def send_event(event: str, data: dict) -> None:
    """A websocket event when a ComfyUI server is running in this process (nothing otherwise)."""
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is not None:
        # Sent to every client: the prompt id lets an editor tell its own prompts from others' (js/headroom_live.js).
        instance.send_sync(event, {"prompt_id": getattr(instance, "last_prompt_id", None), **data})


def send_node_text(text: str, shown_on: str | None) -> None:
    """Text on node `shown_on` in the editor now, while the prompt runs (ComfyUI's progress text; nothing without a
    server or a node id)."""
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is not None and shown_on is not None and text:
        instance.send_progress_text(text, shown_on)


MEMORY_KEYS = ("allocated", "reserved", "peak", "rss")  # memory_figures' keys, in bytes


def memory_figures(device: torch.device) -> dict:
    """Device memory (CUDA only: no made-up VRAM figures on a CPU) and the process's resident set."""
    figures = {"allocated": None, "reserved": None, "peak": None, "rss": process_rss_bytes()}
    if device.type == "cuda":
        figures.update(allocated=torch.cuda.memory_allocated(device), reserved=torch.cuda.memory_reserved(device),
                       peak=torch.cuda.max_memory_allocated(device))
    return figures


def history_extras(figures: list[tuple | None], last_validation: dict | None) -> dict:
    """What `headroom_history` carries beyond the curves, compactly: lr per step (4 significant digits), memory
    per step in MiB (only the series that have values: a CPU reports RSS only), the last speed and the last
    validation's images. Per step: aligned with "steps", null where this ComfyUI process did not train that step
    (a run resumed from disk). Older entries without these keys still draw (js/headroom_live.js)."""
    extras = {}
    if any(figures):
        extras["lr"] = [None if f is None or f[0] is None else float(f"{f[0]:.4g}") for f in figures]
        memory = {key: [None if f is None or f[2].get(key) is None else round(f[2][key] / 2**20) for f in figures]
                  for key in MEMORY_KEYS}
        extras["memory_mib"] = {key: values for key, values in memory.items() if any(v is not None for v in values)}
        extras["s_per_step"] = next(f[1] for f in reversed(figures) if f is not None)
    if last_validation is not None:
        extras["images"], extras["images_step"] = last_validation["images"], last_validation["step"]
    return extras


# --- run folders this process has open -------------------------------------------------------------------------
_RUN_IDENTITY: dict[str, tuple | None] = {}  # run folder -> its config.json as the last run here opened it
_RUN_GENERATION: dict[str, int] = {}


def run_generation(run_root: pathlib.Path, run_name: str) -> int:
    """The Init nodes' fingerprint: it changes when a run folder a run of this process opened was deleted or
    replaced since, so ComfyUI runs Init again (a new run, which starts anew in the folder, with its
    config.json) instead of handing on its cached run, whose every write would now fail (RunFolderError)."""
    path = str(pathlib.Path(run_root) / str(run_name))
    if path in _RUN_IDENTITY:
        now = RunDir.config_identity(pathlib.Path(path))
        if now != _RUN_IDENTITY[path]:
            _RUN_GENERATION[path] = _RUN_GENERATION.get(path, 0) + 1
            _RUN_IDENTITY[path] = now
    return _RUN_GENERATION.get(path, 0)


# --- the TRAINING_RUN value -------------------------------------------------------------------------------
def config_json(config) -> dict:
    """A run's dataclass configuration as its run folder stores it (config.json "session"): JSON values only."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


# What a run trains -> (its name in messages, the nodes that take only such runs: display names for messages).
RUN_KINDS = {
    "lora": ("LoRA", {"save": "Save LoRA (Headroom)",
                      "apply": "Apply Trained LoRA (Headroom) on the MODEL, or Save LoRA (Headroom) and the stock "
                               "Load LoRA"}),
    "controlnet": ("ControlNet", {"save": "Save ControlNet (Headroom)",
                                  "apply": "the control_net output of its Init / Train ControlNet node with the stock "
                                           "Apply ControlNet"}),
}


def release_cache_files(*caches) -> None:
    """Unmap the shards the caches (None: not connected) read so far. Windows deletes or replaces no mapped file, and
    ComfyUI keeps a node's inputs and outputs between prompts: a node that read a cache releases it before it returns,
    or the user could not delete or move the cache folder while ComfyUI ran."""
    for cache in caches:
        if cache is not None:
            cache.release_files()


def check_run_kind(run, trains: str, node: str, action: str):
    """What `run` trains (its strategy) for a node that takes only LoRA runs (or only ControlNet runs); another
    kind of run, or something that is no run: a ValueError that names the node, and what to use instead for
    `action` ("save" / "apply")."""
    if not isinstance(run, TrainingRun):
        raise ValueError(  # noqa: TRY004 - an input error, as ComfyUI reports them
            f"{node}: the run input must be a TRAINING_RUN from a Headroom Init or training node, "
            f"not {type(run).__name__}")
    return run.trained_as(trains, node, action)


class RunRecord:
    """A run's record: its directory (checked against the run's configuration, `stored`), the holdout split (the
    last `holdout` cached items), and the per-phase memory record (continued from the directory)."""

    def __init__(self, model, latent_cache, text_cache, stored: dict, holdout: int, run_root: pathlib.Path,
                 run_name: str):
        self.run_dir = RunDir(run_root, run_name)
        self.writes = is_main_process()  # data-parallel ranks > 0 never write the run folder (rank 0 does)
        if self.writes:
            self.run_dir.prune_temp()  # what a killed writer left: temp checkpoint folders, temp files
        self.fingerprint = base_fingerprint(model)
        self.stored = {
            **stored, "base_fingerprint": self.fingerprint,
            "latent_cache": getattr(latent_cache, "fingerprint", None),
            "text_cache": getattr(text_cache, "fingerprint", None), "data": data_fingerprint(latent_cache),
            # None (as for runs from before it was stored) unless the captions were cached in several tag orders
            "tag_shuffling": getattr(text_cache, "tag_shuffling", None),
        }
        self.run_dir.check_compatible(self.stored, added_later=CONFIG_ADDED_LATER, removed_later=CONFIG_REMOVED_LATER,
                                      renamed=CONFIG_RENAMED)
        count = len(latent_cache)
        if holdout >= count:
            raise ValueError(f"holdout={holdout} leaves no training items of the {count} cached")
        self.train_items = list(range(count - holdout))
        self.validation_items = list(range(count - holdout, count)) if holdout else list(self.train_items)
        self.memory = self._memory_record(torch.device(model.load_device), latent_cache, text_cache)

    def _memory_record(self, device: torch.device, latent_cache, text_cache) -> PhaseRecorder:
        """The run's per-phase memory record: continued from the run directory (a resumed run), or started with
        how its caches were built."""
        path = self.run_dir.memory_record_path
        if os.path.lexists(path):
            try:  # a regular file of the run (not a symlink), of a sane size
                with open_regular(path, "memory record", max_bytes=16 << 20) as handle:
                    stored = PhaseRecorder.from_json(handle.read().decode("utf-8"))
                    return PhaseRecorder(device, phases=stored.phases, warnings=stored.warnings,
                                         step_time=stored.step_time)
            except (ValueError, OSError) as error:  # a report, not training state: start a new one
                logging.warning("Headroom: ignoring the unreadable memory record %s of run '%s' (%s); starting a "
                                "new one", path.name, self.run_dir.name, error)
        cached = [*getattr(latent_cache, "memory_phases", []), *getattr(text_cache, "memory_phases", [])]
        return PhaseRecorder(device, phases=[dict(phase) for phase in cached])

    def commit(self) -> None:
        """After the run opened: its configuration written (a new run), the folder remembered (run_generation)."""
        if not self.run_dir.exists() and self.writes:
            self.run_dir.write_config(self.stored)
        _RUN_IDENTITY[str(self.run_dir.path)] = RunDir.config_identity(self.run_dir.path)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Record one phase of the run (training, validation, save) in the memory record, on disk after it."""
        try:
            with self.memory.phase(name):
                yield
        finally:
            if self.writes and self.run_dir.present():  # a vanished run folder is not re-created for a report
                try:
                    self.run_dir.write_file_json(self.run_dir.memory_record_path, self.memory.as_dict(),
                                                 f"memory record of run '{self.run_dir.name}'")
                except WriteError as error:  # a report, not training state: the checkpoint's own error matters
                    logging.warning("Headroom: %s", error)


_NOT_PLANNED = object()


def partial_excess(loaded_bytes: int, planned_bytes: int | None) -> int:
    """How much of the base a "partial" load placed on the device beyond the plan's share (0: none, or no plan)."""
    return 0 if planned_bytes is None else max(0, int(loaded_bytes) - int(planned_bytes))


def keep_to_share(patcher, planned_bytes: int | None) -> int:
    """What is on the device past the plan's share of the base (an earlier load's: a load fills at most to it,
    `comfy_fills_at_most`, and never unloads): back to the share through ComfyUI's own partial unload (the weights it
    moves out are cast per layer from host RAM as they are used). Returns the bytes moved out."""
    over = partial_excess(patcher.loaded_size(), planned_bytes)
    if over:
        patcher.partially_unload(patcher.offload_device, memory_to_free=over)
    return over


@contextlib.contextmanager
def comfy_pins_suspended(patcher, suspend: bool = True):
    """Within the block ComfyUI pins none of `patcher`'s weights (its `pin_weight_to_device`, which its load calls
    for each weight it leaves in host RAM and its partial unload for each weight it moves there, a no-op on this
    patcher alone); as it was after. A whole-block training load: the placement unpins every block weight right after
    (`unpin_block_weights`: the streamer pins its packed buffers) while the streamer keeps the non-block layers on the
    device, so those pins, one cudaHostRegister per tensor for about the whole model each Steps call, would only be
    made to be undone. ComfyUI's pin account and other models' pins are left alone."""
    if not suspend or not hasattr(patcher, "pin_weight_to_device"):
        yield
        return
    patcher.pin_weight_to_device = lambda key: None  # the instance's own, over the class's
    try:
        yield
    finally:
        del patcher.pin_weight_to_device


@contextlib.contextmanager
def comfy_fills_at_most(patcher, most: int | None):
    """Within the block ComfyUI's load leaves at most `most` bytes of `patcher`'s weights on the device (None: as it
    decides), the others marked to be cast from host RAM when used, the state its partial unload leaves a layer in;
    as it was after. `load_models_gpu` fills the free memory (`partially_load`, which may first unpatch and so ask
    again for what was loaded), through the patcher's `load`, here given no more than `most` and never a full load;
    other patchers loaded in the same call (a ControlNet run's ControlNet) load as ComfyUI decides.

    Without it the run's load filled the budget with weights on every attach (the clone is loaded again each Steps
    call and each validation), and sent back to host RAM what the plan does not keep there: a whole-block training
    load (`most` 0) every block, the streamer then moving the non-block layers and the plan's resident blocks once;
    a partial load what lies past its share. Those weights crossed to the device and back for nothing, and their
    freed host copies stayed in the C heap: the GPU kit measured a Steps call's start growing with the budget
    (Flux.1-dev 9.6 / 13.2 / 16.9 s at 8 / 12 / 16 GiB), and the process's host RAM with it. By hand: ComfyUI has
    no per-model limit; its `minimum_memory_required` at the free memory would unload every other model for room."""
    if most is None:
        yield
        return
    outer = vars(patcher).get("load")  # an enclosing limit's (restored after)
    load = outer or functools.partial(type(patcher).load, patcher)

    def loading_at_most(device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False, **kwargs):
        if most < patcher.model_size() and (full_load or lowvram_model_memory > most):
            lowvram_model_memory, full_load = most, False
        return load(device_to, lowvram_model_memory, force_patch_weights, full_load, **kwargs)

    patcher.load = loading_at_most
    try:
        yield
    finally:
        if outer is None:
            del patcher.load
        else:
            patcher.load = outer


def unpin_block_weights(patcher) -> list[str]:
    """The block weights ComfyUI pinned in host RAM (its offload pins them in place), unpinned through its own
    records: the trainer's WeightStreamer packs each streamed block into one buffer of its own and pins that (the
    weights become views of it: a weight ComfyUI still had pinned would be packed beside, doubling its host RAM).
    Returns the keys unpinned."""
    if not hasattr(patcher, "unpin_weight"):
        return []
    keys = comfy_pinned_block_keys(patcher)
    for key in keys:
        patcher.unpin_weight(key)
    return keys


SAMPLING_PLACEMENT_KEY = "headroom.validation_placement"


class Placement:
    """Where the run's frozen base lives: the training clone of the MODEL, its low-bit storage (policy
    base_storage), its load through ComfyUI's model management (policy base_placement) and its release."""

    def __init__(self, model, policy: OffloadPolicy):
        self.policy = policy
        # A classic ModelPatcher even under dynamic VRAM: autograd keeps the weights a layer used until backward,
        # which aimdo-managed weights do not guarantee (docs/MEMORY.md). Elsewhere this is a plain clone.
        self.patcher = model.clone(disable_dynamic=True)
        self.low_bit_bytes = None  # (packed, original) bytes of a low-bit base

    @staticmethod
    def free_shared_module(model) -> None:
        """A previous run's clone loaded with its adapter or low-bit layers in the shared module: unloaded, so the
        module (and the new run's fingerprint of it) is ComfyUI's own again."""
        if any(isinstance(m, (*adapter_layer_types(), LowBitLinear)) for m in model.model.diffusion_model.modules()):
            comfy.model_management.unload_model_and_clones(model)

    @contextlib.contextmanager
    def low_bit_storage(self):
        """policy base_storage fp8 / int8 / nf4: inside the block, low-bit copies of the blocks' frozen Linear
        layers are swapped into the (shared) module, so what is built there wraps them (a LoRA's adapters); after
        it the shared module has its full-precision layers back and ComfyUI swaps the low-bit ones in as object
        patches of the training clone, set before it moves weights to the device (the full-precision block
        weights stay in host RAM) and restored when it unloads the clone."""
        low_bit = self._low_bit_base()
        try:
            yield
        finally:  # the shared module is full precision again even when the build failed
            self.low_bit_bytes = None if low_bit is None else (low_bit.packed_bytes(), low_bit.original_bytes())
            if low_bit is not None:
                low_bit.detach()
                for path, layer in low_bit.replacements.items():
                    self.patcher.add_object_patch(f"diffusion_model.{path}", layer)

    def _low_bit_base(self) -> LowBitBase | None:
        if self.policy.base_storage == "as_loaded":
            return None
        blocks = [name for name, _ in model_blocks(self.patcher.model.diffusion_model)]
        patched = sorted(key for key in self.patcher.patches
                         if any(key.startswith(f"diffusion_model.{block}.") for block in blocks))
        if patched:
            raise ValueError(f"base_storage={self.policy.base_storage!r}: the MODEL carries weight patches (a LoRA "
                             f"loaded before training, e.g. {patched[0]}) that a low-bit copy would drop: train on the "
                             "model without them, or use base_storage 'as_loaded'")
        return LowBitBase(self.patcher.model.diffusion_model, self.policy.base_storage, self.patcher.offload_device,
                          prefixes=blocks)

    def load(self, patchers: list, extra_bytes: int, base_device_bytes: int | None = None,
             placement: BasePlacement | None = None, whole_blocks: bool = False) -> None:
        """Load the training patchers through ComfyUI's model management, as the policy places the frozen base
        (`extra_bytes`: what the run adds on the device beyond the weights, for ComfyUI's accounting;
        `base_device_bytes`: for "partial" placement, the share of the base the run's plan keeps on the device;
        `placement`: another than the policy's, validation's own; `whole_blocks`: the plan places whole blocks
        (planner.Plan.resident_blocks): every block goes to host RAM here and the trainer's WeightStreamer keeps the
        plan's resident blocks and the non-block layers on the device, streaming the rest through its ring)."""
        # Decided in one place: training/memory/weight_streaming.base_placement
        training = placement is None
        placement = placement if placement is not None else self.policy.placement
        if whole_blocks:  # also a resident full fine-tune's: its trained layers' base weights stay in host RAM
            placement = dataclasses.replace(placement, full_load=False, blocks_to_host=True, stream_blocks=True)
        apart = self.patcher.load_device != self.patcher.offload_device
        # ComfyUI fills its free memory (less extra_bytes) with weights: it loads no more than the plan keeps there
        # (whole blocks: none, every block goes to host RAM below; partial: the planned share)
        most = (0 if whole_blocks and training else base_device_bytes) if apart else None
        # weights copied to the device here are then usable by autograd; whole blocks: ComfyUI pins nothing the
        # placement would unpin right after
        with torch.inference_mode(False), comfy_pins_suspended(self.patcher, whole_blocks and training), \
                comfy_fills_at_most(self.patcher, most):
            # Not a full load: ComfyUI may keep part of the base in host RAM (its lowvram load); the trainer's
            # WeightStreamer brings those blocks to the device one block ahead.
            comfy.model_management.load_models_gpu(patchers, memory_required=extra_bytes,
                                                   force_full_load=placement.full_load)
            # What an earlier load left past the planned share (a load never unloads): back to it through ComfyUI's
            # own partial unload.
            keep_to_share(self.patcher, base_device_bytes)
            if placement.blocks_to_host and apart:
                # Every block's frozen weights back to host RAM through ComfyUI's own partial unload, so its
                # accounting stays right; non-block weights (embedders, final layers) stay resident.
                blocks = [block for _, block in training_blocks(self.patcher.model.diffusion_model)]
                block_bytes = sum(t.numel() * t.element_size() for block in blocks
                                  for t in [*block.parameters(), *block.buffers()] if not t.requires_grad)
                if whole_blocks:
                    # ComfyUI unloads smallest first, so freeing the blocks' bytes may take non-block layers and
                    # leave slices of blocks: everything goes, and the streamer brings the non-block layers and the
                    # plan's resident blocks back whole (one copy each, at attach).
                    block_bytes = max(block_bytes, self.patcher.loaded_size())
                self.patcher.partially_unload(self.patcher.offload_device, memory_to_free=block_bytes)
            if training and placement.stream_blocks and apart:
                unpin_block_weights(self.patcher)  # the streamer pins its own packed buffers
            # ComfyUI's load ends with the adapters injected; its weight keys (and the weights it pinned) are those
            # of the bare module tree.
            with self.patcher.use_ejected():
                replace_inference_tensors(self.patcher.model.diffusion_model, self.patcher)
        # what the load moved to the device and the unload back left freed in the C heap: to the OS (Linux)
        os_compat.release_freed_host_memory()

    def release(self) -> None:
        """Unload the training clone and give cached device memory back (after a cancel or an error)."""
        self.patcher.eject_model()
        comfy.model_management.unload_model_and_clones(self.patcher)
        comfy.model_management.soft_empty_cache()


class TrainingRun:
    """One training run inside ComfyUI, the TRAINING_RUN value nodes pass along: a record, a placement and what it
    trains (`trained`: run_lora.LoraTraining or run_controlnet.ControlNetTraining), around the engine's Trainer.

    `config` is the kind's configuration dataclass (run_lora.LoraRunConfig, run_controlnet.ControlNetRunConfig:
    `to_json`, `train`, `optimizer`, `holdout`); `policy` an OffloadPolicy (None: everything resident), resolved
    with the Init nodes' checkpointing inputs by training/memory/policy.run_policy before it comes here.
    """

    precision_note = ""  # how the init node chose the compute precision (nodes/bridge/run_settings.resolve_precision)
    plan_note = ""  # the policy the planner chose for the policy's card (nodes/bridge/run_settings.resolve_policy)
    batch_note = ""  # why the run trains smaller batches than batch_size (nodes/bridge/run_settings.effective_batch)
    inputs_note = ""  # inputs the MODEL's class takes that the caches do not hold (comfy_model.missing_inputs_note)
    disk_note = ""  # its checkpoints at their peak need more than the disk has free (model_files.check_disk_room)
    # The planner's predicted s/step for this run (its card's plan, or the plan of its placement; None: no plan made),
    # recorded beside the measured one in the memory record (PhaseRecorder.step_time).
    predicted_s_per_step: float | None = None
    # The model as the run's plans measured it (planning.MeasuredModel: by its Init node's card plan, or its first
    # plan), so its later plans do not measure it again; None: not measured yet.
    measured = None
    load_seconds: float | None = None  # the last attach's ComfyUI load and placement (`attached`)

    @property
    def notes(self) -> list[str]:
        """What the node that opened the run tells the user about it (its UI text): precision, the policy fitted to
        the card, the disk's room for its checkpoints (and a save that removed the older one first to make room),
        the batch, inputs the model takes that the caches do not hold, what the strategy adds (a text encoder)."""
        trained = getattr(self.trained, "note", None)
        return [note for note in (self.precision_note, self.plan_note, self.disk_note, self.run_dir.room_note,
                                  self.batch_note, self.inputs_note, self.epoch_note,
                                  trained(self) if trained is not None else "") if note]

    @property
    def epoch_note(self) -> str:
        """How many steps an epoch takes, for those who count in epochs (kohya's max_train_epochs): the training
        items' batches (repeat folders counted), over the micro-steps a step takes and the share prior images take."""
        train = self.config.train
        steps = self.trainer.batches_per_epoch / (1.0 - train.prior_ratio) / train.grad_accum
        exact = abs(steps - round(steps)) < 1e-9
        count = f"{round(steps)}" if exact else f"about {steps:.1f}"
        return (f"an epoch (each training item once, repeat folders counted) is {count} step"
                f"{'' if exact and round(steps) == 1 else 's'}")
    _planned_base_share = _NOT_PLANNED  # _planned_shares: (training, validation), planned on the first load
    ranks = None  # a multi-device run's worker ranks (nodes/bridge/rank_workers.RankWorkers), told to train with rank 0

    def __init__(self, model, latent_cache, text_cache, config, trained, run_root: pathlib.Path, run_name: str,
                 policy: OffloadPolicy | None = None):
        if policy is not None and not isinstance(policy, OffloadPolicy):
            raise ValueError("policy must come from an Offload Policy (Headroom) or Memory Plan (Headroom) node")
        self.policy = policy if policy is not None else OffloadPolicy()
        Placement.free_shared_module(model)
        self.source_model, self.latent_cache, self.text_cache = model, latent_cache, text_cache
        self.config, self.trained = config, trained
        self.record = RunRecord(model, latent_cache, text_cache, {**trained.identity(self), "session": config.to_json()},
                                config.holdout, run_root, run_name)
        self.step_figures: dict[int, tuple] = {}  # step -> (lr, s/step, memory figures): for history()
        self.last_validation: dict | None = None  # {"step", "images", "grid"} of the last validation with images
        with torch.inference_mode(False):
            self.placement = Placement(model, self.policy)
            self.denoiser, trainable, options = trained.build(self)
            # (the captions the trainer reads: the text cache, or what the strategy reads in its place)
            self.trainer = Trainer(self.denoiser, trainable, latent_cache, options.pop("text_cache", text_cache),
                                   config.train, config.optimizer, train_items=self.train_items, run_dir=self.run_dir,
                                   policy=self.policy, **options)
        problem = inplace_depth_problem(self.denoiser.inplace_blocks,
                                        self.policy.checkpoint_depth if self.policy.checkpointing_enabled else None)
        if problem is not None:  # before anything runs (the trainer would refuse at its first step)
            raise ValueError(f"checkpoint_depth={self.policy.checkpoint_depth}: {problem}")
        with torch.inference_mode(False):
            self.resumed = self.trainer.resume()
        self.record.commit()
        self.fallback = FallbackWatch(self.run_dir.name, self.record.memory)  # the driver's sysmem fallback, said once
        # The curves as a TensorBoard log in the run folder (ranks > 0 of a run on several devices write none)
        self.scalar_log = ScalarLog(self.run_dir.path, self.step) if self.record.writes else None

    # --- the parts, by name ---------------------------------------------------------------------------------
    @property
    def trains(self) -> str:
        """What the run trains: a RUN_KINDS key ("lora", "controlnet")."""
        return self.trained.trains

    def trained_as(self, trains: str, node: str | None = None, action: str = "save"):
        """The run's strategy when it trains `trains`; otherwise a ValueError naming `node` (when given) and what
        to use instead for `action`."""
        if self.trains == trains:
            return self.trained
        what, wanted = RUN_KINDS[self.trains][0], RUN_KINDS[trains][0]
        if node is None:
            raise ValueError(f"run '{self.run_dir.name}' is a {what} run, not a {wanted} run")
        raise ValueError(f"{node}: run '{self.run_dir.name}' is a {what} run and this node takes {wanted} runs only; "
                         f"for a {what} run use {RUN_KINDS[self.trains][1][action]}")

    @property
    def adapters(self):
        """A LoRA run's adapter set (training/core/adapters.AdapterSet); a ControlNet run: ValueError."""
        return self.trained_as("lora").adapters

    @property
    def controlnet(self):
        """A ControlNet run's ControlNet (controlnet_build.TrainableControlNet); a LoRA run: ValueError."""
        return self.trained_as("controlnet").controlnet

    run_dir = property(lambda self: self.record.run_dir)
    fingerprint = property(lambda self: self.record.fingerprint)
    train_items = property(lambda self: self.record.train_items)
    validation_items = property(lambda self: self.record.validation_items)
    memory = property(lambda self: self.record.memory)
    patcher = property(lambda self: self.placement.patcher)
    low_bit_bytes = property(lambda self: self.placement.low_bit_bytes)

    @property
    def step(self) -> int:
        return self.trainer.step

    def phase(self, name: str):
        """Record one phase of the run (training, validation, save) in the run's memory record."""
        return self.record.phase(name)

    # --- on the device --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def attached(self, phase: str = "training"):
        """The training clone (and what the strategy loads with it) loaded through ComfyUI's model management,
        with what the run trains attached for the block (the strategy's `attach`). `phase` "validation": the base
        placed as the plan places it for validation (weight_streaming.validation_placement); the next training
        load puts training's placement back."""
        patchers, extra = self.trained.patchers(self), self.trained.device_extra_bytes(self.trainer)
        share = self._validation_device_share() if phase == "validation" else None
        started = time.perf_counter()
        if share is None:  # training, or a validation nothing was planned for (a CPU, no plan): training's placement
            whole = phase != "validation" and self._plan_streamer()
            self.placement.load(patchers, extra, self._base_device_share(), whole_blocks=whole)
            if phase != "validation":  # read after the load: it unpinned the blocks the streamer pins its own way
                self.trainer.stream_options["pin_limit_bytes"] = pinnable_host_bytes()
        else:
            own = base_placement(validation_placement(self.policy.base_placement))
            self.placement.load(patchers, extra, share, own)
        # ComfyUI's load with the placement's unload after it, each attach (the GPU kit records a Steps call's)
        self.load_seconds = time.perf_counter() - started
        base = self.placement.patcher.model.diffusion_model
        if phase == "validation":  # ComfyUI's sampler loads the clone again under inference mode
            quantized_weights_for_inference(base, self.placement.patcher)
        try:
            # ComfyUI's split / sub-quadratic attention chunks by free memory: a recompute must chunk as its forward
            # did.
            # --disable-pinned-memory: Headroom pins nothing either (pinned_host.py)
            with pinned_host.allowing(comfy_pins_host_memory()), self.trained.attach(self), \
                    pinned_reading(comfy.model_management, "get_free_memory"):
                yield
        finally:  # the MODEL's quantized weights usable by stock nodes again (a no-op for any other model)
            quantized_weights_for_inference(base, self.placement.patcher)
            self.release_cache_files()

    def release_cache_files(self) -> None:
        """No cache shard left mapped between calls: after each training or validation call, whatever it read
        (release_cache_files)."""
        release_cache_files(self.latent_cache, self.text_cache, *self.trained.caches())

    @contextlib.contextmanager
    def validating(self):
        """The model attached for validation, with the optimizer state and gradients parked in host RAM when the
        policy says so (restored bitwise after): validation then needs no more device memory than training."""
        with self.trainer.parked_for_validation(), self.attached("validation"):
            yield

    @contextlib.contextmanager
    def sampling_placement(self, model):
        """While ComfyUI's sampler samples `model` (a patcher of this run's base), the base keeps to validation's
        planned share: the sampler's own load would fill the device's free memory, past a budget below the card. Its
        load fills at most the share (`comfy_fills_at_most`), and a sampler wrapper (ComfyUI's patcher extension),
        acting after that load and before the first step, moves out what an earlier load left past it."""
        share = self._validation_device_share()
        if share is None:
            yield model
            return

        def keep_validation_share(executor, *args, **kwargs):
            keep_to_share(model, share)
            return executor(*args, **kwargs)

        model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.SAMPLER_SAMPLE, SAMPLING_PLACEMENT_KEY,
                                   keep_validation_share)
        try:
            with comfy_fills_at_most(model, share):
                yield model
        finally:
            model.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.SAMPLER_SAMPLE, SAMPLING_PLACEMENT_KEY)

    def sampling_model(self, lora_application: str = "unmerged", saved_dtype: str = "fp32"):
        """The ModelPatcher validation samples with, as the strategy makes it (a LoRA: `lora_application`, the file
        saved in `saved_dtype`)."""
        return self.trained.sampling_model(self, lora_application, saved_dtype)

    @contextlib.contextmanager
    def base_sampling_model(self):
        """The run's MODEL as it came in, without what the run trains, for before/after comparisons; optimizer
        state parked as for validation."""
        self.trained.check_detached(self)
        with self.trainer.parked_for_validation():
            yield self.source_model

    def prompt_clip(self, clip, lora_application: str = "as_saved_file", saved_dtype: str = "fp32"):
        """The CLIP validation encodes its prompts with (a context): `clip`, with the run's text encoder where it
        trains one (run_lora.LoraTraining.prompt_clip)."""
        own = getattr(self.trained, "prompt_clip", None)
        return own(self, clip, lora_application, saved_dtype) if own is not None else contextlib.nullcontext(clip)

    def sampling_conditioning(self, positive, negative, vae=None):
        """Validation conditioning for ComfyUI's samplers: the prompts as encoded, with what the strategy adds."""
        return self.trained.sampling_conditioning(self, positive, negative, vae)

    def metadata(self) -> dict:
        """What the run's saved file says about it (the strategy's metadata)."""
        return self.trained.metadata(self)

    def release(self) -> None:
        """Unload the training clone and give cached device memory back (after a cancel or an error)."""
        self.placement.release()

    # --- training -------------------------------------------------------------------------------------------
    def train_to(self, target_step: int, node_id: str | None = None, checkpoint_every: int = 0,
                 checkpoint_minutes: float = 0.0) -> None:
        """Train to `target_step`, with a progress bar, step events and cancel (checkpoint, free, re-raise); a
        checkpoint every `checkpoint_every` steps and `checkpoint_minutes` minutes (0: off), and at the end."""
        self.run_dir.check_present()
        if target_step <= self.step:
            if self.step > 0 and self.trainer.saved_step != self.step:
                # An earlier save failed (e.g. disk full): "trained to N" is not done until step N is on disk.
                with self.phase("save"):
                    self.trainer.save()
            return
        if self.ranks is not None:
            self.ranks.train(target_step, checkpoint_every, checkpoint_minutes)
        if self.trainer.parallel is not None:
            self.trainer.parallel.others_know = False  # this command's stop (if any) is not told yet
        start_step = self.step
        progress = comfy.utils.ProgressBar(target_step - start_step, node_id=node_id)
        started = time.perf_counter()
        device = self.denoiser.device
        self.fallback.start()
        step_seconds: list[float] = []

        def after_step(report: StepReport) -> None:
            per_step = (time.perf_counter() - started) / (report.step - start_step)
            step_seconds.append(report.seconds)
            # The measured s/step beside the plan's prediction: the median after the first step (its warm-up).
            timed = step_seconds[1:] or step_seconds
            self.memory.record_step_time(self.predicted_s_per_step, statistics.median(timed), len(timed))
            progress.update_absolute(report.step - start_step)
            figures = memory_figures(device)
            self.step_figures[report.step] = (report.lr, per_step, figures)
            warning = self.fallback.after_step(report.step)
            if self.scalar_log is not None:
                self.scalar_log.scalars(report.step, {
                    "loss/train": report.loss, "learning_rate": report.lr, "time/s_per_step": report.seconds,
                    **{f"memory/{key}_gib": None if figures[key] is None else figures[key] / 2**30
                       for key in ("peak", "reserved", "rss")}})
            send_event(STEP_EVENT, {
                "node": node_id, "run": self.run_dir.name, "step": report.step, "total_steps": target_step,
                "loss": report.loss,
                "lr": report.lr, "s_per_step": per_step, "eta_s": per_step * (target_step - report.step),
                **figures, **({"warning": warning} if warning else {}),  # the driver's fallback, once
            })
            comfy.model_management.throw_exception_if_processing_interrupted()

        try:
            with self.phase("training"), self.attached(), training_code_paths():
                self.trainer.train_to(target_step, after_step=after_step, checkpoint_every=checkpoint_every,
                                      checkpoint_seconds=checkpoint_minutes * 60)
        except BaseException as error:
            # Cancel (InterruptProcessingException), out of memory, non-finite loss...: keep the last
            # completed step on disk and give the device memory back before the node exits.
            if self.trainer.parallel is not None and self.step < target_step:
                self.trainer.leave_between_steps()  # e.g. loading the model failed: the other ranks wait in a step
            worker_error = self.ranks.settle(self.step) if self.ranks is not None else None  # bounded wait
            self.fail("training step", error)
            if isinstance(error, comfy.model_management.InterruptProcessingException):
                # A cancel is no failure: the editor says where the run stopped and that Run continues it.
                send_event(STOPPED_EVENT, {"node": node_id, "run": self.run_dir.name, "step": self.step,
                                           "total_steps": target_step, "saved": self.trainer.saved_step == self.step})
            if worker_error is not None:
                raise RuntimeError(worker_error) from error
            raise
        self.trainer.save()

    def fail(self, phase: str, error: BaseException) -> None:
        """After an error in `phase`: last completed step saved, device memory freed; an out-of-memory error is
        raised again as one that names the phase, the measured peak and the planner's next policy."""
        def save_if_needed():
            if self.trainer.saved_step != self.step and self.trainer.can_save and self.run_dir.present():
                self.trainer.save()

        if is_out_of_memory(error):
            raise out_of_memory(phase, error, self.denoiser.device, save_checkpoint=save_if_needed,
                                free_memory=self.release, next_plan=self._next_plan) from None
        try:
            if not isinstance(error, (WriteError, RunFolderError)):  # after those a retry would fail the same way
                save_if_needed()  # a failure here (disk full on cancel) is raised instead: nothing was saved
        finally:
            self.release()

    def _base_device_share(self) -> int | None:
        """For "partial" placement on a device: the bytes of the base the run's plan keeps there in a training step
        (planned once, on the first load; None elsewhere, or when the plan cannot be made: then ComfyUI's own choice
        stands)."""
        if self.policy.base_placement != "partial":
            return None
        return self._planned_shares()[0]

    def _validation_device_share(self) -> int | None:
        """The same for validation, placed on its own: "partial" and "streamed" keep what fits beside sampling
        (planner.Plan.validation_base_device_bytes); "resident" loads everything."""
        if validation_placement(self.policy.base_placement) != "partial":
            return None
        return self._planned_shares()[1]

    def _plan_streamer(self) -> bool:
        """On a device, with blocks streamed: the streamer set up as the run's plan places the base (its resident
        whole blocks, the non-block layers kept on the device, its ring's slots). False where no plan was made (a
        CPU, or the plan failed: ComfyUI's own partial placement stands, the streamer brings what it left in host
        RAM). A full fine-tune, whatever its placement: its trained layers' base weights (never read by the step) stay
        in host RAM, the streamer bringing the rest as the plan places it (resident: every other weight kept)."""
        unread = self.trained.unread_base_layers()
        if not (self.policy.streams_blocks or unread):
            return False
        self._planned_shares()
        planned = getattr(self, "_planned_blocks", None)
        if planned is None:
            self.trainer.stream_options = {}
            return False
        resident, slots = planned
        self.trainer.stream_options = {"resident": resident, "slots": slots,
                                       "keep": [self.placement.patcher.model.diffusion_model], "unread": unread}
        return True

    def _planned_shares(self) -> tuple[int | None, int | None]:
        """(training, validation) shares of the base on the device from the run's plan, planned once; (None, None)
        on a CPU or when the plan cannot be made."""
        patcher = self.placement.patcher
        if patcher.load_device == patcher.offload_device:
            return None, None
        if self._planned_base_share is _NOT_PLANNED:
            try:
                plan = run_plan(self)
                self._planned_base_share = (plan.base_device_bytes, plan.validation_base_device_bytes)
                self._planned_blocks = (tuple(plan.resident_blocks), plan.stream_slots)
                if self.predicted_s_per_step is None:
                    self.predicted_s_per_step = plan.predicted_s_per_step
            except Exception as error:  # the plan is advice for the load, not a reason to stop the run
                logging.warning("Headroom: run '%s': no memory plan for its placement (%s); ComfyUI places the base",
                                self.run_dir.name, error)
                self._planned_base_share = (None, None)
        return self._planned_base_share

    def _next_plan(self):
        """The planner's next smaller policy for this run (None when it cannot tell)."""
        try:
            return next_plan_for(self)
        except Exception:  # the error being reported is the out-of-memory one
            return None

    # --- validation loss, history, weights ------------------------------------------------------------------
    def loss_on(self, items, times: int = 4, seed: int = 0) -> float:
        """The deterministic loss (fixed noise levels and noise) on cached items, with the current weights."""
        with self.validating(), training_code_paths():  # the training step's function, on held-out items
            return self.trainer.validation_loss(items, times=times, seed=seed)

    def validation_loss(self, times: int = 4, seed: int = 0, weights: str = "auto") -> float:
        """The deterministic validation loss on the validation items (of the trained or the EMA weights), recorded
        in the run's history (and saved with the checkpoint of this step, so a resumed run has it too)."""
        with self.weights(weights):
            value = self.loss_on(self.validation_items, times=times, seed=seed)
        self.trainer.record_validation(value)  # the checkpoint holds the trained weights, never the EMA swapped in
        if self.scalar_log is not None:
            self.scalar_log.scalars(self.step, {"loss/validation": value})
        self.trainer.save()
        return value

    def history(self, total_steps: int | None = None) -> dict:
        """The run's curves, as the training nodes' `headroom_history` UI output (the live view redraws from it)."""
        losses, validations = self.trainer.loss_history, self.trainer.validation_history
        entry = {
            "run": self.run_dir.name, "total_steps": total_steps if total_steps is not None else self.step,
            "steps": [int(s) for s, _ in losses], "loss": [float(v) for _, v in losses],
            "val_steps": [int(s) for s, _ in validations], "val_loss": [float(v) for _, v in validations],
        }
        entry.update(history_extras([self.step_figures.get(int(s)) for s, _ in losses], self.last_validation))
        return entry

    def resolve_weights(self, choice: str) -> str:
        """"trained" or "ema" for a Validate / Save `weights` choice (auto: the EMA when the run keeps one)."""
        if choice not in WEIGHT_CHOICES:
            raise ValueError(f"weights={choice!r}: choose one of {', '.join(WEIGHT_CHOICES)}")
        if choice == "ema" and self.trainer.ema is None:
            raise ValueError(f"weights=ema: run '{self.run_dir.name}' keeps no EMA; set ema_decay on its Init node "
                             "(with a new run name: it changes the run)")
        return "ema" if choice != "trained" and self.trainer.ema is not None else "trained"

    @contextlib.contextmanager
    def weights(self, choice: str = "auto"):
        """Inside the block the run's trainable weights are the trained ones or their EMA; yields which."""
        if self.resolve_weights(choice) == "trained":
            yield "trained"
            return
        with self.trainer.ema.swapped_in(self.trainer.params):
            yield "ema"

    def __repr__(self) -> str:
        return f"TrainingRun({self.run_dir.name}, step {self.step}, {self.trained.describe(self)})"
