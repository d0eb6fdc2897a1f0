"""The offload policy and memory plan nodes, in-process with the real ComfyUI and the tiny models."""
from __future__ import annotations

import json
import sys

import pytest
import torch

pytestmark = pytest.mark.comfyui
FAMILIES = ["sd15", "sd2", "sdxl", "sd3", "flux", "flux2", "chroma", "zimage", "qwen_image", "hidream", "hunyuan_image",
            "krea2", "hidream_o1", "ideogram4", "ltx2"]


def _policy(**overrides):
    from headroom.nodes.memory import HeadroomOffloadPolicy

    inputs = dict(vram_budget_gb=0.0, reserve_gb=1.0, base_placement="resident", base_storage="as_loaded",
                  checkpointing="off", checkpoint_depth=1, optimizer_state="gpu",
                  park_optimizer_during_validation=True, vae_tiled_decode="auto", encoders="unload_after_use")
    return HeadroomOffloadPolicy.execute(**{**inputs, **overrides})


def _plan(model, **overrides):
    from headroom.nodes.memory import HeadroomMemoryPlan

    inputs = dict(mode="estimate", batch_size=1, width=64, height=64, rank=4, targets="preset", optimizer="AdamW",
                  precision="fp32", text_tokens=0)
    return HeadroomMemoryPlan.execute(model, **{**inputs, **overrides})


def test_policy_node_outputs_the_policy_and_rejects_bad_combinations(comfyui, headroom_nodes):
    from headroom.training.memory.policy import OffloadPolicy

    output = _policy(vram_budget_gb=6.0, base_placement="streamed", checkpointing="blocks_cpu_offload")
    policy = output.result[0]
    assert isinstance(policy, OffloadPolicy)
    assert (policy.vram_budget_gb, policy.base_placement, policy.checkpointing) == (6.0, "streamed", "blocks_cpu_offload")
    assert _policy().result[0].budget_is_auto
    with pytest.raises(ValueError, match=r"Offload Policy \(Headroom\): .*needs checkpointing"):
        _policy(base_placement="partial")
    ids = {node.define_schema().node_id for node in headroom_nodes.memory.NODES}
    assert ids == {"HeadroomOffloadPolicy", "HeadroomMemoryPlan"}


@pytest.mark.parametrize("storage", ["int8", "nf4"])
def test_policy_node_names_bitsandbytes_when_a_storage_needs_it(comfyui, monkeypatch, storage):
    """bitsandbytes is optional: the policy node says so when int8 / nf4 is chosen without it, not the run."""
    from headroom.training.checks import MissingPackageError

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed
    with pytest.raises(MissingPackageError, match=rf"Offload Policy \(Headroom\): offload policy base_storage '{storage}' "
                       r"needs the pip package 'bitsandbytes'.*python -m pip install bitsandbytes"):
        _policy(base_storage=storage)
    assert _policy(base_storage="fp8").result[0].base_storage == "fp8"


def test_policy_node_inputs_are_the_policy_fields(comfyui):
    """Every OffloadPolicy field is a node input, in field order, with the field's default (the budget's "auto" is
    the node's 0), its combo options and tooltip, and every node input is a field; the node's defaults give the
    default policy."""
    import dataclasses

    from headroom.nodes.memory import HeadroomOffloadPolicy
    from headroom.training.memory.policy import OffloadPolicy

    info = HeadroomOffloadPolicy.GET_NODE_INFO_V1()  # as ComfyUI's /object_info serves it
    required = {**info["input"]["required"], **info["input"]["optional"]}
    assert set(info["input"]) == {"required", "optional"}
    fields = dataclasses.fields(OffloadPolicy)
    # Appended inputs are optional: a workflow saved before them has none and gets the field's default.
    assert [*info["input_order"]["required"], *info["input_order"]["optional"]] == [f.name for f in fields]
    assert list(info["input_order"]["optional"]) == [f.name for f in fields if f.metadata["node_input"].optional]
    types = {"float": "FLOAT", "int": "INT", "bool": "BOOLEAN", "combo": "COMBO", "string": "STRING"}
    for f in fields:
        spec = f.metadata["node_input"]
        kind, options = required[f.name]
        assert kind == types[spec.kind], f.name
        assert spec.field_value(options["default"]) == f.default, f.name
        assert options["tooltip"] == spec.tooltip, f.name
        if spec.kind == "combo":
            assert options["options"] == list(spec.options), f.name
        for key in ("min", "max", "step"):
            assert options.get(key) == getattr(spec, key), (f.name, key)
    defaults = {name: options["default"] for name, (_, options) in required.items()}
    assert HeadroomOffloadPolicy.execute(**defaults).result[0] == OffloadPolicy()


