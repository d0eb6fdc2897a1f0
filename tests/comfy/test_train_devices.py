"""The training nodes' `devices` input inside ComfyUI: rank 0 in this process, a worker process for rank 1 (gloo on
the CPU) that gets the frozen base through shared memory (and a ControlNet run's initial ControlNet from rank 0);
training like one device (LoRA Init, the all-in-one Train LoRA, ControlNet Init), cancel, a killed worker, a
worker's ordinary error, and the worker's exit."""
from __future__ import annotations

import threading

import pytest
import torch
from test_train_lora_nodes import _data, _init

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]


def test_devices_2_spawns_trains_like_one_device_and_cancel_stops_every_rank(comfyui):
    import comfy.model_management as mm
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.rank_workers import RankWorkers
    from headroom.training.core.run_dir import RunDir

    model, _, _, latents, texts = _data("sd15")
    common = {"rank": 4, "lr": 5e-3, "batch_size": 4}
    one = _init(model, latents, texts, "one_device", **common)  # built before the process group: trains alone
    two = _init(model, latents, texts, "two_devices", devices="2", **common)
    workers = two.ranks
    assert workers is RankWorkers.active and len(workers.processes) == 1 and two.trainer.parallel.world_size == 2
    assert one.trainer.parallel is None
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(one, 3)
        T.HeadroomTrainSteps.execute(two, 3)
    assert two.step == 3 and workers.replies() == {1: ("trained", 3)}
    # rank 0 alone writes the run's curves (training/core/scalar_log.py): one events file, not one per rank
    assert len(list((RunDir(T.runs_root(), "two_devices").path / "tensorboard").iterdir())) == 1
    _close_enough(two.adapters.state_dict(), one.adapters.state_dict())  # the same global batch (Adam: 1e-3)
    assert two.trainer.last_loss == pytest.approx(one.trainer.last_loss, rel=1e-4)

    # Cancel inside rank 0's forward (ComfyUI's ops raise the interrupt there): the worker, waiting in that step's
    # loss all-reduce, learns of it through the abort flag and discards the step; both stop at step 3.
    _cancel_inside_rank_0s_forward(model, lambda: T.HeadroomTrainSteps.execute(two, 10))
    assert two.step == 3 and workers.replies() == {1: ("stopped", 3)}
    assert RunDir(T.runs_root(), "two_devices").latest_step() == 3
    with torch.inference_mode():  # the aborted step left nothing behind: still the one-device run's weights
        T.HeadroomTrainSteps.execute(one, 5)
        T.HeadroomTrainSteps.execute(two, 5)
    assert workers.replies() == {1: ("trained", 5)}
    _close_enough(two.adapters.state_dict(), one.adapters.state_dict())

    def interrupt_at_step_7():
        while two.step < 7:
            threading.Event().wait(0.01)
        mm.interrupt_current_processing(True)

    watcher = threading.Thread(target=interrupt_at_step_7)
    watcher.start()
    try:
        with torch.inference_mode(), pytest.raises(mm.InterruptProcessingException):
            T.HeadroomTrainSteps.execute(two, 500)
    finally:
        watcher.join()
        mm.interrupt_current_processing(False)
    stopped_at = two.step
    assert 7 <= stopped_at < 500
    assert workers.replies() == {1: ("stopped", stopped_at)}  # the worker stopped at the same completed step
    assert RunDir(T.runs_root(), "two_devices").latest_step() == stopped_at
    with torch.inference_mode():  # both ranks go on from there
        T.HeadroomTrainSteps.execute(two, stopped_at + 2)
    assert two.step == stopped_at + 2 and workers.replies() == {1: ("trained", stopped_at + 2)}

    workers.close()
    assert workers.processes[0].returncode == 0 and RankWorkers.active is None
    assert not torch.distributed.is_initialized()


def test_devices_2_leaves_no_folder_and_keeps_the_authkey_off_the_command_line(comfyui):
    """The worker's command line is readable by every local user (ps, /proc/PID/cmdline): the multiprocessing
    authkey (which lets a process send this one pickles) travels through the worker's stdin. The folder of the
    socket the workers connect through is gone once they are connected."""
    import multiprocessing
    import os

    from headroom.nodes.bridge.rank_workers import RankWorkers

    model, _, _, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "devices_leftovers", devices="2", rank=4, batch_size=4)
    workers = run.ranks
    try:
        authkey = multiprocessing.current_process().authkey
        with open(f"/proc/{workers.processes[0].pid}/cmdline", "rb") as cmdline:
            seen = cmdline.read()
        assert authkey.hex().encode() not in seen and authkey not in seen, seen
        socket_folder = os.path.dirname(workers.processes[0].args[2])  # this run's (other workers may run others)
        assert os.path.basename(socket_folder).startswith("headroom-ranks-"), workers.processes[0].args
        assert not os.path.exists(socket_folder), "the socket folder outlived the workers' connect"
    finally:
        workers.close()
    assert RankWorkers.active is None


