"""The training loop: one readable step over cached batches.

    batch  = cached latents + cached conditioning of one bucket (caption dropout -> the empty prompt)
    sigma, noise = objective.sample(...)            seeded by (run seed, micro-step)
    x_t, target = objective.perturbed(x0, noise, sigma, extra)   x_t (ip_noise_gamma: noised a little more), x0
    x0_hat = denoiser.predict(x_t, sigma, conds)    under autocast for bf16 / fp16
    loss   = objective.loss(x0_hat, target, sigma)  native eps / v / flow space, optional min-SNR / debiased
    backward (scaled for fp16) ... every `grad_accum` micro-steps: unscale, clip, optimizer + LR step

The batch, caption dropout, noise levels and noise of a micro-step come from a generator seeded by (seed,
micro-step), the tag order of each item's caption (a text cache with tag shuffling) from one of its own; what
draws from torch's global RNG (peft's dropout) runs on the run's own saved copy of it.
So a run depends only on its seed, and one resumed from its run directory draws exactly what the straight
run drew. The model is reached only through the small `Denoiser` protocol below; ComfyUI's MODEL
implements it in nodes/bridge/comfy_bridge.py, and unit tests drive the engine with a tiny plain-torch denoiser.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Callable, Protocol, Sequence

import torch

from .. import public_module
from ..data.cache_store import bucket_batches, item_conditioning
from ..checks import check_finite
from .objective import Objective, ObjectiveConfig, SamplingDescriptor, step_seed
from ..memory import sharded_optimizer, sharded_weights
from ..memory.fused_backward import FusedBackward
from ..memory import trained_weights_on_host
from ..memory.optimizer_parking import HostOptimizer, parked
from ..gradient_clipping import clip_gradients
from .optimizers import OptimizerConfig, create_optimizer, create_scheduler, current_lr
from ..memory.policy import OffloadPolicy, memory_features
from ..memory.streamed_optimizer_state import StreamedState, largest_tensor_shaped
from ..data.files import WriteError
from .ema import WeightEMA
from .distributed import DataParallel, RankLostError, RanksStopped
from .run_dir import Checkpoint, CheckpointError, RunDir, capture_rng, restore_rng

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def auto_precision(device: torch.device | str) -> str:
    """The compute precision for a device: bf16 on a CUDA device that supports it, fp16 on other CUDA devices,
    fp32 elsewhere. A CPU has no fast low-precision kernels for these models (measured here: bf16 convolutions
    ~240x slower than fp32, docs/benchmarks/realsize_cpu.md), and its weights in bf16 are cast to fp32 per layer
    anyway."""
    device = torch.device(device)
    if device.type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
_SALT_BATCH, _SALT_VALIDATION, _SALT_GLOBAL, _SALT_ROUNDING, _SALT_TAGS = 1, 2, 3, 4, 5


class Denoiser(Protocol):
    """What the engine needs from a model."""

    sampling: SamplingDescriptor
    device: torch.device

    def to_model_latent(self, latents: torch.Tensor) -> torch.Tensor:
        """Cached (raw VAE) latents -> the latent space the model denoises in."""

    def predict(self, x_t: torch.Tensor, sigma: torch.Tensor, conds: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The model's x0 estimate for a batch; conds holds one conditioning dict per sample."""

    def blocks(self) -> list[tuple[str, torch.nn.Module]]:
        """The model's repeated blocks (name, module), for checkpointing and generic adapter targets."""

    # Optional attribute `inplace_blocks: bool`: True when blocks add into their inputs in place (Flux);
    # the trainer then runs them through checkpointing.wrap_blocks(inplace_inputs=True).


ItemExtras = Callable[[int], dict]
"""Extra conditioning entries of a cached item, e.g. its control image for a ControlNet run: added to the
item's conditioning dict (also when caption dropout swaps its prompt for the empty one)."""


class Trainable(Protocol):
    """What is trained: an adapter set (training/adapters.py) or a ControlNet (nodes/bridge/controlnet_build.py)."""

    def parameters(self) -> list[torch.nn.Parameter]: ...
    def state_dict(self, copy: bool = True) -> dict[str, torch.Tensor]: ...
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...
    def train(self, mode: bool = True) -> None: ...


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    batch_size: int = 1
    grad_accum: int = 1
    max_grad_norm: float = 1.0  # 0 disables clipping
    precision: str = "fp32"  # fp32 | bf16 | fp16 (fp16 uses a GradScaler)
    caption_dropout: float = 0.0
    objective: ObjectiveConfig = ObjectiveConfig()
    ema_decay: float = 0.0  # > 0: keep an exponential moving average of the trainable weights (training/ema.py)
    prior_ratio: float = 0.0  # share of micro-steps that train on the prior (regularisation) dataset

    def validate(self) -> None:
        check_finite("training", max_grad_norm=self.max_grad_norm, caption_dropout=self.caption_dropout)
        if self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError(f"batch_size={self.batch_size} and grad_accum={self.grad_accum} must be >= 1")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if not 0.0 <= self.caption_dropout <= 1.0:
            raise ValueError(f"caption_dropout={self.caption_dropout} must be in [0, 1]")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm} must be >= 0 (0 = no clipping)")
        check_finite("training", ema_decay=self.ema_decay, prior_ratio=self.prior_ratio)
        if not 0.0 <= self.prior_ratio < 1.0:
            raise ValueError(f"prior_ratio={self.prior_ratio} must be in [0, 1) (0: no prior images)")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay={self.ema_decay} must be in [0, 1) (0: no EMA; 0.99-0.9999 is usual)")