def test_auto_budget_is_what_comfyui_can_free_minus_the_reserve(comfyui):
    import comfy.model_management

    from headroom.nodes.bridge.planning import available_device_bytes, budget_bytes
    from headroom.training.memory.policy import GIB, OffloadPolicy

    device = comfy.model_management.get_torch_device()
    available = available_device_bytes(device)
    assert available >= comfy.model_management.get_free_memory(device) - 256 * 2 ** 20  # RAM moves a little
    assert abs(budget_bytes(OffloadPolicy(reserve_gb=2.0), device) - (available - 2 * GIB)) < 256 * 2 ** 20
    assert budget_bytes(OffloadPolicy(vram_budget_gb=3.0), device) == 3 * GIB


def test_policy_node_shows_the_host_ram_the_run_may_use(comfyui):
    from headroom.training.memory.memory_stats import process_rss_bytes

    auto = _policy().ui.as_dict()["text"][0]
    assert "host RAM: " in auto and "(what the OS reports available, less 2 GiB)" in auto
    in_use = float(auto.split("host RAM: ")[1].split(" GiB")[0])
    assert abs(in_use - process_rss_bytes() / 2 ** 30) < 0.5
    given = _policy(host_ram_budget_gb=48.0)
    assert given.result[0].host_ram_budget_gb == 48.0 and "may grow it to 48.00 GiB\n" in given.ui.as_dict()["text"][0] + "\n"


def test_a_policy_to_fit_to_a_card_says_what_the_fit_keeps_not_what_it_replaces(comfyui):
    """Before a run opens, a card's fit has not chosen the placement, checkpointing and optimizer state: the node's
    text said the policy's own (e.g. "base resident/as_loaded, checkpointing off") as if they were in effect."""
    text = _policy(card="this GPU (auto)", fused_backward=True).ui.as_dict()["text"][0].split("\n")
    assert text[0] == ("budget fit to this GPU (auto), base storage as_loaded to start from, a lower one only if "
                       "nothing fits, parked during validation, fused backward"), text
    assert text[-1].startswith("card this GPU (auto): when a training run opens, the planner picks the fastest ")
    fp8 = _policy(card="24 GB", base_storage="fp8", park_optimizer_during_validation=False).ui.as_dict()["text"][0]
    assert fp8.startswith("budget fit to 24 GB, base storage fp8 to start from\n"), fp8
    custom = _policy(vram_budget_gb=8.0).ui.as_dict()["text"][0]  # its settings are what a run uses: said
    assert custom.startswith("budget 8 GiB, base resident/as_loaded, checkpointing off, optimizer state on gpu, "
                             "parked during validation\n"), custom


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_describes_the_real_model_and_leaves_it_unchanged(comfyui, family):
    from headroom.nodes.bridge.comfy_model import training_blocks
    from headroom.nodes.bridge.planning import describe_comfy_model
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.core.adapters import AdapterConfig

    model, clip, vae = build_tiny_models(family)
    dm = model.model.diffusion_model
    before = {k: v.clone() for k, v in dm.state_dict().items()}
    modules_before = [type(m) for m in dm.modules()]
    text, plan_json, policy = _plan(model, vae=vae, clip=clip).result
    plan = json.loads(plan_json)
    assert "training step" in text and plan["peak_bytes"] > 0
    training = next(p for p in plan["phases"] if p["phase"] == "training step")
    assert training["items"]["saved activations, all blocks"] > 0
    assert training["items"]["trainable weights (fp32)"] > 0
    caching = next(p for p in plan["phases"] if p["phase"] == "caching (VAE encode)")
    assert caching["items"]["VAE weights"] == vae.patcher.model_size()
    # the shared module is as it was: no adapter left attached, no hooks, the same weights
    assert [type(m) for m in dm.modules()] == modules_before
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in dm.modules())
    assert all(torch.equal(before[k], v) for k, v in dm.state_dict().items())
    # the time model: each block's forward timed in the calibration forwards (on this CPU), nothing crosses a link
    assert plan["predicted_s_per_step"] > 0 and "predicted" in text and "s/step" in text
    assert sorted(plan["blocks"]["resident"]) == list(range(len(training_blocks(dm))))
    description = describe_comfy_model(model, AdapterConfig(rank=4, alpha=4))
    assert description.timed and description.compute_device == "cpu" and description.h2d() is None
    assert [b.name for b in description.blocks] == [name for name, _ in training_blocks(dm)]
    # every weight and buffer, the non-persistent ones a state dict leaves out included (HiDream-O1's vision RoPE table)
    assert description.other_param_bytes + sum(b.param_bytes for b in description.blocks) == \
        sum(t.numel() * t.element_size() for t in [*dm.parameters(), *dm.buffers()])


