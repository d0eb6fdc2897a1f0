"""EMA of the trainable weights: the closed-form average, resumed exactly, chosen for validation and saving."""
from __future__ import annotations

import shutil

import pytest
import torch

from headroom.training.core.ema import WeightEMA


def test_weight_ema_is_the_closed_form_average():
    decay = 0.8
    param = torch.nn.Parameter(torch.zeros(3, 2))
    ema = WeightEMA([param], decay)
    values = [torch.randn(3, 2, generator=torch.Generator().manual_seed(t)) for t in range(1, 8)]
    for value in values:
        param.data.copy_(value)
        ema.update([param])
    steps = len(values)
    expected = decay ** steps * torch.zeros(3, 2) + sum((1 - decay) * decay ** (steps - t) * v
                                                         for t, v in enumerate(values, start=1))
    torch.testing.assert_close(ema.averaged[0], expected, rtol=1e-6, atol=1e-7)
    with ema.swapped_in([param]):
        assert torch.equal(param.data, ema.averaged[0])
    assert torch.equal(param.data, values[-1])  # the trained value is back


def test_bad_decay_is_refused():
    with pytest.raises(ValueError, match=r"ema_decay=1.0 must be in \(0, 1\)"):
        WeightEMA([torch.nn.Parameter(torch.zeros(1))], 1.0)


@pytest.mark.comfyui
def test_node_run_keeps_the_closed_form_ema_resumes_it_and_saves_it(comfyui):
    import nodes
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from test_train_lora_nodes import _data, _init

    decay = 0.7
    model, clip, vae, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "ema_closed_form", rank=4, lr=2e-2, ema_decay=decay)
    states = [run.adapters.state_dict()]
    with torch.inference_mode():
        for step in range(1, 5):
            T.HeadroomTrainSteps.execute(run, step)
            states.append(run.adapters.state_dict())
    names = list(states[0])
    steps = len(states) - 1
    for index, name in enumerate(names):
        expected = decay ** steps * states[0][name] + sum(
            (1 - decay) * decay ** (steps - t) * states[t][name] for t in range(1, steps + 1))
        torch.testing.assert_close(run.trainer.ema.averaged[index], expected, rtol=1e-5, atol=1e-7)

    # Save: auto = the EMA; the trained weights are back afterwards.
    trained = run.adapters.state_dict()
    with torch.inference_mode():
        ema_name = T.HeadroomSaveLora.execute(run, "ema", "ema_auto", "fp32").args[0]
        trained_name = T.HeadroomSaveLora.execute(run, "ema", "ema_trained", "fp32", "comfyui", "trained").args[0]
    after = run.adapters.state_dict()
    assert all(torch.equal(trained[k], after[k]) for k in trained)
    with run.weights("ema"):
        ema_state = run.adapters.comfy_state_dict()
    import comfy.utils
    import folder_paths
    saved = comfy.utils.load_torch_file(folder_paths.get_full_path_or_raise("loras", ema_name), safe_load=True)
    assert all(torch.equal(saved[k], ema_state[k]) for k in ema_state)
    saved_trained = comfy.utils.load_torch_file(folder_paths.get_full_path_or_raise("loras", trained_name), safe_load=True)
    assert any(not torch.equal(saved_trained[k], saved[k]) for k in saved if k.endswith("lora_up.weight"))
    with torch.inference_mode():
        lora_model, _ = nodes.LoraLoader().load_lora(model, clip, ema_name, 1.0, 0.0)
    assert len(lora_model.patches) == len(run.adapters.layers)

    # Validation on the EMA leaves the trained weights in place, and the next step continues from them.
    with torch.inference_mode():
        T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts="", negative="", sample_seed=0, sample_steps=1,
                                   cfg=1.0, sampler_name="euler", scheduler="normal", width=32, height=32,
                                   loss_timesteps=1, weights="ema")
    assert all(torch.equal(trained[k], v) for k, v in run.adapters.state_dict().items())

    # Restart: the EMA comes back from the checkpoint and continues exactly as a straight run's.
    ema_at_4 = [t.clone() for t in run.trainer.ema.averaged]
    restarted_model, _, _ = build_tiny_models("sd15", 0)
    resumed = _init(restarted_model, latents, texts, "ema_closed_form", rank=4, lr=2e-2, ema_decay=decay)
    assert resumed.step == 4 and all(torch.equal(a, b) for a, b in zip(resumed.trainer.ema.averaged, ema_at_4))
    straight = _init(model, latents, texts, "ema_straight", rank=4, lr=2e-2, ema_decay=decay)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(resumed, 6)
        T.HeadroomTrainSteps.execute(straight, 6)
    ra, sa = resumed.adapters.state_dict(), straight.adapters.state_dict()
    assert all(torch.equal(ra[k], sa[k]) for k in ra)  # the checkpoint saved by validation holds the trained weights
    assert all(torch.equal(a, b) for a, b in zip(resumed.trainer.ema.averaged, straight.trainer.ema.averaged))


@pytest.mark.comfyui
def test_ema_choices_that_cannot_work_are_refused(comfyui):
    from headroom.nodes import train_lora as T
    from test_train_lora_nodes import _data, _init

    model, clip, vae, latents, texts = _data("sd15")
    plain = _init(model, latents, texts, "ema_none", rank=4)
    with pytest.raises(ValueError, match=r"weights=ema: run 'ema_none' keeps no EMA; set ema_decay"):
        T.HeadroomSaveLora.execute(plain, "ema", "x", "fp32", "comfyui", "ema")
    with pytest.raises(ValueError, match=r"ema_decay=1.5"):
        _init(model, latents, texts, "ema_bad", rank=4, ema_decay=1.5)
    run = _init(model, latents, texts, "ema_lost", rank=4, ema_decay=0.9)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 2)
    for ema_file in run.run_dir.path.glob("checkpoints/step_*/ema.safetensors"):
        ema_file.unlink()  # as a checkpoint written without it
    del run
    with pytest.raises(ValueError, match=r"Train LoRA: Init \(Headroom\): the saved checkpoint of step 2 cannot be loaded "
                                         r"\(it holds no EMA weights"):
        _init(model, latents, texts, "ema_lost", rank=4, ema_decay=0.9)
    shutil.rmtree(plain.run_dir.path, ignore_errors=True)