def _forked_rng():
    """Restores torch's global RNG states (CPU and every CUDA device) on exit."""
    return torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_available() else [])


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the message names the step and the likely cause."""

    __module__ = public_module(__name__)  # a clean type name in ComfyUI's error report


@dataclasses.dataclass
class StepReport:
    step: int
    loss: float
    lr: float
    seconds: float


class _Subset:
    """A LatentCache seen through a subset of its items (training items, without held-out ones), each listed in its
    bucket as many times as it repeats per epoch (repeat folders), so an epoch's batches hold every repeat."""

    def __init__(self, cache, items: Sequence[int]):
        keep = set(items)
        self.buckets = {}
        for bucket, indices in cache.buckets.items():
            kept = [i for i in indices if i in keep for _ in range(cache.repeats(i))]
            if kept:
                self.buckets[bucket] = kept


class _Batches:
    """The bucketed batches of one dataset (its latent + text caches), epoch after epoch, as a sequence."""

    def __init__(self, latent_cache, text_cache, items: Sequence[int], config: TrainConfig):
        self.latent_cache, self.text_cache, self.config = latent_cache, text_cache, config
        self.view = _Subset(latent_cache, items)
        self.per_epoch = len(bucket_batches(self.view, config.batch_size, config.seed, 0))
        self._epoch: tuple[int, list[list[int]]] | None = None

    def __getitem__(self, index: int) -> list[int]:
        epoch, index = divmod(index, self.per_epoch)
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, bucket_batches(self.view, self.config.batch_size, self.config.seed, epoch))
        return self._epoch[1][index]


def prior_steps_before(micro_step: int, ratio: float) -> int:
    """How many of the micro-steps before `micro_step` train on the prior dataset: an even interleave at `ratio`
    (prior at m exactly when floor((m + 1) * ratio) > floor(m * ratio)). A closed form, so a resumed run draws
    what the straight run drew without counting."""
    return math.floor(micro_step * ratio)