@pytest.mark.parametrize("family", FAMILIES)
def test_measured_profile_predicts_a_larger_bucket(comfyui, family, monkeypatch):
    """The profile from the calibration sizes predicts saved activations at an unseen size within 10 %."""
    import comfy.model_management

    from headroom.nodes.bridge import planning
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.core.adapters import AdapterConfig

    model, _, _ = build_tiny_models(family)
    adapter = AdapterConfig(rank=4, alpha=4)
    description = planning.describe_comfy_model(model, adapter, precision="fp32", text_tokens=20)
    monkeypatch.setattr(planning, "CALIBRATION", ((32, 48, 20),))
    (height, width, tokens), = planning.calibration_sizes(model.model)  # scaled for HiDream-O1's 32-px patches
    actual = planning.measure_model(model, adapter, precision="fp32")[0]
    for block, saved, inputs in zip(description.blocks, actual.block_saved, actual.block_inputs):
        assert block.saved.at(height * width, tokens) == pytest.approx(saved, rel=0.10), block.name
        assert block.inputs.at(height * width, tokens) == pytest.approx(inputs, rel=0.10), block.name
    assert comfy.model_management.in_training is False


def test_on_a_device_each_calibration_size_is_run_once_untimed_first(comfyui, monkeypatch):
    """A GPU's first forward at a shape chooses its kernels (cuDNN's search, lazy kernel loads): on a device each
    calibration size runs once under no_grad before the timed, counted forward, or a cold process's fit reads the
    kernel choice as compute (the GPU kit planned SDXL at 8.7 s/step for a measured 0.55 s). The device is played
    here by the CPU with a synchronize; on a CPU itself no forward is added."""
    from headroom.nodes.bridge import planning
    from headroom.nodes.bridge.comfy_model import training_blocks
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.core.adapters import AdapterConfig
    from headroom.training.memory import planner

    model, _, _ = build_tiny_models("sdxl")
    first = training_blocks(model.model.diffusion_model)[0][1]
    events = []
    first.register_forward_pre_hook(lambda module, args: events.append("timed" if torch.is_grad_enabled() else "warm"))
    real = planner.measure_activations

    def measuring(run_forward, blocks, *args, latent_area=0, **kwargs):
        events.append(f"measure {latent_area}")
        return real(run_forward, blocks, *args, latent_area=latent_area, **kwargs)

    monkeypatch.setattr(planner, "measure_activations", measuring)
    planning.measure_and_time(model, AdapterConfig(rank=4, alpha=4), "fp32")  # the CPU: no warm-up
    sizes = [h * w for h, w, _ in planning.calibration_sizes(model.model)]
    assert events == [e for area in sizes for e in (f"measure {area}", "timed")]
    events.clear()
    synced = []
    monkeypatch.setattr(planning, "device_synchronize", lambda device: lambda: synced.append(1))
    planning.measure_and_time(model, AdapterConfig(rank=4, alpha=4), "fp32")
    assert events == [e for area in sizes for e in ("warm", f"measure {area}", "timed")] and synced


