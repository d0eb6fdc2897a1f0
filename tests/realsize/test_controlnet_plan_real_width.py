"""A ControlNet run's planned activations at real width: SD1.5's whole UNet (the cldm ControlNet copies its encoder,
its hint encoder runs at the image's pixel size) and SD3.5-Large at its width (2432, 2 joint blocks, the ControlNet
copying the first), built from ComfyUI's own classes with random weights (tests/realsize_models.py), cached and
opened through the nodes. The plan (its own step's calibration, planning._ControlNetStep) against what the run's
training forward keeps for backward (family_checks.controlnet_plan_over_step), without checkpointing and with every
block checkpointed. The tiny models' check: tests/comfy/test_controlnet_training.py; the step times:
bench/bench_step_prediction.py --kind controlnet."""
from __future__ import annotations

import json
import time

import pytest
import torch

pytestmark = [pytest.mark.comfyui, pytest.mark.realsize]


def _controlnet_run(arch: str, depth, precision: str = "fp32", **init_inputs):
    """(model, clip, vae, control images, run): a ControlNet run opened through the nodes on one synthetic image
    cached with its control, at real width."""
    import realsize_models
    from headroom.nodes import cache as cache_nodes, data as data_nodes
    from headroom.nodes.bridge.families import controlnet_type_of
    from headroom.nodes.train_controlnet import HeadroomTrainControlNetInit
    from headroom.nodes.train_lora import HeadroomOptimizerConfig

    model, clip, vae = realsize_models.build_family(arch, depth)
    with torch.inference_mode():  # as ComfyUI runs nodes
        images, captions, controls = data_nodes.HeadroomSyntheticDataset.execute(1, 64, 0).args
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, captions, 64, 64, "center", False, 0,
                                                                control_images=controls).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae, controlnet_type_of(model).hint).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
        optimizer = HeadroomOptimizerConfig.execute("AdamW", 1e-4, 0.0, "constant", 0, 1000).args[0]
        run = HeadroomTrainControlNetInit.execute(
            model=model, latent_cache=latents, text_cache=texts, optimizer_config=optimizer,
            run_name=f"controlnet_plan_{arch}_{time.time_ns()}", seed=0, batch_size=1, grad_accumulation=1,
            precision=precision, max_grad_norm=1.0, caption_dropout=0.0, timestep_sampling="uniform",
            loss_weighting="none", min_snr_gamma=5.0, noise_offset=0.0, gradient_checkpointing=False,
            checkpoint_depth=1, holdout=0, **init_inputs).args[0]
    return model, clip, vae, controls, run


@pytest.mark.parametrize("arch, depth", [("sd15", None), ("sd35_large", 2)])
def test_a_controlnet_runs_plan_counts_what_its_step_keeps_at_real_width(comfyui, arch, depth):
    from family_checks import controlnet_plan_over_step

    *_, run = _controlnet_run(arch, depth)
    try:
        for checkpointing, (planned, kept) in controlnet_plan_over_step(run).items():
            print(f"{arch}, checkpointing {checkpointing}: planned {planned / 2 ** 20:.1f} MiB, the step keeps "
                  f"{kept / 2 ** 20:.1f} MiB ({planned / kept:.3f}x)")
            assert planned == pytest.approx(kept, rel=0.1), (checkpointing, planned, kept)
    finally:
        run.release()