def test_devices_2_a_killed_worker_fails_the_run_cleanly_with_its_checkpoint(comfyui):
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.rank_workers import RankWorkers
    from headroom.training.core.run_dir import RunDir

    model, _, _, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "killed_worker", devices="2", rank=4, lr=5e-3, batch_size=4)
    workers = run.ranks

    def kill_at_step_3():
        while run.step < 3:
            threading.Event().wait(0.01)
        workers.processes[0].kill()

    killer = threading.Thread(target=kill_at_step_3)
    killer.start()
    try:
        with torch.inference_mode(), pytest.raises(RuntimeError, match="rank 1"):
            T.HeadroomTrainSteps.execute(run, 500, checkpoint_every=1)
    finally:
        killer.join()
    assert 3 <= run.step < 500 and RunDir(T.runs_root(), "killed_worker").latest_step() == run.step
    assert workers.closed and RankWorkers.active is None and not torch.distributed.is_initialized()
    with torch.inference_mode(), pytest.raises(ValueError, match="worker ranks were closed"):
        T.HeadroomTrainSteps.execute(run, run.step + 1)


def _close_enough(trained: dict, reference: dict) -> None:
    """The same global batch on 1 or 2 ranks: the same weights, within what Adam makes of the summation order. Adam
    divides each element's gradient by its own running RMS, so an element whose gradient is ~0 steps by up to the
    learning rate on rounding noise alone (torch 2.8's all-reduce moved one norm bias of 64 by 2 %): a tensor may hold
    a few such elements (1 in 100), and is whole within 1e-2 of its norm; every other element within 1e-3 of its
    largest."""
    assert trained.keys() == reference.keys()
    for key, value in reference.items():
        difference = (trained[key] - value).abs()
        assert difference.norm() <= 1e-2 * value.norm().clamp_min(1e-12), key
        apart = int((difference > 1e-3 * value.abs().max().clamp_min(1e-12)).sum())
        assert apart <= max(1, value.numel() // 100), (key, apart, value.numel())


def test_devices_2_on_the_all_in_one_node_trains_like_one_device(comfyui):
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute("lora", 4, 4.0, "preset", False, 0.0, 0).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", 5e-3, 0.0, "constant", 0, 100).args[0]
    inputs = dict(model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt, seed=0,
                  batch_size=4, grad_accumulation=1, precision="fp32", max_grad_norm=1.0, caption_dropout=0.0,
                  timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0, noise_offset=0.0,
                  gradient_checkpointing=False, checkpoint_depth=1, holdout=0, steps=4, validate_every=2, save_every=0,
                  lora_subfolder="headroom-tests", clip=clip, vae=vae, prompts="a shape", negative="", sample_seed=0,
                  sample_steps=1, cfg=1.0, sampler_name="euler", scheduler="simple", width=32, height=32)
    with torch.inference_mode():
        _, one, _, one_loss, _ = T.HeadroomTrainLora.execute(run_name="all_in_one_1", **inputs).args
        # Trains to 2, validates on rank 0 while the worker waits, trains on to 4, validates and saves.
        _, two, saved, two_loss, _ = T.HeadroomTrainLora.execute(run_name="all_in_one_2", devices="2", **inputs).args
    workers = two.ranks
    assert one.ranks is None and workers is not None and two.trainer.parallel.world_size == 2
    assert two.step == 4 and workers.replies() == {1: ("trained", 4)} and saved.endswith("all_in_one_2_step000004.safetensors")
    _close_enough(two.adapters.state_dict(), one.adapters.state_dict())
    assert two.trainer.last_loss == pytest.approx(one.trainer.last_loss, rel=1e-4)
    assert two_loss == pytest.approx(one_loss, rel=1e-3)  # rank 0's validation of the same weights
    workers.close()
    assert workers.processes[0].returncode == 0


def test_controlnet_devices_2_trains_like_one_device_and_cancel_stops_every_rank(comfyui):
    from headroom.nodes import train_lora as T
    from headroom.nodes.train_controlnet import HeadroomTrainControlNetInit
    from headroom.training.core.run_dir import RunDir
    from test_controlnet_training import _caches, _init_inputs

    model, _, _, latent_cache, text_cache = _caches("sd15", count=4)
    with torch.inference_mode():
        one = HeadroomTrainControlNetInit.execute(**_init_inputs(model, latent_cache, text_cache, "cn_one_device",
                                                                 batch_size=4)).args[0]
        two = HeadroomTrainControlNetInit.execute(**_init_inputs(model, latent_cache, text_cache, "cn_two_devices",
                                                                 batch_size=4, devices="2")).args[0]
    workers = two.ranks
    assert workers is not None and two.trainer.parallel.world_size == 2 and one.trainer.parallel is None
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(one, 3)
        T.HeadroomTrainSteps.execute(two, 3)
    assert two.step == 3 and workers.replies() == {1: ("trained", 3)}
    _close_enough(two.controlnet.state_dict(), one.controlnet.state_dict())
    assert two.trainer.last_loss == pytest.approx(one.trainer.last_loss, rel=1e-4)

    _cancel_inside_rank_0s_forward(model, lambda: T.HeadroomTrainSteps.execute(two, 10))
    assert two.step == 3 and workers.replies() == {1: ("stopped", 3)}
    assert RunDir(T.runs_root(), "cn_two_devices").latest_step() == 3
    with torch.inference_mode():  # both ranks go on, still the one-device run's ControlNet
        T.HeadroomTrainSteps.execute(one, 5)
        T.HeadroomTrainSteps.execute(two, 5)
    assert workers.replies() == {1: ("trained", 5)}
    _close_enough(two.controlnet.state_dict(), one.controlnet.state_dict())
    workers.close()
    assert workers.processes[0].returncode == 0 and not torch.distributed.is_initialized()


@pytest.mark.parametrize("where", ["inside its forward", "before its step"])
def test_devices_2_a_worker_error_fails_the_run_naming_it_with_its_checkpoint(comfyui, monkeypatch, where):
    """An ordinary error in the worker (test hooks of rank_workers, set through the environment the worker
    inherits), inside its forward (after the step's first collective could start) or as its step starts (before
    any: DataParallel.leave): rank 0, waiting in the step's loss all-reduce, learns of it through the abort flag;
    the run fails naming rank 1 and the error, with the last checkpoint kept, without waiting for a timeout."""
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.rank_workers import TEST_ERROR_AT_STEP, TEST_ERROR_BEFORE_STEP
    from headroom.training.core.run_dir import RunDir

    variable, message = ((TEST_ERROR_AT_STEP, "a test error inside this rank's forward") if where.startswith("inside")
                         else (TEST_ERROR_BEFORE_STEP, "a test error before this rank's step"))
    monkeypatch.setenv(variable, "3")
    model, _, _, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "worker_error", devices="2", rank=4, lr=5e-3, batch_size=4)
    workers = run.ranks
    with torch.inference_mode(), pytest.raises(RuntimeError, match=rf"rank 1 failed in step 3: RuntimeError: "
                                               rf"{variable}=3: {message}"):
        T.HeadroomTrainSteps.execute(run, 6, checkpoint_every=1)
    assert run.step == 2 and RunDir(T.runs_root(), "worker_error").latest_step() == 2
    assert workers.replies()[1][:2] == ("failed", 2) and not workers.closed  # the worker is alive and answers
    workers.close()
    assert workers.processes[0].returncode == 0 and not torch.distributed.is_initialized()