def test_the_plan_times_each_block_at_the_runs_size(comfyui, monkeypatch):
    """The time model's block times come from forwards at the run's latent size (planning.time_at_run_size: the
    calibration's tiny forwards are launch-bound on a GPU), one item, no_grad; the laws are exact there. Where that
    timing cannot run (out of memory) the calibration's fit is used."""
    import torch

    from headroom.nodes.bridge import planning
    from headroom.nodes.bridge.comfy_model import training_blocks
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.core.adapters import AdapterConfig
    from headroom.training.memory import planner

    model, _, _ = build_tiny_models("flux")
    timed, real = [], planner.time_blocks

    def recording(run_forward, blocks, latent_area, synchronize=None, repeats=1, **options):
        assert not torch.is_grad_enabled()
        timed.append(real(run_forward, blocks, latent_area, synchronize, repeats, **options))
        return timed[-1]

    monkeypatch.setattr(planner, "time_blocks", recording)
    _, plan_json, _ = _plan(model, width=128, height=96, batch_size=2).result
    assert [t.latent_area for t in timed] == [(96 // 8) * (128 // 8)]  # the node's width and height, one item
    assert json.loads(plan_json)["predicted_s_per_step"] > 0
    shape = planner.RunShape(2, 128, 96)
    description = planning.describe_comfy_model(model, AdapterConfig(rank=4, alpha=4), "fp32", timing=shape)
    times = timed[-1]
    assert description.timed_at_area == times.latent_area == shape.latent_area(description)
    assert [b.forward_s.at(times.latent_area, 77) for b in description.blocks] == \
        pytest.approx(list(times.block_forward_s))
    assert description.forward_seconds(times.latent_area, 77, 2) == \
        pytest.approx([2 * t for t in times.block_forward_s])
    # each kind of block's backward timed too (Flux's double and single blocks: two kinds), and it prices the step
    ratios = [b.backward_per_forward for b in description.blocks]
    assert all(r > 0 for r in ratios) and ratios == list(times.block_backward_per_forward)
    blocks = [block for _, block in training_blocks(model.model.diffusion_model)]
    assert len({planner.block_kind(block) for block in blocks}) == len(set(ratios)) == 2

    # a forward at the run's size the calibration predicts beyond the plan's timing budget is not run
    monkeypatch.setattr(planning, "TIMING_BUDGET_S", 0.0)
    calls = len(timed)
    assert planning.describe_comfy_model(model, AdapterConfig(rank=4, alpha=4), "fp32", timing=shape).timed_at_area == 0
    assert len(timed) == calls
    monkeypatch.setattr(planning, "TIMING_BUDGET_S", 5.0)

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("no room at the run's size")

    monkeypatch.setattr(planner, "time_blocks", out_of_memory)
    fitted = planning.describe_comfy_model(model, AdapterConfig(rank=4, alpha=4), "fp32", timing=shape)
    assert fitted.timed and fitted.timed_at_area == 0  # the calibration's times, fitted


def test_a_block_comfyui_left_in_host_ram_visits_the_device_for_its_timed_forward(comfyui):
    """planning._BlocksOnDevice: the tensors of a block not on the device are copied there before its forward and
    put back after (the same objects), so its time is its compute and the shared MODEL is left as it was. Here the
    "device" is torch's meta device (shapes only): the CPU machine has no second device to copy to."""
    import torch

    from headroom.nodes.bridge import planning

    blocks = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8)), torch.nn.Linear(8, 4)]
    originals = [[*b.parameters()] for b in blocks]
    seen = []
    for block in blocks:
        block.register_forward_hook(lambda m, a, o: seen.append({p.device.type for p in m.parameters()}))
    visiting = planning._BlocksOnDevice(blocks, torch.device("meta"))
    assert visiting.largest_bytes == (4 * 8 + 8 + 8 + 8) * 4
    with visiting:
        h = torch.empty(2, 4, device="meta")
        for block in blocks:
            h = block(h)
    assert seen == [{"meta"}, {"meta"}]  # on the device while each ran
    after = [p for b in blocks for p in b.parameters()]
    assert all(p is q for p, q in zip(after, (p for ps in originals for p in ps)))  # the host objects back
    assert all(p.device.type == "cpu" for p in after)
    assert all(len(b._forward_pre_hooks) == 0 for b in blocks)


def test_auto_mode_chooses_a_policy_that_fits_and_says_why(comfyui):
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.memory.policy import OffloadPolicy

    model, _, _ = build_tiny_models("sd15")
    roomy = _plan(model, mode="auto", policy=OffloadPolicy(vram_budget_gb=4.0)).result
    assert roomy[2].base_placement == "resident" and roomy[2].checkpointing == "off"
    # batch 8: the training step, not validation, is the peak
    size = dict(width=256, height=256, batch_size=8)
    estimate = json.loads(_plan(model, policy=OffloadPolicy(vram_budget_gb=4.0), **size).result[1])
    assert estimate["peak_phase"] == "training step"
    peak = estimate["peak_bytes"]
    tight = OffloadPolicy(vram_budget_gb=round(0.8 * peak / 2 ** 30, 6))
    text, plan_json, chosen = _plan(model, mode="auto", policy=tight, **size).result
    plan = json.loads(plan_json)
    assert plan["fits"] and plan["peak_bytes"] <= 0.8 * peak
    assert (chosen.base_placement, chosen.checkpointing) != ("resident", "off")
    assert "the fastest policy that fits" in text and "Faster options over budget" in text
    # The node's plan shows where the base is in each phase (issue 28 item 3): validation, with no backward to keep
    # room for, keeps more of it on the device than the training step.
    streamed = OffloadPolicy(vram_budget_gb=tight.vram_budget_gb, base_placement="streamed", checkpointing="blocks")
    text, plan_json, _ = _plan(model, policy=streamed, **size).result
    plan = json.loads(plan_json)
    assert plan["validation_base_device_bytes"] > plan["base_device_bytes"]
    assert "frozen base on the device: training step" in text and "(more: validation is placed on its own" in text


