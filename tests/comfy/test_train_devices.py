"""The Init node's `devices` input inside ComfyUI: rank 0 in this process, a worker process for rank 1 (gloo on the
CPU) that gets the frozen base through shared memory; training, cancel and the worker's exit."""
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
    for key, value in one.adapters.state_dict().items():  # the same global batch: the same weights (Adam: 1e-3)
        assert (two.adapters.state_dict()[key] - value).norm() <= 1e-3 * value.norm().clamp_min(1e-12), key
    assert two.trainer.last_loss == pytest.approx(one.trainer.last_loss, rel=1e-4)

    # Cancel inside rank 0's forward (ComfyUI's ops raise the interrupt there): the worker, waiting in that step's
    # loss all-reduce, learns of it through the abort flag and discards the step; both stop at step 3.
    def interrupt_inside_forward(module, args):
        mm.interrupt_current_processing(True)

    hook = model.model.diffusion_model.register_forward_pre_hook(interrupt_inside_forward)
    try:
        with torch.inference_mode(), pytest.raises(mm.InterruptProcessingException):
            T.HeadroomTrainSteps.execute(two, 10)
    finally:
        hook.remove()
        mm.interrupt_current_processing(False)
    assert two.step == 3 and workers.replies() == {1: ("stopped", 3)}
    assert RunDir(T.runs_root(), "two_devices").latest_step() == 3
    with torch.inference_mode():  # the aborted step left nothing behind: still the one-device run's weights
        T.HeadroomTrainSteps.execute(one, 5)
        T.HeadroomTrainSteps.execute(two, 5)
    assert workers.replies() == {1: ("trained", 5)}
    for key, value in one.adapters.state_dict().items():
        assert (two.adapters.state_dict()[key] - value).norm() <= 1e-3 * value.norm().clamp_min(1e-12), key

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
