"""Loss types on the training nodes (tiny sd15, in-process, CPU): l1 / huber train and are what the trainer
reports, a run keeps its loss type, and a run folder written before the option existed still resumes."""
from __future__ import annotations

import json

import pytest
import torch

from test_train_lora_nodes import _data, _init

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("loss_type", ["l1", "huber"])
def test_l1_and_huber_runs_learn_and_differ_from_mse(comfyui, loss_type):
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15", count=4)
    common = dict(rank=8, include_conv=True, lr=1e-2)
    runs = {kind: _init(model, latents, texts, f"loss_{loss_type}_{kind}", loss_type=kind, **common)
            for kind in ("mse", loss_type)}
    with torch.inference_mode():
        initial = runs[loss_type].loss_on(runs[loss_type].train_items)
        for run in runs.values():
            T.HeadroomTrainSteps.execute(run, 60)
        final = runs[loss_type].loss_on(runs[loss_type].train_items)
    stored = json.loads((runs[loss_type].run_dir.path / "config.json").read_text())
    assert stored["session"]["train"]["objective"]["loss_type"] == loss_type
    a, b = runs["mse"].adapters.state_dict(), runs[loss_type].adapters.state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a), "the loss type changed nothing"
    print(f"{loss_type}: validation-style loss on the training items {initial:.4f} -> {final:.4f} after 60 steps")
    assert final < 0.8 * initial  # the squared-error loss falls under an l1 / huber objective too


def test_a_run_stored_before_loss_types_resumes_and_a_changed_loss_type_is_refused(comfyui):
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "loss_stored_before", rank=4)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 2)
    config_path = run.run_dir.path / "config.json"
    stored = json.loads(config_path.read_text())
    objective = stored["session"]["train"]["objective"]
    del objective["loss_type"], objective["huber_delta"]  # as a run written by an earlier version
    config_path.write_text(json.dumps(stored))
    del run

    resumed = _init(model, latents, texts, "loss_stored_before", rank=4)
    assert resumed.resumed and resumed.step == 2
    with pytest.raises(ValueError, match=r"session\.train\.objective\.loss_type: stored 'mse', now 'huber'"):
        _init(model, latents, texts, "loss_stored_before", rank=4, loss_type="huber")