def test_devices_2_rank_0_failing_between_steps_stops_the_worker_at_the_same_step(comfyui):
    """Rank 0 fails as step 3 starts, before its first collective (here: reading its batch; in use: a checkpoint
    save, loading the model): the worker, already in step 3's loss all-reduce, is told through the abort flag and
    stops at step 2 (DataParallel.leave) instead of being ended after the stop timeout: it stays up, and the next
    Train Steps trains on both ranks."""
    from headroom.nodes import train_lora as T
    from headroom.training.core.run_dir import RunDir

    model, _, _, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "rank0_error", devices="2", rank=4, lr=5e-3, batch_size=4)
    workers, batch_items = run.ranks, run.trainer.batch_items

    def failing_batch_items(index):
        if run.step + 1 == 3:
            raise RuntimeError("rank 0's test error before its step")
        return batch_items(index)

    run.trainer.batch_items = failing_batch_items
    with torch.inference_mode(), pytest.raises(RuntimeError, match="rank 0's test error before its step"):
        T.HeadroomTrainSteps.execute(run, 6, checkpoint_every=1)
    assert run.step == 2 and RunDir(T.runs_root(), "rank0_error").latest_step() == 2
    assert workers.replies() == {1: ("stopped", 2)} and not workers.closed  # told, not ended by the timeout
    run.trainer.batch_items = batch_items
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 4)
    assert run.step == 4 and workers.replies() == {1: ("trained", 4)}
    workers.close()
    assert workers.processes[0].returncode == 0 and not torch.distributed.is_initialized()