def test_a_bf16_controlnet_trains_plans_and_loads_in_the_stock_nodes_at_real_width(comfyui, monkeypatch):
    """controlnet_precision bf16_stochastic (the SDXL and Flux templates' setting) at SD3.5-Large's width: the
    ControlNet's weights bf16, stepped with stochastic rounding by fused backward (tensors of 2432 x 9728 = 23.7 M
    elements, past a float32's 2^24), its activations planned as its bf16 step keeps them, its trainable bytes half
    an fp32 one's; saved in bf16, the stock ControlNetLoader's module gives the in-memory one's control output (a CPU
    computes bf16 weights in fp32: the stock module holds them upcast, the in-memory one casts them). Its step's
    activations planned as a card's plan measures them before the run opens: a new ControlNet of the run's blocks,
    bf16 as the run's (planning.NewControlNet; an fp32 one keeps its weights' bf16 casts for backward: measured so,
    the step without checkpointing was planned at 548 MiB, 5.0x the 110 MiB it keeps). The Memory Plan node's kind
    controlnet measures it so: its measurement is the one checked (one calibration at this width: ~40 s here)."""
    import folder_paths
    import nodes
    from family_checks import controlnet_plan_over_step
    from headroom.nodes.bridge import planning
    from headroom.nodes.bridge.controlnet_build import controlnet_trainable
    from headroom.nodes.memory import HeadroomMemoryPlan
    from headroom.nodes.train_controlnet import HeadroomSaveControlNet
    from headroom.nodes.train_lora import HeadroomTrainSteps
    from headroom.training.memory.policy import OffloadPolicy

    model, clip, vae, controls, run = _controlnet_run("sd35_large", 2, "bf16", controlnet_precision="bf16_stochastic",
                                                      policy=OffloadPolicy(fused_backward=True))
    try:
        before = run.controlnet.state_dict()
        # (the image stream's: the last block's text stream feeds nothing, so its MLP gets no gradient)
        largest = max((k for k in before if ".x_block." in k), key=lambda k: before[k].numel())
        assert before[largest].numel() > 2 ** 24 and all(t.dtype == torch.bfloat16 for t in before.values())
        spec = controlnet_trainable(model, 0, "AdamW", torch.bfloat16)
        assert 2 * spec.weight_bytes() == controlnet_trainable(model, 0, "AdamW").weight_bytes()
        assert spec.weight_bytes() == sum(t.numel() * 2 for t in run.trainer.params)
        # The Memory Plan node's kind controlnet plans the same tensors (before any cache exists), measuring a new
        # ControlNet of the run's blocks and dtype as the Init node's card plan measures it before the run opens
        describe, measured = planning.describe_comfy_model, []
        monkeypatch.setattr(planning, "describe_comfy_model",
                            lambda *a, **k: measured.append((k["controlnet"], describe(*a, **k))) or measured[-1][1])
        plan = json.loads(HeadroomMemoryPlan.execute(
            model, "estimate", 1, 64, 64, 16, "preset", "AdamW", "bf16", 0, policy=OffloadPolicy(fused_backward=True),
            kind="controlnet", trained_precision="bf16_stochastic", controlnet_blocks=run.config.blocks).args[1])
        items = next(p for p in plan["phases"] if p["phase"] == "training step")["items"]
        assert items["trainable weights (bf16)"] == spec.weight_bytes()
        [(new, measured)] = measured
        assert new == planning.NewControlNet(run.config.blocks, torch.bfloat16) and run.config.dtype == torch.bfloat16
        for checkpointing, (planned, kept) in controlnet_plan_over_step(run, measured).items():
            print(f"bf16 ControlNet, checkpointing {checkpointing}: planned {planned / 2 ** 20:.1f} MiB, the step "
                  f"keeps {kept / 2 ** 20:.1f} MiB ({planned / kept:.3f}x)")
            assert planned == pytest.approx(kept, rel=0.1), (checkpointing, planned, kept)
        with torch.inference_mode():
            HeadroomTrainSteps.execute(run, 2)
        after = run.controlnet.state_dict()
        assert all(t.dtype == torch.bfloat16 for t in after.values())
        moved = (after[largest] != before[largest]).float().mean().item()
        print(f"{largest}: {moved:.1%} of its {before[largest].numel()} elements moved in 2 steps")
        assert 0.01 < moved, "stochastic rounding moves a share of the elements an fp32 step would change"
        assert all(torch.isfinite(torch.tensor(loss)) for _, loss in run.trainer.loss_history)

        name = HeadroomSaveControlNet.execute(run, "headroom-tests", "").args[0]
        x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            positive = nodes.CLIPTextEncode().encode(clip, "a red circle")[0]
            hint = controls[:1]  # SD3's ControlNet VAE-encodes its control image (get_control)
            outputs = []
            for control in (run.trained.comfy_controlnet(), nodes.ControlNetLoader().load_controlnet(name)[0]):
                control = control.copy().set_cond_hint(hint.movedim(-1, 1), 1.0, vae=vae)
                control.pre_run(model.model, model.model.model_sampling.percent_to_sigma)
                cond = {"c_crossattn": positive[0][0], "y": positive[0][1]["pooled_output"]}
                outputs.append(control.get_control(x, torch.tensor([0.5]), cond, 1, {}))
                control.cleanup()
        ours, theirs = outputs
        assert ours.keys() == theirs.keys() and ours["output"]
        assert any(o.abs().max() > 0 for o in ours["output"]), "trained 2 steps: its zero-initialised outputs moved"
        assert all(torch.equal(a, b) for a, b in zip(ours["output"], theirs["output"]))
        assert folder_paths.get_full_path("controlnet", name)
    finally:
        run.release()