class Trainer:
    def __init__(self, denoiser: Denoiser, trainable: Trainable, latent_cache, text_cache, config: TrainConfig,
                 optimizer_config: OptimizerConfig, train_items: Sequence[int] | None = None,
                 run_dir: RunDir | None = None, policy: OffloadPolicy | None = None,
                 item_extras: ItemExtras | None = None, prior: tuple | None = None):
        config.validate()
        self.denoiser = denoiser
        self.trainable = trainable
        self.latent_cache = latent_cache
        self.text_cache = text_cache
        self.config = config
        self.optimizer_config = optimizer_config
        self.run_dir = run_dir
        # Checkpointing, streaming, optimizer placement...: the run's policy, resolved once (policy.run_policy).
        self.policy = policy if policy is not None else OffloadPolicy()
        # The streamer's options from the run's plan (weight_streaming.WeightStreamer: slots, resident whole blocks,
        # non-block layers kept on the device); set by the ComfyUI bridge on a device, empty elsewhere.
        self.stream_options: dict = {}
        self.stream_setup_seconds: dict[str, float] = {}  # the last train_to's streamer attach, by part
        self.item_extras = item_extras
        self.objective = Objective(denoiser.sampling, config.objective)
        self.train_items = list(range(len(latent_cache))) if train_items is None else list(train_items)
        if not self.train_items:
            raise ValueError("no training items: the latent cache is empty or every item is held out")
        self._batches = _Batches(latent_cache, text_cache, self.train_items, config)
        self.batches_per_epoch = self._batches.per_epoch
        # Prior (regularisation) images: (latent cache, text cache) of a second dataset, mixed in at prior_ratio.
        if (prior is not None) != (config.prior_ratio > 0):
            raise ValueError("prior images need both their caches and prior_ratio > 0 (and prior_ratio needs them)")
        if prior is not None and item_extras is not None:
            raise ValueError("prior images are for LoRA runs: a ControlNet run's items carry control images")
        self._prior = _Batches(prior[0], prior[1], range(len(prior[0])), config) if prior is not None else None
        self.params = list(trainable.parameters())
        trained_weights_on_host.check_kind(self.policy, getattr(getattr(trainable, "config", None), "kind", None))
        # Data parallelism when a process group is running (training/core/distributed.py); None: one rank.
        self.parallel = DataParallel.current()
        # A full fine-tune's weights, gradients and optimizer state sharded with FSDP2 (the launcher's --shard-weights):
        # each trained layer becomes its FSDP unit before the optimizer sees its parameters.
        self.shards_weights = self.parallel is not None and self.parallel.shards_weights
        if self.shards_weights:
            kind = getattr(getattr(trainable, "config", None), "kind", None)
            why = sharded_weights.problem(kind, optimizer_config.name, self.policy, config.ema_decay > 0)
            if why:
                raise ValueError(why)
            sharded_weights.shard(trainable.layers.values(), denoiser.device, self.parallel.world_size)
            self.params = list(trainable.parameters())
        # At most this many items per forward / backward on a rank (None: a rank's whole share of the batch at once):
        # a batch's rows are then trained in chunks whose gradients add up, so N ranks (or one) keep the same global
        # batch with the same memory per rank. Set by the caller (the distributed launcher); not part of the run's
        # configuration, as it changes no result.
        self.rank_batch: int | None = None
        bf16_weights = any(p.dtype == torch.bfloat16 for p in self.params)
        lr_scales = self._learning_rate_scales(trainable, optimizer_config)  # layer_lr_scales, LoRA+; None: one rate
        self._cap_norms = self._norm_cap(trainable, optimizer_config)  # scale_weight_norms; None: off
        self.last_norms: torch.Tensor | None = None  # the last step's [layers scaled, mean norm, largest norm]
        if self.policy.fused_backward:
            self._check_fused(config)
            # Each trained tensor is stepped inside backward and its gradient freed (memory/fused_backward.py): it
            # stands in for the optimizer and its schedule; bf16 weights are rounded stochastically in that step;
            # optimizer state "cpu": each step runs in host RAM, where the state is.
            on_host = self.policy.optimizer_state == "cpu"
            step_device = torch.device("cpu") if on_host else denoiser.device
            # Trained weights in host RAM: copied to the card and back through pinned staging buffers; with their
            # state on the card each tensor is stepped there in backward, its layer handing over the gradient
            # (trained_weights_on_host.py).
            weights_on_host = self.policy.trained_weights == "host"
            # (the layers the policy keeps on the card all the same do not cross: trained_weights_card_blocks)
            crossings = trained_weights_on_host.Crossings(denoiser.device, trainable.parameters_in_host_ram()) \
                if weights_on_host else None
            on_device_steps = weights_on_host and not on_host
            # Optimizer state "streamed": in host RAM between steps, each tensor's crossing to the card for its step
            # (memory/streamed_optimizer_state.py).
            streamed = None
            if self.policy.optimizer_state == "streamed":
                largest = largest_tensor_shaped(optimizer_config.name, [p.shape for p in self.params])
                streamed = StreamedState(denoiser.device, largest, optimizer_config.name)
            self.optimizer = FusedBackward(
                self.params, lambda group: create_optimizer(group, optimizer_config, device=step_device),
                lambda opt: create_scheduler(opt, optimizer_config), max_grad_norm=config.max_grad_norm,
                bf16_stochastic=bf16_weights, seed=step_seed(config.seed, 0, _SALT_ROUNDING), state_on_host=on_host,
                step_device=denoiser.device if on_device_steps else None, crossings=crossings, streamed_state=streamed,
                lr_scales=lr_scales)
            if weights_on_host:
                trainable.weights_in_host_ram(crossings, self.optimizer.step_on_device if on_device_steps else None)
            self.scheduler = self.optimizer.schedule
        else:
            if bf16_weights:
                raise ValueError("bf16 trained weights (LoRA Config full_precision, or a ControlNet's "
                                 "controlnet_precision, bf16_stochastic) are stepped with stochastic rounding by fused "
                                 "backward: turn fused_backward on in the Offload Policy, or set it to fp32")
            if self.policy.optimizer_state == "cpu":
                self.optimizer = HostOptimizer(self.params, lambda host: create_optimizer(
                    host, optimizer_config, device="cpu", lr_scales=lr_scales))
            elif self.parallel is not None and not self.shards_weights and self.shards_state(
                    self.parallel.world_size, trainable, optimizer_config.name, self.policy):
                # Several ranks of a full fine-tune: each keeps the optimizer state of its share of the tensors.
                if lr_scales is not None:
                    raise ValueError("layer_lr_scales (LoRA Config) with a full fine-tune's optimizer state shared out "
                                     "over several devices: not supported; clear layer_lr_scales, or turn "
                                     "fused_backward on in the Offload Policy")
                self.optimizer = sharded_optimizer.sharded(
                    self.params, lambda share: create_optimizer(share, optimizer_config, device=denoiser.device))
            else:
                self.optimizer = create_optimizer(self.params, optimizer_config, device=denoiser.device,
                                                  lr_scales=lr_scales)
            self.scheduler = create_scheduler(self.optimizer, optimizer_config)
        self.scaler = torch.amp.GradScaler(denoiser.device.type) if config.precision == "fp16" else None
        self.ema = WeightEMA(self.params, config.ema_decay) if config.ema_decay > 0 else None
        self.step = 0
        self.loss_history: list[list[float]] = []
        self.validation_history: list[list[float]] = []
        self.saved_step: int | None = None
        # Sharded optimizer state: (step, the whole state) gathered on rank 0 for its checkpoints (gather_state).
        self._gathered: tuple[int, dict | None] | None = None
        # The run's own state of torch's global RNG (peft's dropout draws from it): swapped in while training,
        # so a run depends only on its seed, and other nodes' use of the global RNG neither disturbs it nor
        # is disturbed by it.
        with _forked_rng():
            torch.manual_seed(step_seed(config.seed, 0, _SALT_GLOBAL))
            self.rng = capture_rng()

    @staticmethod
    def _learning_rate_scales(trainable, optimizer_config: OptimizerConfig) -> list[float] | None:
        """Each trained tensor's learning rate as a multiple of the optimizer's (LoRA Config layer_lr_scales; LoRA+:
        the up matrices at loraplus_lr_ratio times); None when all train at the optimizer's rate."""
        ratio = optimizer_config.loraplus_lr_ratio
        scales = getattr(trainable, "learning_rate_scales", None)
        if scales is None:
            if ratio != 1.0:
                raise ValueError(f"loraplus_lr_ratio {ratio:g} (Optimizer Config) raises the learning rate of a LoRA's "
                                 "up matrices, and this run trains no LoRA: set it to 1")
            return None
        scales = scales(ratio)
        if set(scales) == {1.0}:
            return None
        if optimizer_config.name == "Prodigy":  # (LoRA+ with Prodigy: refused by OptimizerConfig itself)
            raise ValueError("Prodigy finds one step size for all trained weights, and LoRA Config layer_lr_scales "
                             "asks for several: clear layer_lr_scales, or choose another optimizer")
        return scales

    @staticmethod
    def _norm_cap(trainable, optimizer_config: OptimizerConfig) -> Callable[[], torch.Tensor] | None:
        """scale_weight_norms' cap, run after each optimizer step (AdapterSet.cap_norms); None when off."""
        limit = optimizer_config.scale_weight_norms
        if not limit:
            return None
        kind = getattr(getattr(trainable, "config", None), "kind", None)
        if kind not in ("lora", "dora"):
            trains = f"kind {kind}" if kind else "no LoRA"
            raise ValueError(f"scale_weight_norms {limit:g} (Optimizer Config) caps the norm of a LoRA's up @ down "
                             f"product, and this run trains {trains}: set it to 0, or train kind lora or dora")
        return lambda: trainable.cap_norms(limit)

    @staticmethod
    def shards_state(ranks: int, trainable, optimizer: str, policy: OffloadPolicy) -> bool:
        """Whether the optimizer state is sharded over `ranks` (memory/sharded_optimizer.py, whose rules the planner
        follows too): a full fine-tune with its state on the device and an optimizer whose tensors step on their own."""
        kind = getattr(getattr(trainable, "config", trainable), "kind", None)
        return sharded_optimizer.state_ranks(ranks, kind, optimizer) > 1 and sharded_optimizer.applies(policy)

    @property
    def sharded(self) -> bool:
        return sharded_optimizer.is_sharded(self.optimizer)

    @property
    def state_ranks(self) -> int:
        """The ranks the optimizer state is sharded over (planner.TrainableSpec.state_ranks); 1: whole."""
        return self.parallel.world_size if self.sharded or self.shards_weights else 1

    @property
    def weight_ranks(self) -> int:
        """The ranks the trained weights and gradients are sharded over (FSDP2; planner.TrainableSpec.weight_ranks)."""
        return self.parallel.world_size if self.shards_weights else 1

    def gather_state(self) -> None:
        """Every rank, at the same completed step: a sharded optimizer's state gathered on rank 0, which alone
        writes checkpoints (also later, while the other ranks wait). Nothing to do when not sharded."""
        if self.shards_weights and (self._gathered is None or self._gathered[0] != self.step):
            with self.parallel.collective("weights and optimizer state gather"):
                self._gathered = (self.step, self._gather_whole())
        elif self.sharded and (self._gathered is None or self._gathered[0] != self.step):
            with self.parallel.collective("optimizer state gather"):
                self._gathered = (self.step, sharded_optimizer.gather(self.optimizer, self.parallel.is_main))

    def _gather_whole(self) -> dict | None:
        """FSDP2: the whole trained weights and optimizer state in host RAM on rank 0 (None on the others), one
        tensor at a time."""
        main = self.parallel.is_main
        adapter = {}
        for key, value in self.trainable.state_dict(copy=False).items():
            whole = sharded_weights.full(value)
            if main:
                adapter[key] = whole.to("cpu", copy=True)
        optimizer = sharded_weights.gather_optimizer_state(self.optimizer, main)
        return {"adapter": adapter, "optimizer": optimizer} if main else None

    @property
    def can_save(self) -> bool:
        """Whether a checkpoint of this step can be written: finite weights, and a sharded optimizer's state
        gathered at this step (after a lost rank it is not: the last checkpoint on disk stays the run's)."""
        if self.shards_weights:  # rank 0 checks the whole weights it gathered
            gathered = self._gathered if self._gathered is not None and self._gathered[0] == self.step else None
            return gathered is not None and (gathered[1] is None or all(
                bool(torch.isfinite(t).all()) for t in gathered[1]["adapter"].values()))
        return self.params_finite() and (not self.sharded or (self._gathered or (None,))[0] == self.step)

    def _check_fused(self, config: TrainConfig) -> None:
        """Fused backward steps in every backward pass, on the device, from one rank's gradient: what needs the
        gradients kept (accumulation, the ranks' sum, fp16's scaler) cannot run with it."""
        FusedBackward.check_accumulation(config.grad_accum)
        if config.precision == "fp16":
            raise ValueError("fused backward steps inside backward, before fp16's gradient scaler could check the "
                             "gradients for overflow: use precision bf16 or fp32, or turn fused_backward off")
        if self.parallel is not None:
            raise ValueError("fused backward steps each tensor on its rank's own gradient, before the ranks' "
                             "gradients are summed: train on one device, or turn fused_backward off (a full fine-tune "
                             "then shares its optimizer state out over the devices)")

    # --- data -------------------------------------------------------------------------------------------
    def _batch(self, micro_step: int) -> tuple[_Batches, list[int]]:
        """(the dataset, its items) a micro-step trains on."""
        if self._prior is None:
            return self._batches, self._batches[micro_step]
        ratio = self.config.prior_ratio
        before = prior_steps_before(micro_step, ratio)
        if prior_steps_before(micro_step + 1, ratio) > before:
            return self._prior, self._prior[before]
        return self._batches, self._batches[micro_step - before]

    def batch_items(self, micro_step: int) -> list[int]:
        return self._batch(micro_step)[1]

    def _latents(self, items: Sequence[int], latent_cache=None) -> torch.Tensor:
        latent_cache = latent_cache if latent_cache is not None else self.latent_cache
        raw = torch.stack([latent_cache.latent(i).float() for i in items])
        return self.denoiser.to_model_latent(raw.to(self.denoiser.device))

    def _masks(self, items: Sequence[int], latent_cache=None) -> torch.Tensor | None:
        """Loss masks [B, 1, h, w] (clips: [B, 1, T, h, w]) of the items (a cache without masks: None; an item
        without one: all ones)."""
        read = getattr(latent_cache if latent_cache is not None else self.latent_cache, "mask", None)
        masks = [read(i) for i in items] if read is not None else []
        if not any(m is not None for m in masks):
            return None
        shape = next(m for m in masks if m is not None).shape
        return torch.stack([m.float() if m is not None else torch.ones(shape) for m in masks]).to(self.denoiser.device)

    def _conds(self, items: Sequence[int], dropout: torch.Tensor | None = None,
               source: _Batches | None = None, draws: torch.Tensor | None = None) -> list[dict[str, torch.Tensor]]:
        """The items' conditioning; `dropout`: which get the empty prompt; `draws`: which cached tag order of its
        caption each gets (item_conditioning; None: as written)."""
        latent_cache, text_cache = (source.latent_cache, source.text_cache) if source is not None else \
            (self.latent_cache, self.text_cache)
        conds = []
        for n, i in enumerate(items):
            if dropout is not None and dropout[n]:
                conds.append(text_cache.empty_conditioning())
            else:
                conds.append(item_conditioning(text_cache, latent_cache, i, int(draws[n]) if draws is not None else 0))
            if self.item_extras is not None and (source is None or source is self._batches):
                conds[-1] = {**conds[-1], **self.item_extras(i)}
        return conds

    # --- one step ---------------------------------------------------------------------------------------
    def _autocast(self):
        dtype = PRECISIONS[self.config.precision]
        return torch.autocast(self.denoiser.device.type, dtype=dtype, enabled=dtype is not None)

    def _row_slices(self, count: int) -> list[slice] | None:
        """The chunks of a batch of `count` items this rank trains, one forward / backward each; None: the whole
        batch at once (one rank, no rank_batch). Every rank gets as many chunks (some maybe empty), so the ranks'
        collectives pair up."""
        if self.parallel is None and self.rank_batch is None:
            return None
        if self.rank_batch is not None and self.rank_batch < 1:
            raise ValueError(f"rank_batch={self.rank_batch} must be >= 1 (None: a rank's whole share at once)")
        share = self.parallel.share(count) if self.parallel is not None else slice(0, count)
        world = self.parallel.world_size if self.parallel is not None else 1
        largest = -(-count // world)
        chunk = min(self.rank_batch or largest, largest)
        return [slice(min(share.start + k * chunk, share.stop), min(share.start + (k + 1) * chunk, share.stop))
                for k in range(-(-largest // chunk))]

    def _micro_step_loss(self, micro_step: int, rows: slice | None = None) -> tuple[torch.Tensor, list[int]]:
        """The loss of the micro-step's batch; `rows` (chunks, several ranks): of those rows of the batch, weighted
        by their share of it, so the rows' losses (and gradients) add up to the batch's."""
        source, items = self._batch(micro_step)
        generator = torch.Generator().manual_seed(step_seed(self.config.seed, micro_step, _SALT_BATCH))
        # Drawn for the whole batch, then this rank's rows: N ranks train on exactly what one rank would.
        dropout = torch.rand(len(items), generator=generator) < self.config.caption_dropout
        # Its own generator, so a text cache without tag shuffling leaves every other draw as it was.
        tags = torch.Generator().manual_seed(step_seed(self.config.seed, micro_step, _SALT_TAGS))
        draws = torch.randint(1 << 30, (len(items),), generator=tags)
        x0 = self._latents(items, source.latent_cache)
        sigma = self.objective.sample_sigma(len(items), generator).to(self.denoiser.device)
        noise = self.objective.sample_noise(x0, generator).to(x0)
        perturbation = self.objective.sample_perturbation(x0, generator)
        if rows is not None:
            weight = len(items[rows]) / len(items)
            if not items[rows] and self.shards_weights:
                # FSDP2's per-layer collectives need every rank's forward and backward: a stand-in row, weighted 0.
                rows = slice(0, 1)
            items, dropout, draws = items[rows], dropout[rows], draws[rows]
            x0, sigma, noise = x0[rows], sigma[rows], noise[rows]
            perturbation = perturbation[rows] if perturbation is not None else None
            if not items:  # a bucket's last, smaller batch may leave a rank nothing: it adds no gradient
                return torch.zeros((), device=self.denoiser.device), items
        x_t, target = self.objective.perturbed(x0, noise, sigma, perturbation)
        with self._autocast():
            x0_hat = self.denoiser.predict(x_t, sigma, self._conds(items, dropout, source, draws))
        loss = self.objective.loss(x0_hat, target, sigma, mask=self._masks(items, source.latent_cache))
        if rows is not None:
            loss = loss * weight
        return loss, items if source is self._batches else [f"prior {i}" for i in items]

    def train_step(self) -> float:
        """One optimizer step (grad_accum micro-steps). Returns the mean loss (of the global batch)."""
        accum = self.config.grad_accum
        if self.policy.fused_backward and self.rank_batch is not None:
            raise ValueError("fused backward steps in every backward pass: a batch trained in chunks (rank_batch) "
                             "would step once per chunk")
        self.optimizer.zero_grad(set_to_none=True)
        # The loss is read back (a host sync) once, after the last backward, not between each forward and its
        # backward: the device keeps its queue across the turn (issue 41 item 4). A non-finite loss still stops the
        # step before the optimizer touches the weights, with the same message. Read before backward where that
        # cannot wait: several ranks agree on the loss in a collective, and fused backward steps the optimizer
        # inside backward.
        read_now = self.parallel is not None or self.policy.fused_backward
        losses, pending = [], []  # pending: (micro-step index in `losses`, loss tensor, items)
        for j in range(accum):
            micro_step = self.step * accum + j
            losses.append(0.0)
            for rows in self._row_slices(len(self.batch_items(micro_step))) or [None]:
                loss, items = self._micro_step_loss(micro_step, rows)
                if read_now:
                    # Several ranks: every rank checks and reports the global loss, so all stop (or go on) together.
                    value = self.parallel.global_loss(loss, self.step) if self.parallel is not None else loss.item()
                    if not math.isfinite(value):
                        raise self._non_finite(value, items)
                    losses[j] += value
                else:
                    pending.append((j, loss.detach(), items))
                if not items:
                    continue  # this rank's chunk of the batch was empty
                scaled = loss / accum
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        if pending:
            values = torch.stack([loss.to(torch.float64) for _, loss, _ in pending]).tolist()  # exact: as .item()
            for (j, _, items), value in zip(pending, values):
                if not math.isfinite(value):
                    raise self._non_finite(value, items)
                losses[j] += value
        if self.parallel is not None:
            self.parallel.reduce_gradients(self.params)  # once per optimizer step, like DDP's no_sync
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.config.max_grad_norm > 0 and not self.policy.fused_backward:  # fused: clipped per tensor in backward
            # FSDP2: each rank holds its gradients' shards, so their squares are added over the ranks.
            clip_gradients(self.params, self.config.max_grad_norm,
                           self.parallel.sum_over_ranks if self.shards_weights else None)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips the update when fp16 gradients overflowed
            self.scaler.update()
        else:
            self.optimizer.step()
        if self._cap_norms is not None:
            self.last_norms = self._cap_norms()
            if isinstance(self.optimizer, HostOptimizer):
                self.optimizer.weights_changed()
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update(self.params)
        self.step += 1
        self.rng = capture_rng()  # the global RNG as this completed step left it: what a checkpoint resumes from
        mean = sum(losses) / len(losses)
        self.loss_history.append([self.step, mean])
        return mean

    def _non_finite(self, loss: float, items: list[int]) -> NonFiniteLossError:
        step = self.step + 1
        causes = [f"the learning rate ({current_lr(self.optimizer):.3g}) is too high for this optimizer"]
        if self.config.precision == "fp16":
            causes.insert(0, "fp16 overflow (use precision bf16 or fp32)")
        causes.append(f"a corrupt cached latent or conditioning among items {items} (re-run caching)")
        kept = ""
        if self.run_dir is not None:
            if self.parallel is not None:
                self._gather_quietly()  # every rank sees the same global loss: they are here together
            if self.can_save and self.step > 0 and self.saved_step != self.step:
                self.save()  # the weights are still those of the last good step
            if self.saved_step is not None:
                kept = f" The last good checkpoint (step {self.saved_step}) is kept in {self.run_dir.display}."
        return NonFiniteLossError(
            f"training loss became {loss} at step {step}; likely cause: " + "; or ".join(causes) + "." + kept
        )

    def train_to(self, target_step: int, after_step: Callable[[StepReport], None] | None = None,
                 checkpoint_every: int = 0, checkpoint_seconds: float = 0.0) -> None:
        """Train until `self.step == target_step` (no work when already there). `after_step` runs after each
        completed step; it may raise (e.g. ComfyUI's interrupt), leaving the trainer at a completed step.

        A checkpoint is written every `checkpoint_every` steps and whenever `checkpoint_seconds` have passed since
        the last one written here (0: off), so a crash or kill loses at most that much; the caller saves the
        last step."""
        if target_step <= self.step:
            return
        if (checkpoint_every or checkpoint_seconds) and self.run_dir is None:
            raise ValueError("periodic checkpoints need a run directory")
        # Tiny gradients and optimizer moments become denormal floats, which x86 CPUs process ~100x slower;
        # flushing them to zero costs no accuracy that matters and is what GPUs do anyway.
        flush_denormal = self.denoiser.device.type == "cpu" and torch.set_flush_denormal(True)
        saved_at = time.monotonic()
        if self.parallel is not None:
            self.parallel.others_know = False  # a new stretch of training: no stop told yet
        with torch.inference_mode(False), _forked_rng():
            restore_rng(self.rng)
            try:
                # Checkpointing, offloaded checkpoints and streamed blocks, as the policy says (training/policy.py).
                with memory_features(self.policy, [m for _, m in self.denoiser.blocks()], self.denoiser.device,
                                     inplace_inputs=getattr(self.denoiser, "inplace_blocks", False),
                                     **self.stream_options) as streamer:
                    # where this stretch's start went (WeightStreamer.setup_seconds; the GPU kit records it)
                    self.stream_setup_seconds = dict(streamer.setup_seconds) if streamer is not None else {}
                    self.trainable.train(True)
                    while self.step < target_step:
                        started = time.perf_counter()
                        loss = self.train_step() if self.parallel is None else self._train_step_on_every_rank()
                        report = StepReport(self.step, loss, current_lr(self.optimizer), time.perf_counter() - started)
                        due = bool((checkpoint_every and self.step % checkpoint_every == 0) or
                                   (checkpoint_seconds and time.monotonic() - saved_at >= checkpoint_seconds))
                        if self.parallel is not None:
                            due = self._after_step_on_every_rank(after_step, report, due)
                        elif after_step is not None:
                            after_step(report)
                        if due and self.step < target_step:
                            self.gather_state()
                            self.save()
                            saved_at = time.monotonic()
                    self.gather_state()  # every rank reached the target: rank 0 can save this step from here on
            except BaseException:
                if self.parallel is not None and self.step < target_step:
                    self.leave_between_steps()
                raise
            finally:
                self.trainable.train(False)
                if flush_denormal:
                    torch.set_flush_denormal(False)

    def _train_step_on_every_rank(self) -> float:
        """train_step with several ranks: a rank that leaves it midway (ComfyUI raises its interrupt inside rank 0's
        forward) tells the others through the collective they wait in; every rank discards the step's gradients."""
        accum = self.config.grad_accum
        self.parallel.begin_step(self.step, sum(len(self._row_slices(len(self.batch_items(self.step * accum + j))))
                                                for j in range(accum)))
        try:
            return self.train_step()
        except RankLostError:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        except RanksStopped:
            self.optimizer.zero_grad(set_to_none=True)
            self._gather_quietly()  # with the rank that left the step (below)
            raise
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)
            if not self.shards_weights:  # FSDP2: the others may wait in a layer's collective; torchrun stops them
                self.parallel.abort_step(self.params)
                self._gather_quietly()
            raise

    def _gather_quietly(self) -> None:
        """gather_state on the way out of a stopped step (every rank takes the same way out); a lost group changes
        nothing: the error being raised says more, and the run keeps its last checkpoint on disk."""
        with contextlib.suppress(RankLostError):
            self.gather_state()

    def leave_between_steps(self) -> None:
        """This rank stops outside a step's collectives (see DataParallel.leave): the others stop at the same
        completed step. A lost group changes nothing: the error being raised says more."""
        if self.parallel.others_know or self.shards_weights:  # FSDP2: torchrun stops the others
            return
        with contextlib.suppress(RankLostError):
            self.parallel.leave()
        self._gather_quietly()  # the others gather on their way out of the step they were told to stop

    def _after_step_on_every_rank(self, after_step, report: StepReport, save_due: bool) -> bool:
        """`after_step` (it may raise: rank 0's cancel), then every rank learns whether one stops: all stop at this
        completed step, the raising rank with its own error, the others with RanksStopped. Returns whether a
        checkpoint is due (`save_due` on any rank)."""
        error = None
        try:
            if after_step is not None:
                after_step(report)
        except BaseException as raised:  # noqa: BLE001 - re-raised below, after the other ranks know
            error = raised
        if self.parallel.any_stops(error is not None, save_due):
            self._gather_quietly()
            if error is not None:
                raise error
            raise RanksStopped(f"rank {self.parallel.rank}: another rank stopped the run after step {self.step} "
                               "(cancel or its error); this rank stops at the same step")
        return self.parallel.save_due

    # --- validation loss ----------------------------------------------------------------------------------
    def validation_loss(self, items: Sequence[int], times: int = 4, seed: int = 0) -> float:
        """Deterministic loss on `items` at `times` fixed noise levels with fixed noise (no min-SNR)."""
        if not items:
            raise ValueError("validation loss needs at least one item")
        t = self.objective.fixed_times(times)
        sigma = self.objective.sigma_at(t).to(self.denoiser.device)
        total = 0.0
        with torch.inference_mode(False), torch.no_grad():
            for item in items:
                x0 = self._latents([item]).repeat_interleave(times, dim=0)
                generator = torch.Generator().manual_seed(step_seed(seed, item, _SALT_VALIDATION))
                noise = torch.randn(x0.shape, generator=generator).to(x0)
                x_t = self.objective.noisy(x0, noise, sigma)
                with self._autocast():
                    x0_hat = self.denoiser.predict(x_t, sigma, self._conds([item]) * times)
                mask = self._masks([item])
                mask = mask.repeat_interleave(times, dim=0) if mask is not None else None
                total += self.objective.loss(x0_hat, x0, sigma, weighted=False, mask=mask).item()
        return total / len(items)

    def parked_for_validation(self):
        """Optimizer state and gradients in host RAM for the block, when the policy says so (validation then
        holds only the weights on the device); restored bitwise afterwards."""
        if self.policy.park_optimizer_during_validation:
            return parked(self.optimizer, self.params)
        return contextlib.nullcontext()

    def record_validation(self, value: float) -> None:
        self.validation_history.append([self.step, value])

    # --- checkpoints ----------------------------------------------------------------------------------------
    def checkpoint(self, copy: bool = True) -> Checkpoint:
        """This step's state; `copy` False: the live tensors, to be written out before training goes on (save: no
        second copy of the trained weights, on their device, while it writes; the optimizer state is never copied)."""
        return Checkpoint(
            step=self.step, micro_step=self.step * self.config.grad_accum,
            adapter=self._gathered[1]["adapter"] if self.shards_weights else self.trainable.state_dict(copy=copy),
            optimizer=self._optimizer_state(),
            scheduler=self.scheduler.state_dict(), scaler=self.scaler.state_dict() if self.scaler is not None else None,
            rng=self.rng, loss_history=[list(x) for x in self.loss_history],
            validation_history=[list(x) for x in self.validation_history],
            ema=self.ema.state_dict(copy=copy) if self.ema is not None else None,
        )

    def _optimizer_state(self) -> dict:
        if not (self.sharded or self.shards_weights):
            return self.optimizer.state_dict()
        if self._gathered is None or self._gathered[0] != self.step:
            raise RuntimeError(f"the optimizer state of step {self.step} is spread over the ranks (not gathered at "
                               "this step): no checkpoint of it can be written")
        return self._gathered[1]["optimizer"] if self.shards_weights else self._gathered[1]

    def restore(self, checkpoint: Checkpoint) -> None:
        """Load a checkpoint after checking it fits what this trainer trains (a file from disk is untrusted)."""
        upgrade = getattr(self.trainable, "upgrade_checkpoint", None)  # an older layout of the same run, converted
        if upgrade is not None:
            checkpoint = upgrade(checkpoint)
        problem = self._mismatch(checkpoint)
        if problem:
            where = f"run '{self.run_dir.name}'" if self.run_dir is not None else "the checkpoint"
            raise CheckpointError(
                f"{where}: the saved checkpoint of step {checkpoint.step} does not fit this run ({problem}). It was "
                "edited or written for other settings: move the run folder away, or use a new run name."
            )
        try:
            if self.shards_weights:  # every rank read the whole checkpoint: each keeps its shards
                live = self.trainable.state_dict(copy=False)
                self.trainable.load_state_dict({key: sharded_weights.like(value, live[key])
                                                for key, value in checkpoint.adapter.items()})
                sharded_weights.load_optimizer_state(self.optimizer, checkpoint.optimizer)
            else:
                self.trainable.load_state_dict(checkpoint.adapter)
                if self.sharded:
                    sharded_optimizer.load(self.optimizer, checkpoint.optimizer)
                else:
                    self.optimizer.load_state_dict(checkpoint.optimizer)
            self.scheduler.load_state_dict(checkpoint.scheduler)
            if self.scaler is not None and checkpoint.scaler is not None:
                self.scaler.load_state_dict(checkpoint.scaler)
            if self.ema is not None:
                if checkpoint.ema is None:
                    raise ValueError("it holds no EMA weights, and this run keeps an EMA")
                self.ema.load_state_dict(checkpoint.ema)
        except (ValueError, KeyError, TypeError, RuntimeError) as error:
            raise CheckpointError(f"the saved checkpoint of step {checkpoint.step} cannot be loaded ({error}): move "
                                  "the run folder away, or use a new run name") from None
        self.rng = checkpoint.rng
        self.step = checkpoint.step
        self.loss_history = [list(x) for x in checkpoint.loss_history]
        self.validation_history = [list(x) for x in checkpoint.validation_history]
        self.saved_step = checkpoint.step
        if self.sharded:
            self._gathered = (checkpoint.step, checkpoint.optimizer if self.parallel.is_main else None)
        elif self.shards_weights:
            self._gathered = (checkpoint.step, {"adapter": checkpoint.adapter, "optimizer": checkpoint.optimizer}
                              if self.parallel.is_main else None)

    def _mismatch(self, checkpoint: Checkpoint) -> str | None:
        """What in a checkpoint does not fit this trainer: weight keys, shapes and dtypes; optimizer groups, state
        shapes; scheduler and scaler fields. None when it fits."""
        current = self.trainable.state_dict()
        saved = checkpoint.adapter
        if set(saved) != set(current):
            missing, extra = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
            return (f"{len(missing)} weight(s) missing (e.g. {missing[:1]}), {len(extra)} unknown (e.g. {extra[:1]})")
        for key, tensor in current.items():
            if not isinstance(saved[key], torch.Tensor) or saved[key].shape != tensor.shape or saved[key].dtype != tensor.dtype:
                got = saved[key]
                return (f"weight {key} is {getattr(got, 'dtype', type(got).__name__)} {list(getattr(got, 'shape', []))}, "
                        f"expected {tensor.dtype} {list(tensor.shape)}")
        return (_optimizer_mismatch(checkpoint.optimizer, self.optimizer)
                or _fields_mismatch("LR scheduler", checkpoint.scheduler, self.scheduler.state_dict())
                or (_fields_mismatch("gradient scaler", checkpoint.scaler, self.scaler.state_dict())
                    if self.scaler is not None and checkpoint.scaler is not None else None))

    def params_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.params)

    def save(self) -> None:
        if self.run_dir is None:
            raise RuntimeError("this trainer has no run directory to save to")
        if self.parallel is not None and not self.parallel.is_main:
            self.saved_step = self.step  # rank 0 writes the run directory; the ranks hold the same weights
            return
        try:
            self.run_dir.save_checkpoint(self.checkpoint(copy=False))
        except WriteError as error:  # disk full...: say what is (not) on disk, and that queueing again saves it
            kept = f"step {self.saved_step}" if self.saved_step is not None else "none"
            raise type(error)(f"{error} The run is at step {self.step} in memory; its last checkpoint on disk: {kept}. "
                              "Queueing again saves it.") from error
        self.saved_step = self.step

    def resume(self) -> bool:
        """Load the run directory's latest checkpoint, if there is one."""
        checkpoint = self.run_dir.load_checkpoint() if self.run_dir is not None else None
        if checkpoint is None:
            return False
        self.restore(checkpoint)
        return True

    @property
    def last_loss(self) -> float:
        return self.loss_history[-1][1] if self.loss_history else math.nan


# The optimizer state entries with one value per parameter element (torch's Adam / AdamW / SGD, bitsandbytes' 8-bit
# state, Prodigy, which keeps some flattened); other entries (factored rows / columns, block scales, maps) are smaller.
_PARAM_SHAPED_STATE = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "state1", "state2", "p0", "s"}


def _optimizer_mismatch(saved, optimizer) -> str | None:
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    state = saved.get("state") if isinstance(saved, dict) else None
    current = optimizer.param_groups
    if not isinstance(groups, list) or not isinstance(state, dict) or len(groups) != len(current) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) and len(g["params"]) == len(c["params"])
            for g, c in zip(groups, current)):
        # Fused backward keeps one group per trained tensor, the plain optimizer one group for all of them.
        tensors = sum(len(c["params"]) for c in current)
        if isinstance(groups, list) and tensors > 1:
            fused = isinstance(optimizer, FusedBackward)
            if (fused and len(groups) == 1) or (not fused and len(current) == 1 and len(groups) == tensors):
                switch = "off" if fused else "on"
                return f"it was saved with the Offload Policy's fused_backward {switch}: set it {switch} to resume it"
        return "its optimizer state has other parameter groups than this optimizer"
    # Fused backward's groups step fp32 stand-ins of bf16 weights (empty between steps): its state has the weights'.
    live_params = [[param] for param in optimizer.params] if isinstance(optimizer, FusedBackward) else \
        [live["params"] for live in current]
    params = {}
    for group, live in zip(groups, live_params):
        for index, param in zip(group["params"], live):
            if not isinstance(index, int) or isinstance(index, bool):
                return "its optimizer state names parameters by something other than numbers"
            params[index] = param
    for index, entries in state.items():
        if index not in params or not isinstance(entries, dict):
            return f"its optimizer state has an entry for unknown parameter {str(index)[:20]!r}"
        param = params[index]
        for name, value in entries.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                if name in _PARAM_SHAPED_STATE and value.numel() != param.numel():
                    return (f"optimizer state {name!r} of parameter {index} is {list(value.shape)}, the parameter "
                            f"{list(param.shape)}")
                if value.numel() > param.numel() + 4096:
                    return f"optimizer state {name!r} of parameter {index} is larger than its parameter"
            elif not isinstance(value, (int, float, bool, torch.Tensor, type(None))):
                return f"optimizer state {name!r} of parameter {index} is a {type(value).__name__}"
    return None


def _fields_mismatch(what: str, saved, current: dict) -> str | None:
    """A scheduler / scaler state may hold only fields the live one has, with values of the same kinds (a scheduler's
    load_state_dict copies every field into the object as is); fields it lacks keep their current values."""
    if not isinstance(saved, dict) or not set(saved) <= set(current):
        unknown = sorted(map(str, set(saved) - set(current))) if isinstance(saved, dict) else []
        return f"its {what} state has fields this {what} does not have ({', '.join(unknown[:3]) or 'not a dict'})"
    for key, other in saved.items():
        value = current[key]
        numeric = (int, float)
        if isinstance(value, numeric) and not isinstance(value, bool):
            if not isinstance(other, numeric) or isinstance(other, bool):
                return f"its {what} field {key!r} is not a number"
        elif value is not None and other is not None and type(other) is not type(value):
            return f"its {what} field {key!r} is a {type(other).__name__}, not a {type(value).__name__}"
    return None