def test_controlnet_all_in_one_node_on_devices_2_trains_validates_and_saves(comfyui):
    import folder_paths
    from headroom.nodes.train_controlnet import HeadroomTrainControlNet
    from test_controlnet_training import _caches, _init_inputs

    model, clip, vae, latent_cache, text_cache = _caches("sd15", count=4)
    control = torch.ones(1, 64, 64, 3)  # rank 0's alone (validation); the worker is not sent it
    with torch.inference_mode():
        _, run, saved, loss = HeadroomTrainControlNet.execute(
            **_init_inputs(model, latent_cache, text_cache, "cn_all_in_one_2", batch_size=4, devices="2",
                           validation_control=control),
            steps=2, validate_every=0, save_every=0, controlnet_subfolder="headroom-tests", clip=clip, vae=vae,
            prompts="a shape", negative="", sample_seed=0, sample_steps=1, cfg=1.0, sampler_name="euler",
            scheduler="normal", width=64, height=64, loss_timesteps=2).args
    workers = run.ranks
    assert run.step == 2 and workers.replies() == {1: ("trained", 2)} and run.trained.validation_control is control
    assert saved in folder_paths.get_filename_list("controlnet") and loss == loss
    workers.close()
    assert workers.processes[0].returncode == 0


def _cancel_inside_rank_0s_forward(model, train) -> None:
    """`train()` with a cancel raised inside rank 0's forward pass, where ComfyUI's ops raise the interrupt."""
    import comfy.model_management as mm

    def interrupt_inside_forward(module, args):
        mm.interrupt_current_processing(True)

    hook = model.model.diffusion_model.register_forward_pre_hook(interrupt_inside_forward)
    try:
        with torch.inference_mode(), pytest.raises(mm.InterruptProcessingException):
            train()
    finally:
        hook.remove()
        mm.interrupt_current_processing(False)


def test_devices_2_full_fine_tune_shards_its_optimizer_state_and_cancel_keeps_it_whole(comfyui):
    """A full fine-tune on 2 devices: each rank keeps the optimizer state of its share of the weights
    (training/memory/sharded_optimizer.py) and the run trains like one device; after a cancel inside rank 0's forward
    both ranks gather the state, so the checkpoint rank 0 keeps holds all of it (a 1-device run resumes it)."""
    from headroom.nodes import train_lora as T
    from headroom.training.core.run_dir import RunDir
    from headroom.training.memory.sharded_optimizer import local_optimizer

    model, _, _, latents, texts = _data("sd15")
    common = {"kind": "full", "lr": 1e-4, "batch_size": 4}
    one = _init(model, latents, texts, "full_one_device", **common)
    two = _init(model, latents, texts, "full_two_devices", devices="2", **common)
    workers = two.ranks
    assert two.trainer.sharded and not one.trainer.sharded
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(one, 3)
        T.HeadroomTrainSteps.execute(two, 3)
    assert workers.replies() == {1: ("trained", 3)}
    _close_enough(two.adapters.state_dict(), one.adapters.state_dict())
    held = len(local_optimizer(two.trainer.optimizer).state)
    assert 0 < held < len(one.trainer.optimizer.state) == len(one.trainer.params)
    # what the run tells ComfyUI it adds on the device: its share of the state
    assert two.trained.device_extra_bytes(two.trainer) < one.trained.device_extra_bytes(one.trainer)

    _cancel_inside_rank_0s_forward(model, lambda: T.HeadroomTrainSteps.execute(two, 10))
    assert two.step == 3 and workers.replies() == {1: ("stopped", 3)}
    saved = RunDir(T.runs_root(), "full_two_devices").load_checkpoint()
    assert saved.step == 3 and len(saved.optimizer["state"]) == len(one.trainer.params)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(one, 5)
        T.HeadroomTrainSteps.execute(two, 5)
    assert workers.replies() == {1: ("trained", 5)}
    _close_enough(two.adapters.state_dict(), one.adapters.state_dict())
    workers.close()
    assert workers.processes[0].returncode == 0
    resumed = _init(model, latents, texts, "full_two_devices", **common)  # the same run on one device
    assert resumed.step == 5 and not resumed.trainer.sharded
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(resumed, 6)
        T.HeadroomTrainSteps.execute(one, 6)
    _close_enough(resumed.adapters.state_dict(), one.adapters.state_dict())
