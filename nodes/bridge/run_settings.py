"""What a run opens with, from the Init nodes' inputs (LoRA and ControlNet alike): the compute precision, the
engine's TrainConfig, the offload policy resolved once, and the fingerprint that reruns an Init node whose run
folder changed."""
from __future__ import annotations

import dataclasses
import logging

import torch

from ...training.core.objective import ObjectiveConfig
from ...training.core.run_dir import RunDir, check_name
from ...training.core.trainer import PRECISIONS, TrainConfig, auto_precision
from ...training.memory.policy import GIB, OffloadPolicy, run_policy
from .comfy_bridge import run_generation
from .model_files import runs_root


def resolve_precision(precision: str, device, run_name: str, node: str) -> tuple[str, str]:
    """(the precision the run computes in, a note saying why). "auto": what a resumed run was started with, else
    the device's fast one (training/core/trainer.py auto_precision); the resolved value is what the run stores. An
    explicit bf16 / fp16 on a CPU is honoured, with a warning: it runs far slower than fp32 there."""
    device = torch.device(device)
    if precision == "auto":
        resumed = stored_train(run_name).get("precision")
        if resumed in PRECISIONS:
            note = f"{node}: precision auto -> {resumed}, as run '{run_name}' was started"
        else:
            resumed = auto_precision(device)
            why = {"cpu": "a CPU has no fast bf16 / fp16 kernels"}.get(device.type, f"the fast precision of {device}")
            note = f"{node}: precision auto -> {resumed} on {device} ({why})"
        logging.info(note)
        return resumed, note
    note = f"{node}: precision {precision} on {device}"
    if device.type == "cpu" and precision != "fp32":
        note += (f": honoured, but a CPU has no fast {precision} kernels, so training and validation run many times "
                 "slower than in fp32 (bf16 convolutions ~180x); choose auto or fp32 for speed")
        logging.warning(note)
    return precision, note


def train_config(model, run_name: str, node: str, seed, batch_size, grad_accumulation, precision, max_grad_norm,
                 caption_dropout, timestep_sampling, loss_weighting, min_snr_gamma, noise_offset, loss_type: str,
                 huber_delta: float, ema_decay: float, prior_ratio: float = 0.0,
                 noise_range: tuple[float, float] = (0.0, 1.0),
                 masked_out_weight: float = 0.0, extra_noise: dict | None = None) -> tuple[TrainConfig, str]:
    """The engine's TrainConfig from the Init nodes' shared inputs (LoRA and ControlNet), checked, with the note
    on how the compute precision was chosen. `extra_noise`: the extra_noise_inputs' values (nodes/inputs.py), by their
    ObjectiveConfig names."""
    precision, note = resolve_precision(precision, model.load_device, run_name, node)
    train = TrainConfig(
        seed=seed, batch_size=batch_size, grad_accum=grad_accumulation, max_grad_norm=max_grad_norm,
        precision=precision, caption_dropout=caption_dropout, ema_decay=ema_decay, prior_ratio=prior_ratio,
        objective=ObjectiveConfig(timestep_sampling=timestep_sampling, loss_weighting=loss_weighting,
                                  min_snr_gamma=min_snr_gamma, noise_offset=noise_offset, loss_type=loss_type,
                                  huber_delta=huber_delta, noise_min=noise_range[0], noise_max=noise_range[1],
                                  masked_out_weight=masked_out_weight, **(extra_noise or {})),
    )
    train.validate()
    return train, note


def stored_train(run_name: str) -> dict:
    """The `session.train` settings an existing run folder stores ({} for a new run or an unreadable config)."""
    session = (RunDir(runs_root(), run_name).read_config() or {}).get("session")
    train = session.get("train") if isinstance(session, dict) else None
    return train if isinstance(train, dict) else {}


def effective_batch(train: TrainConfig, latent_cache, holdout: int, run_name: str, node: str) -> tuple[TrainConfig, str]:
    """A batch is drawn from one aspect-ratio bucket, so it holds at most the largest bucket's training items: a
    larger batch_size is cut to that (the run and its config.json record what it trains with), and a bucket smaller
    than the batch gives smaller batches. Returns the TrainConfig and a warning for the node ('' when none)."""
    items = max(len(latent_cache) - holdout, 0)  # the training items come first (RunRecord's holdout split)
    # an item of a repeat folder is in its bucket's batches as many times as it repeats per epoch (trainer._Subset)
    sizes = [sum(latent_cache.repeats(i) for i in indices if i < items) for indices in latent_cache.buckets.values()]
    sizes = [size for size in sizes if size]
    if not sizes or train.batch_size <= min(sizes):
        return train, ""
    largest = max(sizes)
    effective = min(train.batch_size, largest)
    if effective < train.batch_size:
        note = (f"{node}: batch_size={train.batch_size} but the largest aspect-ratio bucket has {largest} training "
                f"item(s) ({items} in all, {len(sizes)} bucket(s)): training with batch {effective}, as config.json "
                "records. Add images, or lower batch_size (grad_accumulation raises the effective batch without "
                "more images).")
        stored = stored_train(run_name).get("batch_size")
        if isinstance(stored, int) and stored > effective and min(stored, largest) == effective:
            # A run stored before batches were cut trains the same batches: it resumes with what it stored.
            note = note.replace(", as config.json records.", f" (config.json of this older run says {stored}).")
            effective = stored
        train = dataclasses.replace(train, batch_size=effective)
    else:
        note = (f"{node}: batch_size={train.batch_size} is larger than {sum(s < effective for s in sizes)} of the "
                f"{len(sizes)} aspect-ratio buckets (sizes {', '.join(map(str, sorted(sizes)))}): their batches are "
                "smaller (a batch never mixes buckets).")
    logging.warning(note)
    return train, note


def resolve_policy(policy, gradient_checkpointing: bool, checkpoint_depth: int, plan_card=None,
                   node: str = "") -> tuple[OffloadPolicy, str]:
    """The run's offload policy, resolved once when it opens (LoRA and ControlNet Init nodes), and a note on it.
    A policy that fits a card (`fits_card`) is first resolved by `plan_card(policy)` (the planner's fastest policy
    whose planned peak fits the card: nodes/bridge/planning.plan_for_card) into a concrete one, budget and all; the
    note says what was chosen (logged; shown on the node). Then the policy input (none: everything resident) with
    the gradient_checkpointing / checkpoint_depth inputs mapped into it (training/memory/policy.run_policy). Every
    later step reads only `run.policy`."""
    if policy is not None and not isinstance(policy, OffloadPolicy):
        raise ValueError("policy must come from an Offload Policy (Headroom) or Memory Plan (Headroom) node")
    note = ""
    if policy is not None and policy.fits_card:
        plan = plan_card(policy)
        note = f"{node}: {policy.card}: {plan.summary()}"
        if plan.fits and plan.advice:  # fused_backward or bf16 weights would allow more: said, not chosen
            note += f".{plan.advice}"
        if plan.fits and not plan.slow and not plan.advice:
            logging.info(note)
        elif plan.fits:  # the summary (or the advice) says why
            logging.warning(note)
        else:
            note += f". {plan.reason}"
            logging.warning(note)
        policy = plan.policy.replace(card="custom", vram_budget_gb=round(plan.budget_bytes / GIB, 3))
    return run_policy(policy, gradient_checkpointing, checkpoint_depth), note


def run_fingerprint(run_name) -> int:
    """Init nodes: run again when the run folder their cached run opened was deleted or replaced since."""
    try:
        return run_generation(runs_root(), check_name(run_name))
    except ValueError:
        return 0  # a bad name: execute says so
