"""The bridge between the engine (training/) and ComfyUI's model objects.

- The MODEL as the engine sees it (family, blocks, conditioning widths, fingerprints, `ComfyDenoiser`):
  nodes/comfy_model.py; the planner's description of it and the budget: nodes/planning.py.
- Adapters go onto a *clone* of the MODEL through ModelPatcher injections: ComfyUI attaches them when it
  loads the clone and takes them off when it unloads it (or loads another clone of the same weights),
  so the module other nodes share never keeps an adapter and its weights are never written.
- `TrainingSession` is the TRAINING_RUN value: clone + adapters + trainer + run directory.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import sys
import time

import torch

import comfy.float
import comfy.lora
import comfy.model_management
import comfy.model_patcher
import comfy.patcher_extension
import comfy.utils

from ..training.adapters import ADAPTER_LAYERS, AdapterConfig, AdapterSet
from ..training.checkpointing import inplace_depth_problem
from ..training.lowbit import LowBitBase, LowBitLinear
from ..training.memory_stats import PhaseRecorder, process_rss_bytes
from ..training.oom import is_out_of_memory, out_of_memory
from ..training.optimizers import OptimizerConfig
from ..training.policy import OffloadPolicy
from ..training.files import WriteError, open_regular
from ..training.run_dir import RunDir, RunFolderError
from ..training.trainer import StepReport, TrainConfig, Trainer
from . import families
from .comfy_model import (ComfyDenoiser, base_fingerprint, check_caches, data_fingerprint, model_blocks,
                          replace_inference_tensors, training_blocks)
from .lora_formats import read_lora_file
from .planning import next_plan_for

INJECTION_KEY = "headroom_adapter"
STEP_EVENT = "headroom.train.step"  # read by js/headroom_live.js and workflows/headroom_run.py
VALIDATE_EVENT = "headroom.validate"
# How validation applies a LoRA run's adapter: what the stock loader makes of the saved file, or computed beside the
# frozen weights (TrainingSession.sampling_model).
LORA_APPLICATIONS = ("as_saved_file", "unmerged")
# Settings added after runs were first stored: a run folder without them trained with these values and resumes.
CONFIG_ADDED_LATER = {"session.train.objective.loss_type": "mse", "session.train.objective.huber_delta": 0.1,
                      "session.train.ema_decay": 0.0, "session.train.prior_ratio": 0.0}
# Stored values an earlier version wrote for what is now named otherwise: an SD2 model's family was sd15 before
# nodes/families/sd2.py, a Chroma model's flux before chroma.py; the presets train the same layers, so such runs resume.
CONFIG_RENAMED = {"session.family": {"sd2": "sd15", "chroma": "flux"}}
# Which weights Validate / Save use: auto = the EMA when the run keeps one (TrainingSession.weights).
WEIGHT_CHOICES = ("auto", "trained", "ema")


# --- adapters on a clone ----------------------------------------------------------------------------------
def attach_with_injection(patcher, adapters: AdapterSet) -> None:
    """Make ComfyUI attach `adapters` whenever it loads `patcher` (a clone), and detach on unload."""

    def inject(mp):
        root = mp.model.diffusion_model
        # The load device, where ComfyUI computes (weights of a partially loaded model are cast there too).
        adapters.to(mp.load_device)
        if adapters.attached_to is not root:
            adapters.detach()
            adapters.attach(root)

    def eject(mp):
        adapters.detach()

    patcher.set_injections(INJECTION_KEY, [comfy.patcher_extension.PatcherInjection(inject=inject, eject=eject)])


def comfy_patches(patcher, adapters: AdapterSet) -> dict:
    """The adapter as ComfyUI weight patches, through the stock LoRA loading path."""
    key_map = comfy.lora.model_lora_keys_unet(patcher.model, {})
    return comfy.lora.load_lora(adapters.comfy_state_dict(), key_map, log_missing=True)


class AsSavedWeight:
    """A ComfyUI weight wrapper that gives a layer the weight the stock LoraLoader bakes from the saved file, made
    when the layer runs and dropped after it.

    Why by hand: stock ComfyUI bakes the patches into every weight at load (ModelPatcher.patch_weight_to_device),
    which holds a second copy of all patched weights while the clone is loaded (the originals as its backup): the
    validation that was meant to share the training weights would need twice their memory. This repeats the same
    arithmetic one layer at a time: the weight in ComfyUI's LoRA compute dtype, comfy.lora.calculate_weight, then
    rounded to the dtype the weight is stored in (comfy.float.stochastic_rounding, seeded by the key as stock does),
    then to the dtype the layer computes in. Bit for bit what stock gives wherever the compute dtype holds the stored
    dtype exactly (bf16 / fp16 / fp8 stored, fp32 or bf16 compute: every CPU and the usual GPU set-ups).
    """

    def __init__(self, key: str, patches: list, stored_dtype: torch.dtype):
        self.key, self.patches, self.stored_dtype = key, patches, stored_dtype
        self.seed = comfy.utils.string_to_seed(key)

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        # `weight` is already this forward's own copy (ComfyUI casts with copy=True for layers with weight functions)
        merged = weight.to(comfy.model_management.lora_compute_dtype(weight.device))
        merged = comfy.lora.calculate_weight(self.patches, merged, self.key)
        return comfy.float.stochastic_rounding(merged, self.stored_dtype, seed=self.seed).to(weight.dtype)


def as_saved_file_model(model, adapters: AdapterSet, strength: float = 1.0):
    """A clone of `model` that samples as if the stock LoraLoader had loaded the adapter's saved file at `strength`,
    without baking it into a second copy of the weights: one AsSavedWeight per patched weight (ComfyUI's own
    weight-wrapper hook, installed on the layers when ComfyUI loads the clone)."""
    clone = model.clone()
    patched = model.clone()  # never loaded: only collects the patches as the stock loader lays them out
    patched.patches = {}
    patched.add_patches(comfy_patches(patched, adapters), strength)
    for key, patches in patched.patches.items():
        stored, _, _ = comfy.model_patcher.get_key_weight(clone.model, key)
        clone.add_weight_wrapper(key, AsSavedWeight(key, patches, stored.dtype))
    return clone


# --- progress and events ----------------------------------------------------------------------------------
def send_event(event: str, data: dict) -> None:
    """A websocket event when a ComfyUI server is running in this process (nothing otherwise)."""
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is not None:
        # Sent to every client: the prompt id lets an editor tell its own prompts from others' (js/headroom_live.js).
        instance.send_sync(event, {"prompt_id": getattr(instance, "last_prompt_id", None), **data})


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
_RUN_IDENTITY: dict[str, tuple | None] = {}  # run folder -> its config.json as the last session here opened it
_RUN_GENERATION: dict[str, int] = {}


def run_generation(run_root: pathlib.Path, run_name: str) -> int:
    """The Init nodes' fingerprint: it changes when a run folder a session of this process opened was deleted or
    replaced since, so ComfyUI runs Init again (a new session, which starts anew in the folder, with its
    config.json) instead of handing on its cached session, whose every write would now fail (RunFolderError)."""
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


@dataclasses.dataclass
class SessionConfig:
    family: str | None
    adapter: AdapterConfig
    optimizer: OptimizerConfig
    train: TrainConfig
    holdout: int  # last N cached items held out for the validation loss (0: validate on the training items)

    def to_json(self) -> dict:
        return config_json(self)


# What a run trains -> (its name in messages, the nodes that take only such runs: display names for messages).
RUN_KINDS = {
    "lora": ("LoRA", {"save": "Save LoRA (Headroom)",
                      "apply": "Apply Trained LoRA (Headroom) on the MODEL, or Save LoRA (Headroom) and the stock "
                               "Load LoRA"}),
    "controlnet": ("ControlNet", {"save": "Save ControlNet (Headroom)",
                                  "apply": "the control_net output of its Init / Train ControlNet node with the stock "
                                           "Apply ControlNet"}),
}


def check_run_kind(run, trains: str, node: str, action: str) -> None:
    """A node that takes only LoRA runs (or only ControlNet runs) given another run: a ValueError that names the
    node to use instead for `action` ("save" / "apply")."""
    if not isinstance(run, TrainingSession):
        raise ValueError(  # noqa: TRY004 - an input error, as ComfyUI reports them
            f"{node}: the run input must be a TRAINING_RUN from a Headroom Init or training node, "
            f"not {type(run).__name__}")
    if run.trains != trains:
        what, instead = RUN_KINDS[run.trains][0], RUN_KINDS[run.trains][1][action]
        raise ValueError(f"{node}: run '{run.run_dir.name}' is a {what} run and this node takes {RUN_KINDS[trains][0]} "
                         f"runs only; for a {what} run use {instead}")


class TrainingSession:
    """Everything of one training run inside ComfyUI: the TRAINING_RUN value nodes pass along."""

    trains = "lora"  # what the run trains: a RUN_KINDS key
    precision_note = ""  # how the init node chose the compute precision (nodes/train_lora.py resolve_precision)

    def __init__(self, model, latent_cache, text_cache, config: SessionConfig, run_root: pathlib.Path, run_name: str,
                 policy: OffloadPolicy | None = None, prior: tuple | None = None):
        prior_identity = {}
        if prior is not None:  # prior (regularisation) images: part of what the run is, so part of its config
            check_caches(model.model, *prior)
            prior_identity = {"prior_latent_cache": getattr(prior[0], "fingerprint", None),
                              "prior_text_cache": getattr(prior[1], "fingerprint", None),
                              "prior_data": data_fingerprint(prior[0])}
        stored = self._open_run(model, latent_cache, text_cache, config, run_root, run_name, policy, prior_identity)
        with torch.inference_mode(False):
            # A classic ModelPatcher even under dynamic VRAM: autograd keeps the weights a layer used until backward,
            # which aimdo-managed weights do not guarantee (docs/MEMORY.md). Elsewhere this is a plain clone.
            self.patcher = model.clone(disable_dynamic=True)
            diffusion_model = self.patcher.model.diffusion_model
            low_bit = self._low_bit_base(policy)  # the adapters are built on the low-bit layers they will wrap
            try:
                paths = families.lora_targets(diffusion_model, config.family, config.adapter,
                                              [n for n, _ in model_blocks(diffusion_model)])
                self.adapters = AdapterSet(diffusion_model, paths, config.adapter)
            finally:  # the shared module is full precision again even when building the adapters failed
                self._load_in_low_bit(low_bit)
            if config.adapter.init_lora:  # a resumed run's checkpoint replaces these below (_finish_open)
                self.adapters.start_from(read_lora_file(model, config.adapter.init_lora, config.adapter.kind),
                                         f"LoRA file {config.adapter.init_lora}")
            # Small: lives on the compute device from the start, so resumed optimizer state lands there too.
            self.adapters.to(self.patcher.load_device)
            attach_with_injection(self.patcher, self.adapters)
            self.denoiser = ComfyDenoiser(self.patcher)
            trainer = Trainer(self.denoiser, self.adapters, latent_cache, text_cache, config.train, config.optimizer,
                              train_items=self.train_items, run_dir=self.run_dir, policy=policy, prior=prior)
        self._finish_open(trainer, stored)

    # --- shared by every kind of run (LoRA here, ControlNet in nodes/train_controlnet.py) ---------------------
    def _open_run(self, model, latent_cache, text_cache, config, run_root, run_name, policy, kind: dict) -> dict:
        """The run directory (checked against this configuration), the holdout split and the memory record."""
        if policy is not None and not isinstance(policy, OffloadPolicy):
            raise ValueError("policy must come from a HeadroomOffloadPolicy or HeadroomMemoryPlan node")
        if any(isinstance(m, (*ADAPTER_LAYERS, LowBitLinear)) for m in model.model.diffusion_model.modules()):
            # A previous run's clone is loaded with its adapter or low-bit layers in this shared module: unload it.
            comfy.model_management.unload_model_and_clones(model)
        self.source_model = model
        self.latent_cache, self.text_cache = latent_cache, text_cache
        self.config = config
        self.policy = policy
        self.run_dir = RunDir(run_root, run_name)
        self.run_dir.prune_temp()  # what a killed writer left: temp checkpoint folders, temp files
        self.fingerprint = base_fingerprint(model)
        stored = {
            **kind, "session": config.to_json(), "base_fingerprint": self.fingerprint,
            "latent_cache": getattr(latent_cache, "fingerprint", None), "text_cache": getattr(text_cache, "fingerprint", None),
            "data": data_fingerprint(latent_cache),
        }
        self.run_dir.check_compatible(stored, added_later=CONFIG_ADDED_LATER, renamed=CONFIG_RENAMED)
        count = len(latent_cache)
        if config.holdout >= count:
            raise ValueError(f"holdout={config.holdout} leaves no training items of the {count} cached")
        self.train_items = list(range(count - config.holdout))
        self.validation_items = list(range(count - config.holdout, count)) if config.holdout else list(self.train_items)
        self.memory = self._memory_record(torch.device(model.load_device))
        self.step_figures: dict[int, tuple] = {}  # step -> (lr, s/step, memory figures): for history()
        self.last_validation: dict | None = None  # {"step", "images"} of the last validation with images
        return stored

    def _finish_open(self, trainer: Trainer, stored: dict) -> None:
        policy = trainer.policy
        problem = inplace_depth_problem(self.denoiser.inplace_blocks,
                                        policy.checkpoint_depth if policy.checkpointing_enabled else None)
        if problem is not None:  # before anything runs (the trainer would refuse at its first step)
            raise ValueError(f"checkpoint_depth={policy.checkpoint_depth}: {problem}")
        self.trainer = trainer
        with torch.inference_mode(False):
            self.resumed = trainer.resume()
        if not self.run_dir.exists():
            self.run_dir.write_config(stored)
        _RUN_IDENTITY[str(self.run_dir.path)] = RunDir.config_identity(self.run_dir.path)

    def _low_bit_base(self, policy: OffloadPolicy | None) -> LowBitBase | None:
        """policy base_storage fp8 / int8 / nf4: low-bit copies of the frozen Linear layers of the blocks, swapped
        into the (shared) module for now; `_load_in_low_bit` hands them to ComfyUI."""
        if policy is None or policy.base_storage == "as_loaded":
            return None
        blocks = [name for name, _ in model_blocks(self.patcher.model.diffusion_model)]
        patched = sorted(key for key in self.patcher.patches
                         if any(key.startswith(f"diffusion_model.{block}.") for block in blocks))
        if patched:
            raise ValueError(f"base_storage={policy.base_storage!r}: the MODEL carries weight patches (a LoRA loaded "
                             f"before training, e.g. {patched[0]}) that a low-bit copy would drop: train on the model "
                             "without them, or use base_storage 'as_loaded'")
        return LowBitBase(self.patcher.model.diffusion_model, policy.base_storage, self.patcher.offload_device,
                          prefixes=blocks)

    def _load_in_low_bit(self, low_bit: LowBitBase | None) -> None:
        """The shared module gets its full-precision layers back, and ComfyUI swaps the low-bit ones in as object
        patches of the training clone: set before it moves weights to the device (so the full-precision block
        weights stay in host RAM) and restored when it unloads the clone."""
        self.low_bit_bytes = None if low_bit is None else (low_bit.packed_bytes(), low_bit.original_bytes())
        if low_bit is None:
            return
        low_bit.detach()
        for path, layer in low_bit.replacements.items():
            self.patcher.add_object_patch(f"diffusion_model.{path}", layer)

    def _memory_record(self, device: torch.device) -> PhaseRecorder:
        """The run's per-phase memory record: continued from the run directory (a resumed run), or started with
        how its caches were built."""
        path = self.run_dir.memory_record_path
        if os.path.lexists(path):
            try:  # a regular file of the run (not a symlink), of a sane size
                with open_regular(path, "memory record", max_bytes=16 << 20) as handle:
                    return PhaseRecorder(device, phases=PhaseRecorder.from_json(handle.read().decode("utf-8")).phases)
            except (ValueError, OSError) as error:  # a report, not training state: start a new one
                logging.warning("Headroom: ignoring the unreadable memory record of run '%s' (%s); starting a new "
                                "one", self.run_dir.name, error)
        cached = [*getattr(self.latent_cache, "memory_phases", []), *getattr(self.text_cache, "memory_phases", [])]
        return PhaseRecorder(device, phases=[dict(phase) for phase in cached])

    @contextlib.contextmanager
    def phase(self, name: str):
        """Record one phase of the run (training, validation, save) in the run's memory record, on disk after it."""
        try:
            with self.memory.phase(name):
                yield
        finally:
            if self.run_dir.present():  # a vanished run folder is not re-created for a report
                try:
                    self.run_dir.write_file_json(self.run_dir.memory_record_path, self.memory.as_dict(),
                                                 f"memory record of run '{self.run_dir.name}'")
                except WriteError as error:  # a report, not training state: the checkpoint's own error matters
                    logging.warning("Headroom: %s", error)

    @property
    def step(self) -> int:
        return self.trainer.step

    def _device_extra_bytes(self) -> int:
        """What the run adds on the device beyond the MODEL's weights (for ComfyUI's memory accounting):
        the trainable weights and gradients, and the optimizer's two moments where they live on the device."""
        trainable = sum(p.numel() * p.element_size() for p in self.trainer.params)
        return trainable * (2 if self.trainer.policy.optimizer_state == "cpu" else 4)

    def _load(self, patchers) -> None:
        """Load the training patchers through ComfyUI's model management, as the policy places the frozen base."""
        placement = self.trainer.policy.base_placement
        with torch.inference_mode(False):  # weights copied to the device here are then usable by autograd
            # "partial" / "streamed": ComfyUI may keep part of the base in host RAM (its lowvram load); the
            # trainer's WeightStreamer brings those blocks to the device one block ahead.
            comfy.model_management.load_models_gpu(patchers, memory_required=self._device_extra_bytes(),
                                                   force_full_load=placement == "resident")
            if placement == "streamed" and self.patcher.load_device != self.patcher.offload_device:
                # Every block's frozen weights back to host RAM through ComfyUI's own partial unload, so its
                # accounting stays right; non-block weights (embedders, final layers) stay resident.
                blocks = [block for _, block in training_blocks(self.patcher.model.diffusion_model)]
                block_bytes = sum(t.numel() * t.element_size() for block in blocks
                                  for t in [*block.parameters(), *block.buffers()] if not t.requires_grad)
                self.patcher.partially_unload(self.patcher.offload_device, memory_to_free=block_bytes)
            replace_inference_tensors(self.patcher.model.diffusion_model)

    @contextlib.contextmanager
    def attached(self):
        """The training clone loaded through ComfyUI's model management, with the adapters attached.

        Outside this block the adapters are ejected again, even though the clone may stay loaded: the
        module tree other nodes share (stock LoraLoader, KSampler on the MODEL) is then exactly ComfyUI's.
        """
        self._load([self.patcher])
        self.patcher.inject_model()  # a no-op when the load just injected; needed when the clone stayed loaded
        if self.adapters.attached_to is not self.patcher.model.diffusion_model:
            raise RuntimeError("HeadroomTrainLora: ComfyUI did not attach the adapter to the loaded model")
        try:
            yield
        finally:
            self.patcher.eject_model()

    @contextlib.contextmanager
    def validating(self):
        """The model attached for validation, with the optimizer state and gradients parked in host RAM when the
        policy says so (restored bitwise after): validation then needs no more device memory than training."""
        with self.trainer.parked_for_validation(), self.attached():
            yield

    @contextlib.contextmanager
    def sampling_model(self, lora_application: str = "unmerged"):
        """The ModelPatcher validation samples with. "unmerged": the training clone with the adapter attached (its
        low-bit base too), computing the LoRA next to the frozen weights. "as_saved_file": what the stock LoraLoader
        makes of the saved (fp32) file: a clone of the run's MODEL with the adapter as ComfyUI weight patches, baked
        into the weights in their own dtype (comfy.lora + stochastic rounding) when ComfyUI loads the clone.
        Either way the optimizer state is parked as the policy says."""
        if lora_application not in LORA_APPLICATIONS:
            raise ValueError(f"lora_application={lora_application!r}: choose one of {', '.join(LORA_APPLICATIONS)}")
        if lora_application == "unmerged":
            with self.validating():
                yield self.patcher
            return
        with self.trainer.parked_for_validation():
            model = as_saved_file_model(self.source_model, self.adapters)
            try:
                yield model
            finally:  # the patched weights leave memory now, not when gc finds the clone
                comfy.model_management.unload_model_and_clones(model, unload_additional_models=False)

    @contextlib.contextmanager
    def base_sampling_model(self):
        """The run's MODEL as it came in, without what the run trains (outside `attached` the adapters are ejected:
        the module tree is ComfyUI's own), for before/after comparisons; optimizer state parked as for validation."""
        adapters = getattr(self, "adapters", None)
        if adapters is not None and adapters.attached_to is not None:
            raise RuntimeError("HeadroomValidate: the adapter is still attached; cannot sample the base model")
        with self.trainer.parked_for_validation():
            yield self.source_model

    def sampling_conditioning(self, positive, negative, vae=None):
        """Validation conditioning for ComfyUI's samplers: the prompts as encoded (a ControlNet run adds its control)."""
        return positive, negative

    def release(self) -> None:
        """Unload the training clone and give cached device memory back (after a cancel or an error)."""
        self.patcher.eject_model()
        comfy.model_management.unload_model_and_clones(self.patcher)
        comfy.model_management.soft_empty_cache()

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
        start_step = self.step
        progress = comfy.utils.ProgressBar(target_step - start_step, node_id=node_id)
        started = time.perf_counter()
        device = self.denoiser.device

        def after_step(report: StepReport) -> None:
            per_step = (time.perf_counter() - started) / (report.step - start_step)
            progress.update_absolute(report.step - start_step)
            figures = memory_figures(device)
            self.step_figures[report.step] = (report.lr, per_step, figures)
            send_event(STEP_EVENT, {
                "node": node_id, "run": self.run_dir.name, "step": report.step, "total_steps": target_step,
                "loss": report.loss,
                "lr": report.lr, "s_per_step": per_step, "eta_s": per_step * (target_step - report.step),
                **figures,
            })
            comfy.model_management.throw_exception_if_processing_interrupted()

        try:
            with self.phase("training"), self.attached():
                comfy.model_management.in_training = True
                try:
                    self.trainer.train_to(target_step, after_step=after_step, checkpoint_every=checkpoint_every,
                                          checkpoint_seconds=checkpoint_minutes * 60)
                finally:
                    comfy.model_management.in_training = False
        except BaseException as error:
            # Cancel (InterruptProcessingException), out of memory, non-finite loss...: keep the last
            # completed step on disk and give the device memory back before the node exits.
            self.fail("training step", error)
            raise
        self.trainer.save()

    def fail(self, phase: str, error: BaseException) -> None:
        """After an error in `phase`: last completed step saved, device memory freed; an out-of-memory error is
        raised again as one that names the phase, the measured peak and the planner's next policy."""
        def save_if_needed():
            if self.trainer.saved_step != self.step and self.trainer.params_finite() and self.run_dir.present():
                self.trainer.save()

        if is_out_of_memory(error):
            raise out_of_memory(phase, error, self.denoiser.device, save_checkpoint=save_if_needed,
                                free_memory=self.release, next_plan=self._next_plan) from None
        try:
            if not isinstance(error, (WriteError, RunFolderError)):  # after those a retry would fail the same way
                save_if_needed()  # a failure here (disk full on cancel) is raised instead: nothing was saved
        finally:
            self.release()

    def _next_plan(self):
        """The planner's next smaller policy for this run (None when it cannot tell)."""
        try:
            return next_plan_for(self)
        except Exception:  # the error being reported is the out-of-memory one
            return None

    def loss_on(self, items, times: int = 4, seed: int = 0) -> float:
        """The deterministic loss (fixed noise levels and noise) on cached items, with the current adapter."""
        with self.validating():
            return self.trainer.validation_loss(items, times=times, seed=seed)

    def validation_loss(self, times: int = 4, seed: int = 0, weights: str = "auto") -> float:
        """The deterministic validation loss on the validation items (of the trained or the EMA weights), recorded
        in the run's history (and saved with the checkpoint of this step, so a resumed run has it too)."""
        with self.weights(weights):
            value = self.loss_on(self.validation_items, times=times, seed=seed)
        self.trainer.record_validation(value)  # the checkpoint holds the trained weights, never the EMA swapped in
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

    def patched_model(self, model=None, strength: float = 1.0):
        """A clone of `model` (default: the MODEL the run trains) with the current adapter as weight patches."""
        model = model if model is not None else self.source_model
        clone = model.clone()
        clone.add_patches(comfy_patches(clone, self.adapters), strength)
        return clone

    def lora_metadata(self) -> dict[str, str]:
        return {
            "headroom.format": "comfyui-lora", "headroom.base_fingerprint": self.fingerprint,
            "headroom.family": str(self.config.family), "headroom.kind": self.config.adapter.kind,
            "headroom.rank": str(self.config.adapter.rank), "headroom.alpha": str(self.config.adapter.alpha),
            "headroom.steps": str(self.step), "headroom.run": self.run_dir.name,
            "headroom.config": json.dumps(self.config.to_json(), sort_keys=True),
        }

    def __repr__(self) -> str:
        return f"TrainingRun({self.run_dir.name}, step {self.step}, {self.config.adapter.kind} r{self.config.adapter.rank})"