def test_unet_blocks_are_the_layers_the_model_calls(comfyui):
    from headroom.nodes.bridge.comfy_model import model_blocks, training_blocks
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, _, _ = build_tiny_models("sd15")
    dm = model.model.diffusion_model
    called = set()
    blocks = training_blocks(dm)
    handles = [m.register_forward_pre_hook(lambda mod, args, name=name: called.add(name)) for name, m in blocks]
    outer = [m.register_forward_pre_hook(lambda mod, args, name=name: called.add("outer " + name))
             for name, m in model_blocks(dm)]
    with torch.no_grad():
        dm(torch.randn(1, 4, 8, 8), torch.tensor([500.0]), context=torch.zeros(1, 77, 32))
    for handle in handles + outer:
        handle.remove()
    assert called == {name for name, _ in blocks}  # every unit runs through its hooks, the containers never do
    assert len(blocks) > len(model_blocks(dm))


def test_a_prompt_with_policy_and_plan_runs_through_comfyui(comfyui, monkeypatch):
    """Through ComfyUI's own validation and PromptExecutor: tiny model -> policy -> plan in auto mode."""
    from comfy_harness import queue_prompt, register_nodes
    from headroom.nodes import memory, tiny

    register_nodes(monkeypatch, memory.NODES, tiny.NODES)
    prompt = {
        "1": {"class_type": "HeadroomTinyModel", "inputs": {"family": "sd15", "seed": 0}},
        "2": {"class_type": "HeadroomOffloadPolicy", "inputs": {
            "vram_budget_gb": 2.0, "reserve_gb": 1.0, "base_placement": "resident", "base_storage": "as_loaded",
            "checkpointing": "off", "checkpoint_depth": 1, "optimizer_state": "gpu",
            "park_optimizer_during_validation": True, "vae_tiled_decode": "auto", "encoders": "unload_after_use"}},
        "3": {"class_type": "HeadroomMemoryPlan", "inputs": {
            "model": ["1", 0], "policy": ["2", 0], "mode": "auto", "batch_size": 1, "width": 64, "height": 64,
            "rank": 4, "targets": "preset", "optimizer": "AdamW", "precision": "fp32", "text_tokens": 0}},
    }
    executor = queue_prompt(prompt, "plan-run")
    assert executor.success
    shown = executor.history_result["outputs"]["3"]["text"][0]
    assert shown.startswith("Headroom memory plan:") and "chosen: the fastest policy that fits" in shown


def test_plan_errors_are_clear(comfyui):
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, _, _ = build_tiny_models("sd15")
    with pytest.raises(ValueError, match=r"Memory Plan \(Headroom\): policy must come from"):
        _plan(model, policy="resident")
    host = _policy(trained_weights="host", fused_backward=True, optimizer_state="cpu").result[0]
    with pytest.raises(ValueError, match=r"Memory Plan \(Headroom\): trained_weights 'host' keeps a full fine-tune's"):
        _plan(model, policy=host)  # it plans LoRAs: the Init node's card fit plans a full fine-tune


@pytest.mark.parametrize("family", ["sd15", "flux"])
def test_the_plan_of_a_controlnet_or_a_full_fine_tune_counts_what_they_train(comfyui, family):
    """kind controlnet / full (appended inputs): the plan the ControlNet Init node makes of a card (its calibration runs
    the ControlNet, its trainable tensors are the ControlNet's) or a full fine-tune's (its trained layers' weights),
    in fp32 or, with fused backward, bf16 (trained_precision: half the bytes)."""
    from headroom.nodes.bridge.controlnet_build import controlnet_trainable
    from headroom.nodes.bridge.planning import lora_trainable
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.core.adapters import AdapterConfig
    from headroom.training.memory.policy import OffloadPolicy

    model, _, _ = build_tiny_models(family)

    def trained(**inputs) -> tuple[int, int]:
        """(trainable weights, optimizer state) of the plan's training step"""
        plan = json.loads(_plan(model, **inputs).result[1])
        items = next(p for p in plan["phases"] if p["phase"] == "training step")["items"]
        return (sum(value for name, value in items.items() if name.startswith("trainable weights")),
                items["optimizer state (AdamW)"])

    controlnet = controlnet_trainable(model, 0, "AdamW")
    full = lora_trainable(model, AdapterConfig(kind="full", targets="preset"), "AdamW")
    lora = trained()
    for kind, spec in (("controlnet", controlnet), ("full", full)):
        assert trained(kind=kind) == (spec.weight_bytes(), spec.optimizer_bytes()) and spec.weight_bytes() > lora[0]
        fused = OffloadPolicy(fused_backward=True)
        bf16 = trained(kind=kind, policy=fused, trained_precision="bf16_stochastic", precision="bf16")
        assert bf16[0] == spec.weight_bytes() // 2
    text = _plan(model, kind="controlnet", mode="auto", policy=OffloadPolicy(vram_budget_gb=4.0)).result[0]
    assert "the fastest policy that fits" in text


