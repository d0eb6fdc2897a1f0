"""A run's curves in its folder as a TensorBoard log (training/core/scalar_log.py): what Train Steps and Validate
record, read back with TensorBoard's own reader."""
from __future__ import annotations

import struct

import torch

from test_train_lora_nodes import _data, _init


def _curves(run_folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_folder / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def _f32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def test_train_steps_and_validate_write_the_runs_curves_for_tensorboard(comfyui):
    """Each step's loss, learning rate, time and memory (RSS on a CPU: no VRAM figures are made up) and each
    validation loss, at the run's steps, as the run's history holds them; a second Train Steps call adds to them."""
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15", count=5)
    run = _init(model, latents, texts, "tensorboard_curves", rank=4, schedule="cosine", schedule_steps=10, holdout=1)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 3)
        validation = T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts="", negative="", sample_seed=0,
                                                sample_steps=1, cfg=1.0, sampler_name="euler", scheduler="normal",
                                                width=32, height=32, loss_timesteps=4).args[1]
        T.HeadroomTrainSteps.execute(run, 5)
    curves = _curves(run.run_dir.path)
    assert set(curves) == {"loss/train", "learning_rate", "time/s_per_step", "memory/rss_gib", "loss/validation"}
    assert curves["loss/train"] == [(step, _f32(loss)) for step, loss in run.trainer.loss_history]
    assert [step for step, _ in curves["learning_rate"]] == [1, 2, 3, 4, 5]
    assert curves["learning_rate"][0][1] > curves["learning_rate"][-1][1] > 0  # the cosine schedule
    assert curves["loss/validation"] == [(3, _f32(validation))]
    assert all(seconds > 0 for _, seconds in curves["time/s_per_step"])
    assert all(0 < gib < 1024 for _, gib in curves["memory/rss_gib"])