def test_the_plan_of_a_controlnet_counts_the_blocks_it_copies(comfyui):
    """controlnet_blocks (appended): the ControlNet of that many blocks, as the ControlNet nodes' blocks; what they
    refuse is refused naming this node's input."""
    from headroom.nodes.bridge.controlnet_build import controlnet_trainable
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, _, _ = build_tiny_models("sd3")  # 2 joint blocks: the default copies 1

    def weights(**inputs) -> int:
        plan = json.loads(_plan(model, kind="controlnet", **inputs).result[1])
        items = next(p for p in plan["phases"] if p["phase"] == "training step")["items"]
        return sum(value for name, value in items.items() if name.startswith("trainable weights"))

    assert weights() == weights(controlnet_blocks=1) == controlnet_trainable(model, 1, "AdamW").weight_bytes()
    assert weights(controlnet_blocks=2) == controlnet_trainable(model, 2, "AdamW").weight_bytes() > weights()
    with pytest.raises(ValueError, match=r"^Memory Plan \(Headroom\): controlnet_blocks=3 is more than the base "
                                         r"model's 2 joint blocks"):
        weights(controlnet_blocks=3)
    unet, _, _ = build_tiny_models("sd15")
    with pytest.raises(ValueError, match=r"^Memory Plan \(Headroom\): controlnet_blocks=2: a UNet ControlNet copies "
                                         r"the whole encoder .* set controlnet_blocks to 0"):
        _plan(unet, kind="controlnet", controlnet_blocks=2)


def test_plan_kinds_refuse_what_their_runs_refuse(comfyui):
    """Named by the node, saying what to set: bf16 weights without fused backward, trained_precision on a LoRA, a
    ControlNet of a family ComfyUI has no ControlNet layout for (the families listed)."""
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.memory.policy import OffloadPolicy

    model, _, _ = build_tiny_models("sd15")
    with pytest.raises(ValueError, match=r"^Memory Plan \(Headroom\): trained_precision bf16_stochastic: .*turn "
                                         r"fused_backward on in the Offload Policy \(Headroom\), or set trained_precision to fp32"):
        _plan(model, kind="controlnet", trained_precision="bf16_stochastic")
    with pytest.raises(ValueError, match=r"^Memory Plan \(Headroom\): trained_precision bf16_stochastic computes in "
                                         r"bf16: set precision to bf16 \(it is fp32\), or trained_precision to fp32"):
        _plan(model, kind="controlnet", trained_precision="bf16_stochastic", policy=OffloadPolicy(fused_backward=True))
    _plan(model, kind="full", trained_precision="bf16_stochastic", policy=OffloadPolicy(fused_backward=True))  # it casts
    with pytest.raises(ValueError, match=r"^Memory Plan \(Headroom\): trained_precision bf16_stochastic is for kinds "
                                         r"full and controlnet"):
        _plan(model, trained_precision="bf16_stochastic", policy=OffloadPolicy(fused_backward=True))
    host = _policy(trained_weights="host", fused_backward=True, optimizer_state="cpu").result[0]
    with pytest.raises(ValueError, match=r"trained_weights 'host' keeps a full fine-tune's .* set kind full on this "
                                         r"node, or set trained_weights 'device'"):
        _plan(model, policy=host)
    assert json.loads(_plan(model, policy=host, kind="full").result[1])["fits"] in (True, False)
    flux2, _, _ = build_tiny_models("flux2")
    with pytest.raises(ValueError, match=r"^Memory Plan \(Headroom\): .*(?i:flux\.?2).*"):
        _plan(flux2, kind="controlnet")
