"""The planner: optimizer state model, low-bit sizes, itemised phases, policy choice, activation measurement."""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import sys
import weakref

import pytest
import torch

from headroom.training.memory import planner, trained_weights_on_host
from headroom.training.core.adapters import AdapterConfig, AdapterSet, select_targets
from headroom.training.memory.lowbit import LowBitBase
from headroom.training.core.optimizers import OptimizerConfig, create_optimizer
from headroom.training.memory.planner import (ActivationLaw, BlockProfile, ModelDescription, RunShape, TrainableSpec, estimate,
                                       next_smaller_policy, plan_auto)
from headroom.training.data.files import format_bytes
from headroom.training.memory.policy import GIB, OffloadPolicy

MIB = 2 ** 20


@pytest.mark.parametrize("name", ["AdamW", "AdamW8bit", "Lion8bit", "Adafactor", "CAME", "Prodigy"])
def test_optimizer_state_model_matches_the_libraries(name):
    shapes = [(16, 3072), (3072, 16), (16, 100), (300,), (64, 32, 3, 3)]  # a conv weight: factored over its last dims
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    optimizer = create_optimizer(params, OptimizerConfig(name=name, lr=1.0 if name == "Prodigy" else 1e-3), device="cpu")
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    tensors = {id(v): v for state in optimizer.state.values() for v in state.values()
               if torch.is_tensor(v) and v.numel() > 1}  # per-tensor scalars (step, RMS) are noise
    measured = sum(t.numel() * t.element_size() for t in tensors.values())
    modelled = TrainableSpec(tuple(shapes), name).optimizer_bytes()
    assert abs(measured - modelled) <= 0.02 * measured + 4096, (measured, modelled)


@pytest.mark.parametrize("storage", ["fp8", "int8", "nf4"])
def test_low_bit_weight_bytes_match_the_stored_tensors(storage):
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 64)).requires_grad_(False)
    profile = planner.describe_blocks([("block", block)], [ActivationLaw()], [ActivationLaw()])[0]
    root = torch.nn.Sequential(block)
    base = LowBitBase(root, storage, "cpu")
    actual = planner.frozen_bytes(root)  # packed linears + biases + the norm, as they now are
    assert abs(profile.weight_bytes(storage) - actual) <= 0.01 * actual
    base.detach()
    assert profile.weight_bytes("as_loaded") == planner.frozen_bytes(root)


def toy_description(blocks=4, block_weights=1 * GIB, saved=200 * MIB, inputs=20 * MIB):
    per_px = 1 / 4096  # laws per latent pixel: the figures hold at a 64x64 latent (512 px)
    profile = BlockProfile("b", block_weights, linear_weight_bytes=block_weights // 2,
                           linear_weight_numel=block_weights // 4, linear_rows=4096, linear_count=8,
                           saved=ActivationLaw(0, saved * per_px, 0), inputs=ActivationLaw(0, inputs * per_px, 0))
    return ModelDescription("toy", tuple(profile for _ in range(blocks)), other_param_bytes=100 * MIB,
                            latent_channels=4, inference_bytes_per_latent_px=10 * MIB / 4096,
                            text_encoder_bytes=300 * MIB, vae_bytes=160 * MIB, vae_encode_bytes_per_px=500,
                            vae_decode_bytes_per_px=2000)


TRAINABLE = TrainableSpec(((64, 4096), (4096, 64)) * 10, "AdamW")
SHAPE = RunShape(batch=1, width=512, height=512)


def test_checkpointing_keeps_only_block_inputs():
    d = toy_description()
    off = estimate(d, TRAINABLE, SHAPE, OffloadPolicy()).phase("training step").items
    blocks = estimate(d, TRAINABLE, SHAPE, OffloadPolicy(checkpointing="blocks")).phase("training step").items
    offload = estimate(d, TRAINABLE, SHAPE, OffloadPolicy(checkpointing="blocks_cpu_offload"))
    assert off["saved activations, all blocks"] == 4 * 200 * MIB
    assert blocks["checkpointed block inputs"] == 4 * 20 * MIB
    assert blocks["one block recomputed in backward"] == 200 * MIB
    assert offload.phase("training step").items["block inputs in flight (2 blocks)"] == 2 * 20 * MIB
    assert offload.host_bytes["offloaded block inputs"] == 4 * 20 * MIB


def test_the_plan_says_what_a_checkpoint_takes_on_disk():
    """Trained weights, optimizer state (AdamW: two fp32 moments) and the EMA copy, plus what each tensor adds to
    its file; shown on the Memory Plan node and in its JSON (the two kept: run_dir.KEEP_CHECKPOINTS)."""
    from headroom.training.core.run_dir import KEEP_CHECKPOINTS

    params = TRAINABLE.param_count
    plan = estimate(toy_description(), TRAINABLE, SHAPE, OffloadPolicy())
    assert plan.checkpoint_bytes == TRAINABLE.checkpoint_bytes() == 12 * params + 20 * 1024 + (8 << 10)
    with_ema = dataclasses.replace(TRAINABLE, ema=True)
    assert with_ema.checkpoint_bytes() == 16 * params + 20 * (1024 + 160) + (8 << 10)
    assert json.loads(plan.to_json())["checkpoint_bytes"] == plan.checkpoint_bytes
    # a save to models/ (all-in-one nodes: a LoRA's factors in fp32, or bf16 with Train LoRA's save_dtype; a
    # ControlNet's as trained, no choice)
    assert plan.save_bytes == 4 * params and json.loads(plan.to_json())["save_bytes"] == plan.save_bytes
    assert plan.save_bf16_bytes == 2 * params and json.loads(plan.to_json())["save_bf16_bytes"] == 2 * params
    controlnet = dataclasses.replace(TRAINABLE, element_size=2, saved_as_trained=True)
    assert controlnet.save_bytes() == 2 * params and controlnet.save_bf16_bytes() == 0
    assert KEEP_CHECKPOINTS == 2 and "disk: about 60.0 MiB a checkpoint (trained weights and optimizer state); a run " \
        f"keeps two (the older removed before a save where the disk has no room for a third); a save to models/ " \
        f"about {format_bytes(4 * params)} in fp32, {format_bytes(2 * params)} with save_dtype bf16" \
        in plan.to_text().splitlines(), plan.to_text()
    text = estimate(toy_description(), controlnet, SHAPE, OffloadPolicy()).to_text()
    assert text.splitlines()[-1].endswith(f"a save to models/ about {format_bytes(2 * params)}"), text


def test_a_controlnets_own_blocks_keep_their_activations_and_the_skipped_base_blocks_none():
    """A ControlNet run's own blocks (ModelDescription.controlnet_blocks, measured in its step's calibration) keep what
    they save beside the base's blocks, and only their inputs where every block is checkpointed (the run checkpoints
    its own blocks only then; a selective plan leaves them whole); the base's first blocks, which run no backward
    (TrainableSpec.without_backward), hold no input when checkpointed. The description keeps them through JSON."""
    per_px = 1 / 4096
    own = BlockProfile("trained block 0", 0, saved=ActivationLaw(0, 300 * MIB * per_px, 0),
                       inputs=ActivationLaw(0, 30 * MIB * per_px, 0))
    d = dataclasses.replace(toy_description(), controlnet_blocks=(own, own))
    assert ModelDescription.from_dict(json.loads(json.dumps(d.to_dict()))) == d
    trainable = dataclasses.replace(TRAINABLE, without_backward=1, copied_blocks=2)

    def items(**policy):
        return estimate(d, trainable, SHAPE, OffloadPolicy(**policy)).phase("training step").items

    assert items()["saved activations, all blocks"] == 4 * 200 * MIB + 2 * 300 * MIB
    every = items(checkpointing="blocks")
    assert every["checkpointed block inputs"] == 3 * 20 * MIB + 2 * 30 * MIB
    assert every["one block recomputed in backward"] == 300 * MIB
    selective = items(checkpointing="blocks", checkpoint_blocks="2,3")
    assert selective["checkpointed block inputs"] == 2 * 20 * MIB
    assert selective["saved activations, blocks not checkpointed"] == 2 * 200 * MIB + 2 * 300 * MIB
    offload = estimate(d, trainable, SHAPE, OffloadPolicy(checkpointing="blocks_cpu_offload"))
    assert offload.host_bytes["offloaded block inputs"] == 3 * 20 * MIB + 2 * 30 * MIB


def test_placement_storage_and_optimizer_items():
    d = toy_description()
    resident = estimate(d, TRAINABLE, SHAPE, OffloadPolicy()).phase("training step").items
    assert resident["frozen block weights (as_loaded)"] == 4 * GIB
    streamed = estimate(d, TRAINABLE, SHAPE, OffloadPolicy(base_placement="streamed", checkpointing="blocks"))
    assert streamed.phase("training step").items["streamed block buffers (2 blocks)"] == 2 * GIB
    assert streamed.host_bytes["streamed block weights"] == 4 * GIB
    nf4 = estimate(d, TRAINABLE, SHAPE, OffloadPolicy(base_storage="nf4")).phase("training step").items
    assert nf4["frozen block weights (nf4)"] < 0.8 * resident["frozen block weights (as_loaded)"]
    host = estimate(d, TRAINABLE, SHAPE, OffloadPolicy(optimizer_state="cpu"))
    assert "optimizer state (AdamW)" not in host.phase("training step").items
    assert host.host_bytes["optimizer state + fp32 master weights"] == 12 * TRAINABLE.param_count
    assert resident["optimizer state (AdamW)"] == 8 * TRAINABLE.param_count


def test_partial_placement_fills_the_budget():
    d = toy_description()
    policy = OffloadPolicy(base_placement="partial", checkpointing="blocks")
    roomy = estimate(d, TRAINABLE, SHAPE, policy, budget_bytes=64 * GIB).phase("training step").items
    assert roomy["resident block weights (as_loaded, partial)"] == 4 * GIB and roomy["streamed block buffers (2 blocks)"] == 0
    tight = estimate(d, TRAINABLE, SHAPE, policy, budget_bytes=int(3.5 * GIB))
    items = tight.phase("training step").items
    assert 0 < items["resident block weights (as_loaded, partial)"] < 4 * GIB
    assert tight.phase("training step").total <= 3.5 * GIB
    assert tight.host_bytes["streamed block weights"] == 4 * GIB - items["resident block weights (as_loaded, partial)"]


def test_partial_placement_leaves_validation_its_room_too():
    """Each phase is placed in its own room: where sampling needs more than a training step (here 1.2 GiB of working
    set), validation keeps fewer blocks on the device than training and stays within the budget. (One share sized by
    training alone put validation over the budget, and plan_auto passed over "partial" for the slower "streamed":
    Flux.2 Klein at 8 GB.)"""
    d = dataclasses.replace(toy_description(), inference_bytes_per_latent_px=600 * MIB / 4096)  # 1.2 GiB sampling
    policy = OffloadPolicy(base_placement="partial", checkpointing="blocks")
    budget = 4 * GIB
    plan = estimate(d, TRAINABLE, SHAPE, policy, budget_bytes=budget)
    training, validation = plan.phase("training step"), plan.phase("validation")
    assert plan.fits and training.total <= budget and validation.total <= budget
    # beside the working set, the room its per-layer casts leave unusable in the allocator's cache
    slack = validation.items["allocator slack beside the working set (validation's per-layer casts fragment the cache)"]
    assert slack == int(planner.VALIDATION_SLACK * validation.items["sampling working set (ComfyUI estimate, cond+uncond)"])
    share = training.items["resident block weights (as_loaded, partial)"]
    validation_share = validation.items["resident block weights (as_loaded, partial)"]
    assert 0 < validation_share < share < 4 * GIB
    assert plan.base_device_bytes == d.other_param_bytes + share
    assert plan.validation_base_device_bytes == d.other_param_bytes + validation_share
    assert "validation" in plan.placement_line() and "less" in plan.placement_line()
    auto = planner.plan_auto(d, TRAINABLE, SHAPE, OffloadPolicy(), budget)
    assert auto.policy.base_placement == "partial", auto.reason


@pytest.mark.parametrize("placement", ["partial", "streamed"])
def test_validation_keeps_more_blocks_when_sampling_needs_less_room(placement):
    """Issue 28 item 3: with no backward (no activations kept, gradients and optimizer state parked), validation's
    room holds more blocks than a training step's: "partial" keeps more, "streamed" (every block streamed in
    training) keeps as many as fit while sampling. Each phase stays within the budget; the plan's text says both."""
    d = toy_description()
    budget = int(3.5 * GIB)
    plan = estimate(d, TRAINABLE, SHAPE, OffloadPolicy(base_placement=placement, checkpointing="blocks"),
                    budget_bytes=budget)
    training, validation = plan.phase("training step"), plan.phase("validation")
    assert training.total <= budget and validation.total <= budget
    validation_share = validation.items["resident block weights (as_loaded, partial)"]
    assert plan.validation_base_device_bytes == d.other_param_bytes + validation_share
    assert plan.validation_base_device_bytes > plan.base_device_bytes
    assert validation.total > 0.9 * budget  # the room is used, not left empty
    line = plan.placement_line()
    assert line in plan.to_text() and "more" in line
    assert plan.to_dict()["validation_base_device_bytes"] == plan.validation_base_device_bytes
    # Resident stays resident in both phases, and says nothing more.
    resident = estimate(d, TRAINABLE, SHAPE, OffloadPolicy(), budget_bytes=64 * GIB)
    assert resident.validation_base_device_bytes == resident.base_device_bytes and resident.placement_line() == ""


def test_plan_says_how_much_of_the_base_stays_on_the_device():
    """Plan.base_device_bytes: what a run's load may leave on the device (the weights outside the blocks plus the
    resident blocks); for "partial" it is the planned share, so the load leaves the room the plan counted."""
    d = toy_description()
    outside = d.other_param_bytes
    resident = estimate(d, TRAINABLE, SHAPE, OffloadPolicy(), budget_bytes=64 * GIB)
    assert resident.base_device_bytes == outside + 4 * GIB
    streamed = estimate(d, TRAINABLE, SHAPE, OffloadPolicy(base_placement="streamed", checkpointing="blocks"),
                        budget_bytes=64 * GIB)
    assert streamed.base_device_bytes == outside
    policy = OffloadPolicy(base_placement="partial", checkpointing="blocks")
    tight = estimate(d, TRAINABLE, SHAPE, policy, budget_bytes=int(3.5 * GIB))
    share = tight.phase("training step").items["resident block weights (as_loaded, partial)"]
    assert tight.base_device_bytes == outside + share and 0 < share < 4 * GIB
    assert estimate(d, TRAINABLE, SHAPE, policy).base_device_bytes == outside + 4 * GIB  # no budget: all of it


def test_parking_and_validation_phases():
    d = toy_description()
    parked = estimate(d, TRAINABLE, SHAPE, OffloadPolicy()).phase("validation")
    kept = estimate(d, TRAINABLE, SHAPE, OffloadPolicy(park_optimizer_during_validation=False)).phase("validation")
    assert "optimizer state (AdamW)" not in parked.items and "gradients (fp32)" not in parked.items
    assert kept.total - parked.total >= 12 * TRAINABLE.param_count
    assert parked.items["sampling working set (ComfyUI estimate, cond+uncond)"] == 20 * MIB
    plan = estimate(d, TRAINABLE, SHAPE, OffloadPolicy())
    assert plan.phase("caching (text encoders)").total == 300 * MIB
    assert plan.phase("validation decode").items["decode working set"] == 2000 * 512 * 512
    tiled = estimate(d, TRAINABLE, SHAPE, OffloadPolicy(vae_tiled_decode="on"))
    assert "decode working set (tiled 512 px)" in tiled.phase("validation decode").items
    assert plan.peak.phase == "training step" and plan.fits is None


def test_activations_scale_with_batch_and_resolution():
    d = toy_description()
    one = estimate(d, TRAINABLE, SHAPE, OffloadPolicy()).phase("training step").items["saved activations, all blocks"]
    big = estimate(d, TRAINABLE, RunShape(2, 1024, 1024), OffloadPolicy()).phase("training step").items
    assert big["saved activations, all blocks"] == 8 * one


def test_json_and_text_outputs():
    d = toy_description()
    plan = estimate(d, TRAINABLE, SHAPE, OffloadPolicy(), budget_bytes=8 * GIB)
    data = json.loads(plan.to_json())
    assert data["format"] == "headroom.memory_plan" and data["fits"] is True
    assert {p["phase"] for p in data["phases"]} >= {"training step", "validation", "save", "caching (VAE encode)"}
    assert all(p["total_bytes"] == sum(p["items"].values()) for p in data["phases"])
    text = plan.to_text()
    assert "training step" in text and "saved activations, all blocks" in text and "fits" in text
    assert ModelDescription.from_dict(json.loads(json.dumps(d.to_dict()))) == d


def test_auto_picks_the_fastest_policy_that_fits():
    d = toy_description()
    roomy = plan_auto(d, TRAINABLE, SHAPE, OffloadPolicy(), budget_bytes=40 * GIB)
    assert (roomy.policy.base_placement, roomy.policy.checkpointing, roomy.policy.optimizer_state) == ("resident", "off", "gpu")
    off_peak = roomy.peak_bytes
    squeezed = plan_auto(d, TRAINABLE, SHAPE, OffloadPolicy(), budget_bytes=off_peak - 100 * MIB)
    assert squeezed.policy.base_placement == "resident" and squeezed.policy.checkpointing != "off"
    assert "Faster options over budget: resident/off/optimizer gpu needs" in squeezed.reason
    tight = plan_auto(d, TRAINABLE, SHAPE, OffloadPolicy(), budget_bytes=3 * GIB)
    assert tight.fits and tight.policy.base_placement in ("partial", "streamed")
    assert tight.policy.base_storage == "as_loaded"


def test_auto_lowers_precision_only_when_nothing_else_fits_and_says_so():
    d = toy_description(blocks=2, block_weights=3 * GIB)  # two huge blocks: streaming needs both in memory
    plan = plan_auto(d, TRAINABLE, SHAPE, OffloadPolicy(), budget_bytes=int(5 * GIB))
    assert plan.fits and plan.policy.base_storage != "as_loaded"
    assert "changes its numerics" in plan.reason
    nothing = plan_auto(d, TRAINABLE, SHAPE, OffloadPolicy(), budget_bytes=GIB)
    assert nothing.fits is False and "nothing fits" in nothing.reason


def test_fused_backward_is_said_where_it_fits_what_the_plan_cannot_or_is_much_faster_and_never_chosen():
    """A run with large gradients (a ControlNet's fp32 weights): where nothing fits with the base as loaded, the reason
    says that the Offload Policy's fused_backward would fit it, and with what; where the plan fits but steps its
    optimizer in host RAM, the much faster step fused backward would allow. Never chosen (gradient clipping per tensor,
    no fp16 or accumulation), and not weighed with gradient accumulation, when it is on, or for a LoRA's gradients."""
    d = toy_description(blocks=4, block_weights=512 * MIB)
    big = TrainableSpec(((16384, 16384),) * 2, "AdamW")  # 2 GiB of fp32 weights, as many bytes of gradients
    tight = plan_auto(d, big, SHAPE, OffloadPolicy(), budget_bytes=5 * GIB)
    assert tight.fits is False and not tight.policy.fused_backward
    assert "With fused_backward on in the Offload Policy" in tight.reason, tight.reason
    assert "it fits with the base as loaded: peak 5.00 GiB with " in tight.reason and \
        tight.reason.endswith(", fused backward."), tight.reason
    roomy = plan_auto(d, big, SHAPE, OffloadPolicy(), budget_bytes=7 * GIB)
    assert roomy.fits and not roomy.policy.fused_backward and roomy.policy.optimizer_state == "cpu"
    said = roomy.reason.split("With fused_backward on in the Offload Policy")[1]
    fused_s, plan_s = (float(x) for x in said.split(": predicted ")[1].split(", with ")[0].split(" s/step instead of "))
    assert fused_s <= planner.FUSED_ADVICE_SPEEDUP * plan_s
    assert plan_s == pytest.approx(roomy.predicted_s_per_step, abs=1e-3)
    accumulating = plan_auto(d, big, dataclasses.replace(SHAPE, grad_accum=2), OffloadPolicy(), budget_bytes=5 * GIB)
    assert "fused_backward" not in accumulating.reason
    on = plan_auto(d, big, SHAPE, OffloadPolicy(fused_backward=True), budget_bytes=5 * GIB)
    assert on.fits and on.policy.fused_backward and "With fused_backward" not in on.reason
    assert "fused_backward" not in plan_auto(d, TRAINABLE, SHAPE, OffloadPolicy(), budget_bytes=3 * GIB).reason


def test_bf16_trained_weights_are_said_where_fused_backward_alone_allows_nothing_more():
    """fp32 trained weights an input could train in bf16 (a ControlNet's controlnet_precision, a full fine-tune's
    full_precision: TrainableSpec.bf16_weights_input): where fused backward alone fits nothing with the base as loaded
    (or is on already), the plan says what bf16 weights with it would allow, naming the input; never chosen (the
    numerics change). Fused backward alone is said first where it is enough."""
    d = toy_description(blocks=4, block_weights=512 * MIB)
    big = TrainableSpec(((16384, 16384),) * 2, "AdamW", bf16_weights_input="controlnet_precision")
    off = plan_auto(d, big, SHAPE, OffloadPolicy(), budget_bytes=4 * GIB)
    assert off.fits is False and off.reason.endswith(off.advice)
    assert off.advice.startswith(" With controlnet_precision bf16_stochastic (the trained weights in bf16, each update "
                                 "rounded stochastically; precision bf16) and fused_backward on in the Offload Policy")
    assert "it fits with the base as loaded: peak 4.00 GiB with " in off.advice, off.advice
    on = plan_auto(d, big, SHAPE, OffloadPolicy(fused_backward=True), budget_bytes=int(4.5 * GIB))
    assert on.fits and on.policy.base_storage == "fp8"  # fp32 weights fit only with a lower-precision base
    assert on.advice.startswith(" With controlnet_precision bf16_stochastic (") and "fused_backward" not in on.advice
    assert "it fits with the base as loaded" in on.advice
    fused_enough = plan_auto(d, big, SHAPE, OffloadPolicy(), budget_bytes=5 * GIB)
    assert fused_enough.advice.startswith(" With fused_backward on") and "bf16" not in fused_enough.advice
    adapters = dataclasses.replace(big, bf16_weights_input="")  # no input trains them in bf16: nothing said
    assert plan_auto(d, adapters, SHAPE, OffloadPolicy(fused_backward=True), budget_bytes=int(4.5 * GIB)).advice == ""
    already = dataclasses.replace(big, element_size=2)
    assert "bf16_stochastic" not in plan_auto(d, already, SHAPE, OffloadPolicy(fused_backward=True),
                                              budget_bytes=3 * GIB).reason


def test_auto_tries_no_storage_whose_package_is_missing(monkeypatch):
    """int8 / nf4 need the optional bitsandbytes: without it auto never picks them (the run would fail when it opens)
    and, when nothing else fits, says what installing it would allow."""
    d = toy_description(blocks=2, block_weights=3 * GIB)
    smallest = {storage: plan_auto(d, TRAINABLE, SHAPE, OffloadPolicy(base_storage=storage), budget_bytes=1).peak_bytes
                for storage in ("fp8", "nf4")}
    assert smallest["nf4"] < smallest["fp8"]
    budget = (smallest["nf4"] + smallest["fp8"]) // 2  # only nf4 fits
    assert plan_auto(d, TRAINABLE, SHAPE, OffloadPolicy(), budget_bytes=budget).policy.base_storage == "nf4"
    assert planner._storages(OffloadPolicy()) == ["as_loaded", "fp8", "int8", "nf4"]
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed
    without = plan_auto(d, TRAINABLE, SHAPE, OffloadPolicy(), budget_bytes=budget)
    assert without.fits is False and without.policy.base_storage in ("as_loaded", "fp8")
    assert ("Base storage int8 / nf4 was not tried: it needs the optional package bitsandbytes (python -m pip install "
            "bitsandbytes, then restart ComfyUI).") in without.reason
    fp8 = plan_auto(d, TRAINABLE, SHAPE, OffloadPolicy(), budget_bytes=int(smallest["fp8"] * 1.01))
    assert fp8.fits and fp8.policy.base_storage == "fp8"
    assert planner._storages(OffloadPolicy()) == ["as_loaded", "fp8"]  # also after an out-of-memory error


def test_next_smaller_policy_after_out_of_memory():
    d = toy_description()
    current = OffloadPolicy()
    current_peak = estimate(d, TRAINABLE, SHAPE, current).peak_bytes
    following = next_smaller_policy(d, TRAINABLE, SHAPE, current)
    assert following is not None and following.peak_bytes < current_peak
    # moving the small LoRA optimizer state to the host would not help: checkpointing comes next
    assert (following.policy.checkpointing, following.policy.optimizer_state) == ("blocks", "gpu")
    last = OffloadPolicy(base_placement="streamed", checkpointing="blocks_cpu_offload", optimizer_state="cpu",
                         base_storage="nf4")
    assert next_smaller_policy(d, TRAINABLE, SHAPE, last) is None


# --- measuring activations --------------------------------------------------------------------------------
class ToyBlock(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.q = torch.nn.Linear(width, width)
        self.kv = torch.nn.Linear(width, 2 * width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 3 * width), torch.nn.GELU(), torch.nn.Linear(3 * width, width))

    def forward(self, x, context):
        h = self.norm(x)
        k, v = self.kv(torch.cat([context, h], 1)).chunk(2, dim=-1)
        # One head, as (batch, heads, tokens, dim), the layout ComfyUI's attention passes: torch 2.8's CPU SDPA takes
        # its quadratic math path for 3-d inputs (the attention map saved: 25x the bytes at 1,536 tokens), newer
        # torch its flash kernel; with 4-d inputs both take the flash kernel, linear in the tokens, as on CUDA.
        attended = torch.nn.functional.scaled_dot_product_attention(self.q(h)[:, None], k[:, None], v[:, None])
        x = x + attended[:, 0]
        return x + self.mlp(x)


class ToyModel(torch.nn.Module):
    def __init__(self, width=32):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, width)
        self.blocks = torch.nn.ModuleList([ToyBlock(width) for _ in range(3)])
        self.out = torch.nn.Linear(width, 4)
        self.requires_grad_(False)

    def forward(self, latent, context):
        x = self.proj(latent.flatten(2).transpose(1, 2))
        for block in self.blocks:
            x = block(x, context=context)
        return self.out(x)


def measure(model, h, w, tokens):
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(1, 4, h, w, generator=g)
    context = torch.randn(1, tokens, 32, generator=g)
    return planner.measure_activations(lambda: model(latent, context), list(model.blocks),
                                       weights=list(model.parameters()), latent_area=h * w, text_tokens=tokens)


def test_calibration_records_the_order_each_block_calls_its_modules():
    """measure_activations notes, per block, its modules in the order its forward first calls them (ToyBlock calls kv
    before q, against module order); describe_blocks keeps it in the profile (BlockProfile.call_order: the planner
    reverses it for backward) and a description round-trips it through its dict."""
    model = ToyModel()
    sample = measure(model, 8, 8, 4)
    assert sample.block_call_order == [("norm", "kv", "q", "mlp", "mlp.0", "mlp.1", "mlp.2")] * 3
    named = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    laws = [ActivationLaw()] * 3
    profiles = planner.describe_blocks(named, laws, laws, [sample])
    assert profiles[0].call_order == sample.block_call_order[0]
    description = ModelDescription("toy", profiles, other_param_bytes=0)
    assert ModelDescription.from_dict(json.loads(json.dumps(description.to_dict()))) == description


def lora_model():
    model = ToyModel()
    config = AdapterConfig(rank=4, alpha=4, targets="all_linear")
    adapters = AdapterSet(model, select_targets(model, None, config, [f"blocks.{i}" for i in range(3)]), config)
    adapters.attach(model)
    return model


def test_profile_from_small_sizes_predicts_a_large_one():
    model = lora_model()
    samples = [measure(model, 8, 8, 4), measure(model, 8, 16, 4), measure(model, 8, 8, 12)]
    saved, inputs, outside = planner.fit_profile(samples)
    large = measure(model, 32, 48, 40)
    for law, actual in zip(saved, large.block_saved):
        assert law.at(32 * 48, 40) == pytest.approx(actual, rel=0.05)
    for law, actual in zip(inputs, large.block_inputs):
        assert law.at(32 * 48, 40) == pytest.approx(actual, rel=0.05)
    assert large.block_inputs[0] == 32 * 48 * 32 * 4 + 40 * 32 * 4  # x and the text context, fp32


def test_saved_tensors_are_counted_once_and_weights_never():
    model = lora_model()
    sample = measure(model, 16, 16, 8)
    total = []
    seen = set()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen and key not in weights:
            seen.add(key)
            total.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randn(1, 4, 16, 16), torch.randn(1, 8, 32))
    assert sample.total_saved == sum(total) > 0
    assert all(saved > 0 for saved in sample.block_saved)


def test_description_from_modules():
    model = lora_model()
    samples = [measure(model, 8, 8, 4), measure(model, 8, 16, 4), measure(model, 8, 8, 12)]
    saved, inputs, outside = planner.fit_profile(samples)
    blocks = planner.describe_blocks([(f"blocks.{i}", b) for i, b in enumerate(model.blocks)], saved, inputs)
    assert sum(b.param_bytes for b in blocks) + planner.frozen_bytes(model.proj) + planner.frozen_bytes(model.out) == \
        planner.frozen_bytes(model)
    assert blocks[0].linear_count == 4 and blocks[0].linear_weight_numel == 32 * 32 + 64 * 32 + 96 * 32 + 32 * 96
    assert math.isclose(outside.at(64, 4), samples[0].outside_saved, rel_tol=1e-6)
    with pytest.raises(ValueError, match="differ in latent area"):
        planner.fit_profile([samples[0], samples[0]])


# --- out of memory -----------------------------------------------------------------------------------------
def test_out_of_memory_saves_frees_and_names_the_next_policy():
    import weakref

    from headroom.training.memory.oom import is_out_of_memory, out_of_memory

    calls = []
    held = []

    def failing_step():
        activations = torch.zeros(1000)  # only the failed step's frame holds it
        held.append(weakref.ref(activations))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    d = toy_description()
    try:
        failing_step()
    except torch.OutOfMemoryError as caught:
        assert is_out_of_memory(caught)
        error = out_of_memory("training step", caught, "cpu", save_checkpoint=lambda: calls.append("save"),
                              free_memory=lambda: calls.append("free"),
                              next_plan=lambda: next_smaller_policy(d, TRAINABLE, SHAPE, OffloadPolicy()))
    assert held[0]() is None  # the traceback no longer keeps the step's tensors alive
    assert calls == ["save", "free"]
    message = str(error)
    assert message.startswith("Out of memory during training step (no device peak figure on this device)")
    assert "The last completed step is saved; device memory was freed." in message
    assert "Next policy to try: " + error.next_plan.policy.describe() in message
    assert error.phase == "training step" and error.peak_bytes is None


def test_out_of_memory_without_a_smaller_policy_or_a_working_save():
    from headroom.training.memory.oom import is_out_of_memory, out_of_memory

    def broken_save():
        raise OSError("disk full")

    error = out_of_memory("validation", RuntimeError("CUDA error: out of memory"), "cpu", save_checkpoint=broken_save,
                          next_plan=lambda: None)
    assert "Saving the checkpoint failed too (disk full)." in str(error)
    assert "No smaller policy is left: lower the batch size or the resolution" in str(error)
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory")) and not is_out_of_memory(RuntimeError("other"))


def test_measuring_keeps_nothing_alive():
    """A calibration forward's graph is freed when the measurement returns (the pack hook used to return the
    tensor itself: a reference cycle through autograd's C++ graph that gc cannot break, +2.8 GiB per plan at
    Flux width)."""
    import gc
    import weakref

    refs = []

    def forward():
        x = torch.randn(256, 256, requires_grad=True)
        refs.append(weakref.ref(x))
        return torch.sigmoid(x) * 2  # sigmoid saves its own output: the case that formed the cycle

    sample = planner.measure_activations(forward, [])
    gc.collect()
    assert sample.outside_saved == 256 * 256 * 4
    assert refs[0]() is None


class CastLinear(torch.nn.Linear):
    """Computes with a cast copy of its bf16 weight, as ComfyUI's manual-cast ops do."""

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))


class TrackedCastLinear(CastLinear):
    """A CastLinear that remembers (weakly) each cast copy it made."""

    copies: list = []

    def forward(self, x):
        weight = self.weight.to(x.dtype)
        TrackedCastLinear.copies.append(weakref.ref(weight))
        return torch.nn.functional.linear(x, weight, self.bias.to(x.dtype))


def test_weight_copies_are_counted_per_layer_call_and_not_held():
    """With part of the base in host RAM every layer there casts a device copy of its weight: the measurement
    counts each copy (once per layer call: a layer run twice keeps two) but does not hold it, or measuring a
    model larger than the card would bring all of it to the device (Flux-dev on an 8 GiB card: out of memory)."""
    width = 32
    layer = TrackedCastLinear(width, width).to(torch.bfloat16).requires_grad_(False)
    config = AdapterConfig(rank=4, alpha=4, targets="all_linear")
    blocks = torch.nn.ModuleList([torch.nn.Sequential(layer)])
    adapters = AdapterSet(blocks, select_targets(blocks, None, config, ["0"]), config)
    adapters.attach(blocks)
    TrackedCastLinear.copies = []
    held = []

    def forward():
        h = torch.randn(1, 3, width)  # not 4 tokens: an input of the LoRA down layer's size would pass for a copy
        out = blocks[0](blocks[0](h))  # the same layer twice: its input needs a gradient the second time
        gc.collect()
        held.extend(ref() is not None for ref in TrackedCastLinear.copies)
        return out

    sample = planner.measure_activations(forward, list(blocks), weights=list(blocks.parameters()),
                                         latent_area=3, text_tokens=0)
    assert len(held) == 2 and not any(held), "the measurement held the layers' weight copies"
    assert sample.block_weight_copies == [width * width * 4]  # the second call's copy (the first needs none)


def test_weight_copies_are_counted_apart_and_dropped_by_low_bit_storage():
    torch.manual_seed(0)
    width = 64
    blocks = torch.nn.ModuleList([torch.nn.Sequential(CastLinear(width, 2 * width), torch.nn.GELU(),
                                                      CastLinear(2 * width, width)) for _ in range(2)])
    blocks.to(torch.bfloat16).requires_grad_(False)
    config = AdapterConfig(rank=4, alpha=4, targets="all_linear")
    adapters = AdapterSet(blocks, select_targets(blocks, None, config, ["0", "1"]), config)
    adapters.attach(blocks)

    def sample(tokens):
        x = torch.randn(1, tokens, width)

        def forward():
            h = x
            for block in blocks:
                h = block(h)
            return h
        return planner.measure_activations(forward, list(blocks), weights=list(blocks.parameters()),
                                           latent_area=tokens, text_tokens=0)

    small, large = sample(8), sample(32)
    # Every Linear whose input needs a gradient keeps its fp32 copy; the first layer's input does not.
    fp32_bytes = width * 2 * width * 4
    assert small.block_weight_copies == [fp32_bytes, 2 * fp32_bytes]
    assert small.block_linear_copies == small.block_weight_copies == large.block_weight_copies
    assert all(s < l for s, l in zip(small.block_saved, large.block_saved))  # activations grow, copies do not
    saved, inputs, _ = planner.fit_profile([small, large])
    profiles = planner.describe_blocks([("0", blocks[0]), ("1", blocks[1])], saved, inputs, [small, large])
    assert [p.copies_kept("as_loaded") for p in profiles] == [fp32_bytes, 2 * fp32_bytes]
    assert [p.copies_kept("fp8") for p in profiles] == [0, 0]
    description = ModelDescription("toy", profiles, other_param_bytes=0)
    off = estimate(description, TRAINABLE, SHAPE, OffloadPolicy()).phase("training step").items
    assert off["weight copies kept for backward, all blocks (manual cast)"] == 3 * fp32_bytes
    low_bit = estimate(description, TRAINABLE, SHAPE, OffloadPolicy(base_storage="fp8")).phase("training step").items
    assert low_bit["weight copies kept for backward, all blocks (manual cast)"] == 0
    checkpointed = estimate(description, TRAINABLE, SHAPE, OffloadPolicy(checkpointing="blocks")).phase("training step")
    one_block = max(p.saved.at(SHAPE.latent_area(description), 77) + p.copies_kept("as_loaded") for p in profiles)
    assert checkpointed.items["one block recomputed in backward"] == int(one_block)


# --- host RAM as a budget -----------------------------------------------------------------------------------
def test_host_ram_added_per_phase_by_the_policy_and_ema():
    """What a run adds to host RAM: optimizer state, fp32 masters and the step's gradients with the optimizer on the
    host; state and gradients parked while sampling; every block's inputs when offloaded; the EMA copy (and the
    trained weights while it is sampled)."""
    d, n = toy_description(), TRAINABLE.param_count
    resident = estimate(d, TRAINABLE, SHAPE, OffloadPolicy(park_optimizer_during_validation=False))
    assert resident.host_added_bytes == 0
    parked = estimate(d, TRAINABLE, SHAPE, OffloadPolicy())
    assert parked.host_added == {"training step": {}, "validation": {"parked optimizer state + gradients": 12 * n}}
    host = estimate(d, TRAINABLE, SHAPE, OffloadPolicy(optimizer_state="cpu"))
    assert host.host_added["training step"] == {"optimizer state + fp32 master weights + gradients": 16 * n}
    offload = estimate(d, TRAINABLE, SHAPE, OffloadPolicy(checkpointing="blocks_cpu_offload",
                                                          park_optimizer_during_validation=False))
    assert offload.host_added["training step"] == {"offloaded block inputs": 4 * 20 * MIB}
    ema = estimate(d, dataclasses.replace(TRAINABLE, ema=True), SHAPE, OffloadPolicy())
    assert ema.host_added["training step"] == {"EMA of the trainable weights (fp32)": 4 * n}
    # validation: parked state and gradients beside the EMA copy, and the trained weights while it is sampled
    assert ema.host_added_bytes == 20 * n
    assert ema.host_added["validation"]["trained weights, kept while their EMA is sampled"] == 4 * n


def test_auto_policy_fits_host_ram_too_and_says_what_to_change_when_nothing_does():
    from headroom.training.memory.host_ram import HostRoom

    d, n = toy_description(), TRAINABLE.param_count
    # a budget just under resident + checkpointing with the optimizer on the device: the base stays resident and host
    # RAM takes the rest (the optimizer state, or the offloaded block inputs: the one predicted faster)
    budget = estimate(d, TRAINABLE, SHAPE, OffloadPolicy(checkpointing="blocks")).peak_bytes - 1
    roomy = HostRoom(in_use_bytes=GIB, limit_bytes=4 * GIB, auto=False)
    chosen = plan_auto(d, TRAINABLE, SHAPE, OffloadPolicy(), budget, roomy)
    host_options = [estimate(d, TRAINABLE, SHAPE, OffloadPolicy(checkpointing=c, optimizer_state=o), budget, roomy)
                    for c, o in (("blocks", "cpu"), ("blocks_cpu_offload", "gpu"))]
    assert chosen.fits and chosen.host_fits and chosen.policy.base_placement == "resident"
    assert chosen.predicted_s_per_step == min(p.predicted_s_per_step for p in host_options if p.fits)
    # host RAM for the parked state (12 bytes per weight) only: neither the host optimizer (16) nor the offloaded
    # inputs fit, so the next policy that fits both is chosen, and the reason says why the faster ones were not
    tight = HostRoom(in_use_bytes=GIB, limit_bytes=GIB + 12 * n, auto=False)
    squeezed = plan_auto(d, TRAINABLE, SHAPE, OffloadPolicy(), budget, tight)
    assert squeezed.fits and squeezed.host_added_bytes == 12 * n
    assert (squeezed.policy.base_placement, squeezed.policy.optimizer_state) == ("partial", "gpu")
    assert "resident/blocks/optimizer cpu adds 80.0 MiB of host RAM" in squeezed.reason
    full = HostRoom(in_use_bytes=GIB, limit_bytes=GIB, auto=True)
    nothing = plan_auto(d, TRAINABLE, SHAPE, OffloadPolicy(park_optimizer_during_validation=True), 64 * GIB, full)
    assert nothing.fits is False and nothing.device_fits and nothing.host_fits is False
    assert nothing.reason.startswith("nothing fits host RAM") and "optimizer_state gpu" in nothing.reason
    assert "DOES NOT FIT" in nothing.summary() and "host RAM: 1.00 GiB in use" in nothing.to_text()
    assert nothing.to_dict()["host_fits"] is False and nothing.to_dict()["host_limit_bytes"] == GIB


def test_host_room_auto_is_in_use_plus_available_less_the_reserve():
    from headroom.training.memory import host_ram

    auto = host_ram.host_room("auto", in_use_bytes=3 * GIB, available=10 * GIB)
    assert (auto.limit_bytes, auto.auto) == (11 * GIB, True) and auto.fits(8 * GIB) and not auto.fits(8 * GIB + 1)
    given = host_ram.host_room(6.0, in_use_bytes=3 * GIB, available=10 * GIB)
    assert (given.limit_bytes, given.auto) == (6 * GIB, False)
    measured = host_ram.host_room("auto")  # this process, this machine
    assert 0 < measured.in_use_bytes < measured.limit_bytes


def test_full_finetune_options_cost_what_they_keep():
    """A full fine-tune's difference: fp32 or bf16 (2 bytes per weight and per gradient), all gradients or fused
    backward's one tensor at a time (none kept between steps, so none in validation); with the optimizer state in host
    RAM, fused backward steps each tensor there: no master weights, no state on the device."""
    d = toy_description()
    shapes = ((3072, 3072), (12288, 3072), (3072,)) * 4
    n, largest = sum(math.prod(s) for s in shapes), 12288 * 3072
    fp32, bf16 = TrainableSpec(shapes, "AdamW"), TrainableSpec(shapes, "AdamW", element_size=2)
    plain = estimate(d, fp32, SHAPE, OffloadPolicy()).phase("training step").items
    assert plain["trainable weights (fp32)"] == plain["gradients (fp32)"] == 4 * n
    fused = estimate(d, fp32, SHAPE, OffloadPolicy(fused_backward=True))
    items = fused.phase("training step").items
    assert "gradients (fp32)" not in items and items["one tensor's gradient (fused backward)"] == 4 * largest
    kept = estimate(d, fp32, SHAPE, OffloadPolicy(fused_backward=True, park_optimizer_during_validation=False))
    assert not any(name.startswith("gradients") for name in kept.phase("validation").items)
    half = estimate(d, bf16, SHAPE, OffloadPolicy(fused_backward=True)).phase("training step").items
    assert half["trainable weights (bf16)"] == 2 * n and half["one tensor's gradient (fused backward)"] == 2 * largest
    assert half["one tensor's fp32 copy + gradient in its step (stochastic rounding)"] == 8 * largest
    assert half["optimizer state (AdamW)"] == plain["optimizer state (AdamW)"] == 8 * n  # fp32 state either way
    host = estimate(d, bf16, SHAPE, OffloadPolicy(fused_backward=True, optimizer_state="cpu"))
    items = host.phase("training step").items
    assert "optimizer state (AdamW)" not in items and not any("fp32 copy" in name for name in items)
    assert host.host_bytes == {"optimizer state (AdamW)": 8 * n}  # no master weights: the device tensor is the weight
    # fused backward's two fp32 buffers for one tensor's step in host RAM, kept for the run (pinned on CUDA: each
    # rounded up to a power of two)
    kept = 2 * trained_weights_on_host.staged_bytes(4 * largest, d.compute_device == "cuda")
    assert host.host_added["training step"] == {"optimizer state (AdamW)": 8 * n,
                                                "one tensor's fp32 copy + gradient in its step (kept buffers)": kept}
    assert host.host_added["validation"]["one tensor's fp32 copy + gradient in its step (kept buffers)"] == kept



def test_trained_weights_in_host_ram_leave_one_layer_on_the_card_and_the_planner_picks_them_last():
    """trained_weights host (memory/trained_weights_on_host.py): the difference moves from the card to host RAM (the
    run allocates it there: in both phases), the card keeps the largest layer's copy as it crosses and its gradient
    in the compute dtype, and fused backward's gradient accumulates in host RAM. The auto planner tries it for a full
    fine-tune with fused backward, after every placement with the weights on the card (their traffic is slower),
    before a low-bit base (which changes the numerics); an adapter run never gets it."""
    d = toy_description()
    shapes = ((3072, 3072), (12288, 3072), (3072,)) * 4
    n, largest = sum(math.prod(s) for s in shapes), 12288 * 3072
    full = TrainableSpec(shapes, "AdamW", element_size=2, full=True)
    fused_host_state = OffloadPolicy(fused_backward=True, optimizer_state="cpu")
    device = estimate(d, full, SHAPE, fused_host_state)
    host = estimate(d, full, SHAPE, fused_host_state.replace(trained_weights="host"))
    items = host.phase("training step").items
    assert "trainable weights (bf16)" not in items and "one tensor's gradient (fused backward)" not in items
    assert items["one layer's trained weights + gradient in flight (trained weights in host RAM)"] == largest * (2 + 2)
    assert "adapter weights (bf16)" not in host.phase("validation").items
    assert host.host_bytes["trained weights (bf16, in host RAM)"] == 2 * n
    for phase in ("training step", "validation"):
        assert host.host_added[phase]["trained weights (bf16, in host RAM)"] == 2 * n
    assert host.host_added["training step"]["one tensor's gradient (fused backward, in host RAM)"] == 2 * largest
    saved = device.phase("training step").total - host.phase("training step").total
    assert 2 * n - 6 * largest < saved < 2 * n  # the difference off the card, one layer's in flight
    assert "trained weights in host RAM" in host.summary()

    # auto: a budget no placement with the weights on the card fits, and one with them in host RAM does (the base as
    # loaded: before a low-bit base)
    candidates = planner.candidate_policies(OffloadPolicy(fused_backward=True), None, trained_weights_host=True)
    smallest = {place: min(estimate(d, full, SHAPE, p).peak_bytes for p in candidates if p.trained_weights == place)
                for place in ("device", "host")}
    assert smallest["host"] < smallest["device"]
    budget = (smallest["host"] + smallest["device"]) // 2
    chosen = planner.plan_auto(d, full, SHAPE, OffloadPolicy(fused_backward=True), budget)
    assert chosen.fits and chosen.policy.trained_weights == "host" and chosen.policy.base_storage == "as_loaded"
    assert chosen.policy.optimizer_state == "cpu" and "trained weights host" not in chosen.reason
    places = [p.trained_weights for p in candidates]
    assert places == sorted(places, key=["device", "host"].index) and "host" in places  # the card's first
    # stepped where the state is: host RAM, or the card (each tensor there in backward, fused_backward.step_on_device)
    assert {p.optimizer_state for p in candidates if p.trained_weights == "host"} == {"cpu", "gpu", "streamed"}
    on_card = estimate(d, full, SHAPE, fused_host_state.replace(trained_weights="host", optimizer_state="gpu"))
    items = on_card.phase("training step").items
    assert items["one tensor's gradient (fused backward)"] == 2 * largest
    assert items["one tensor's copy + fp32 copy + gradient in its step (stepped on the device)"] == (2 + 8) * largest
    assert items["optimizer state (AdamW)"] == full.optimizer_bytes()
    assert "one tensor's gradient (fused backward, in host RAM)" not in on_card.host_added["training step"]
    assert on_card.predicted_s_per_step < host.predicted_s_per_step  # no step of every weight in host RAM
    # not for an adapter, nor without fused backward: they keep their weights on the card whatever the budget. An
    # adapter's spec as the nodes make it (TrainableSpec.lora: `full` left at its default; a classmethod of the same
    # name once shadowed that default, so every adapter counted as a full fine-tune here)
    adapter = TrainableSpec.lora([torch.nn.Linear(3072, 3072), torch.nn.Linear(3072, 12288)], 16, "AdamW")
    assert adapter.full is False and TrainableSpec(shapes).full is False
    for trainable, base in ((adapter, OffloadPolicy(fused_backward=True)),
                            (TrainableSpec(shapes, "AdamW", element_size=2), OffloadPolicy(fused_backward=True)),
                            (full, OffloadPolicy())):
        assert planner.plan_auto(d, trainable, SHAPE, base, budget).policy.trained_weights == "device"
    # a policy that asks for them keeps them, whatever else the planner changes
    kept = planner.plan_auto(d, full, SHAPE, fused_host_state.replace(trained_weights="host"), 100 * GIB)
    assert kept.policy.trained_weights == "host"


def test_trained_weights_in_host_ram_keep_a_checkpointed_block_from_recompute_to_backward_and_pin_staging():
    """trained_weights host with checkpointing (trained_weights_on_host.Crossings): the recompute's copies of a block's
    trained weights stay on the card until backward reaches each layer (last to first), beside one tensor's step;
    the plan counts what they add to the largest tensor's step (`block_layers`, recompute_kept_cost). The fixed
    staging buffers (two each way, the largest tensor; on CUDA pinned, rounded up to a power of two) are host RAM."""
    d = toy_description()
    shapes = ((3072, 3072), (12288, 3072), (3072,)) * 4
    large, small = 12288 * 3072, 3072 * 3072
    # the largest tensor's step on the card (state there): its copy + gradient in flight (bf16: 2 + 2 B), its
    # gradient (2 B) and its copy + fp32 copy + gradient in the step (2 + 8 B)
    alongside = (4 + 2 + 10) * large
    sizes = ((large,) * 4, (small, large), (large, small), (large,))
    layers = tuple(tuple((f"layer{i}", n) for i, n in enumerate(block)) for block in sizes)  # module order
    full = TrainableSpec(shapes, "AdamW", element_size=2, full=True, block_layers=layers)
    host = OffloadPolicy(fused_backward=True, optimizer_state="gpu", trained_weights="host")
    name = "a checkpointed block's trained weights kept from its recompute to its backward"
    assert name not in estimate(d, full, SHAPE, host).phase("training step").items  # nothing recomputed
    every = estimate(d, full, SHAPE, host.replace(checkpointing="blocks"))
    # block 0: at its last layer the copies of the three before it are still kept (3 x 2 B per element)
    assert every.phase("training step").items[name] == 3 * large * 2
    some = estimate(d, full, SHAPE, host.replace(checkpointing="blocks", checkpoint_blocks="1,2"))
    assert some.phase("training step").items[name] == small * 2  # block 1: the small layer's copy beside the large step
    # block 2 and 3: the large layer comes first (its step alone is the most): nothing beyond the step's own items
    assert name not in estimate(d, full, SHAPE, host.replace(checkpointing="blocks", checkpoint_blocks="2,3")
                                ).phase("training step").items
    assert trained_weights_on_host.recompute_kept_cost([(large,) * 4], 2, alongside, large) == {name: 6 * large}
    # the order the calibration forward called the layers in (BlockProfile.call_order) is the one backward reverses:
    # block 1 called large first, block 2 small first (their module order the other way round)
    called = dataclasses.replace(d, blocks=tuple(dataclasses.replace(b, call_order=order) for b, order in zip(
        d.blocks, ((), ("layer1", "other", "layer0"), ("layer1", "layer0"), ()))))
    assert name not in estimate(called, full, SHAPE, host.replace(checkpointing="blocks", checkpoint_blocks="1")
                                ).phase("training step").items
    assert estimate(called, full, SHAPE, host.replace(checkpointing="blocks", checkpoint_blocks="2")
                    ).phase("training step").items[name] == small * 2
    assert planner.in_call_order((("a", 1), ("b", 2), ("c", 3)), ("c", "x", "a")) == [3, 1, 2]  # unnamed: last
    staging = "staging buffers (trained weights in host RAM)"
    for plan in (every, some):  # on CUDA: two buffers each way of the largest tensor (72 MiB of bf16), pinned:
        # rounded up to a power of two by torch's pinned allocator
        assert plan.host_bytes[staging] == plan.host_added["training step"][staging] == 2 * 2 * 128 * MIB
    # with the state in host RAM only the weights come in through them (the gradients go back through autograd)
    assert estimate(d, full, SHAPE, host.replace(optimizer_state="cpu")).host_bytes[staging] == 2 * 128 * MIB
    # on a CPU (the tests' runs) the ring's buffers are plain memory
    cpu = dataclasses.replace(d, compute_device="cpu")
    assert estimate(cpu, full, SHAPE, host).host_bytes[staging] == 2 * 2 * 72 * MIB
    assert staging not in estimate(d, full, SHAPE, host.replace(trained_weights="device")).host_bytes


def test_sharded_optimizer_state_costs_a_rank_its_share_and_rank_0_the_gathered_copy():
    from headroom.training.memory import sharded_optimizer
    from headroom.training.memory.policy import OffloadPolicy

    shapes = ((3072, 3072), (3072,), (12288, 3072), (3072, 12288), (64, 3072))
    whole = planner.TrainableSpec(shapes, "AdamW")
    two = dataclasses.replace(whole, state_ranks=2)
    # torch's partition, largest first onto the first of the emptiest ranks (tests/unit/test_distributed.py checks
    # the planned share against the state each rank holds)
    assert sharded_optimizer.partition([math.prod(s) for s in shapes], 2) == [[2, 0], [3, 4, 1]]
    assert two.optimizer_share_bytes() == 8 * (12288 * 3072 + 3072 * 3072) < whole.optimizer_bytes()
    on_device = planner.optimizer_placement_cost(OffloadPolicy(), two)
    assert on_device.training == {"optimizer state (AdamW)": two.optimizer_share_bytes()}
    assert sum(on_device.host.values()) == whole.optimizer_bytes()  # rank 0's gathered copy
    # state in host RAM or fused backward: not sharded (the Trainer keeps the whole state on each rank then)
    for policy in (OffloadPolicy(optimizer_state="cpu"), OffloadPolicy(fused_backward=True)):
        assert planner.optimizer_placement_cost(policy, two) == planner.optimizer_placement_cost(policy, whole)


def test_fsdp2_costs_a_rank_its_rows_of_every_weight_gradient_and_state_and_one_whole_layer_in_flight():
    from headroom.training.memory.policy import OffloadPolicy

    d = toy_description()
    shapes = ((3072, 3072), (3072,), (12288, 3072), (3072, 12288), (63, 3072))
    whole = planner.TrainableSpec(shapes, "AdamW", full=True)
    two = dataclasses.replace(whole, state_ranks=2, weight_ranks=2)
    # dim 0 split as torch.chunk splits it: rank 0 has 32 of the 63 rows of the last tensor
    rows = 3072 * 3072 / 2 + 3072 / 2 + 12288 * 3072 / 2 + 3072 * 12288 / 2 + 32 * 3072
    assert two.optimizer_share_bytes() == 8 * rows
    def step(spec):
        return next(p for p in estimate(d, spec, SHAPE, OffloadPolicy()).phases if p.phase == "training step").items

    one_rank, items = step(whole), step(two)
    assert items["trainable weights (fp32, rank's share of 2, FSDP2)"] == 4 * rows
    assert items["gradients (fp32, rank's share of 2, FSDP2)"] == 4 * rows
    assert items["optimizer state (AdamW, rank's share of 2, FSDP2)"] == 8 * rows
    in_flight = items["one layer's whole weight + gradient in flight (FSDP2 all-gather / reduce-scatter)"]
    assert in_flight == 2 * 4 * 12288 * 3072
    assert sum(items.values()) < sum(one_rank.values())
    assert "trainable weights (fp32)" in one_rank
    assert not any(k.startswith("trainable weights (fp32)") and "FSDP2" not in k for k in items)


def test_a_full_fine_tune_s_first_block_gradients_are_made_after_its_activations_go():
    """One backward pass per step on one device: the step's peak is the larger of (everything + activations, the first
    block's gradients not made yet) and (every gradient, no activations); accumulation, several ranks, fused backward
    and an unknown first block keep the plain sum."""
    from headroom.training.memory.policy import OffloadPolicy

    d = toy_description()
    shapes = ((3072, 3072), (3072,), (12288, 3072))
    first = 3072 * 3072 + 3072

    def step(spec, shape=SHAPE, policy=OffloadPolicy()):
        return next(p for p in estimate(d, spec, shape, policy).phases if p.phase == "training step")

    whole = planner.TrainableSpec(shapes, "AdamW", full=True)
    known = dataclasses.replace(whole, first_block_elements=first)
    plain, refined = step(whole).items, step(known).items
    activations = sum(v for k, v in plain.items()
                      if not k.startswith(("trainable", "gradients", "optimizer", "frozen", "allocator")))
    later = plain["gradients (fp32)"] - refined["gradients (fp32), the first block's made as its activations go"]
    assert 0 < later == min(4 * first, activations)
    for spec, shape, policy in ((known, planner.RunShape(1, 512, 512, grad_accum=2), OffloadPolicy()),
                                (dataclasses.replace(known, state_ranks=2), SHAPE, OffloadPolicy()),
                                (known, SHAPE, OffloadPolicy(fused_backward=True)),
                                (dataclasses.replace(known, full=False), SHAPE, OffloadPolicy())):
        assert not any("first block" in k for k in step(spec, shape, policy).items)


def test_a_full_fine_tunes_trained_base_is_planned_in_host_ram_for_the_training_step():
    """Issue 42: a full fine-tune's training step never reads its trained layers' base weights (adapters.FullLayer
    computes with its own copy): the plan counts them in host RAM, not on the device, in whatever placement and
    storage; validation (as the saved file: base + W' - W) still reads them."""
    model = ToyModel()
    named = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    targets = [model.proj] + [m for _, b in named for m in b.modules() if isinstance(m, torch.nn.Linear)][1:]
    profiles, outside = planner.unread_base(named, targets)
    assert outside == planner.frozen_bytes(model.proj)
    # each block's trained layers: name in the block and elements, weight and bias (TrainableSpec.block_layers)
    assert planner.trained_per_block(named, targets) == tuple(
        tuple((n, m.weight.numel() + m.bias.numel()) for n, m in b.named_modules() if m in targets) for _, b in named)
    first, second = planner.trained_per_block(named, targets)[:2]
    assert len(first) == len(second) - 1  # the first block's first Linear is not a target
    first = [m for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear)][1:]
    assert profiles[0].param_bytes == sum(planner.frozen_bytes(m) for m in first)
    assert profiles[0].linear_count == len(first) and profiles[1].linear_count == len(first) + 1
    assert profiles[0].linear_weight_numel == sum(m.weight.numel() for m in first)

    d = toy_description()  # 4 blocks of 1 GiB, half of it in Linear weights
    unread = BlockProfile("b", 300 * MIB, linear_weight_bytes=256 * MIB, linear_weight_numel=128 * MIB,
                          linear_rows=2048, linear_count=4)
    full = TrainableSpec(((4096, 4096),) * 8, "Adafactor", element_size=2, full=True)
    reading = dataclasses.replace(full, unread_base_blocks=(unread,) * 4, unread_base_outside=40 * MIB)
    for policy in (OffloadPolicy(checkpointing="blocks"), OffloadPolicy(base_placement="streamed", checkpointing="blocks"),
                   OffloadPolicy(checkpointing="blocks", base_storage="fp8")):
        before, after = (estimate(d, t, SHAPE, policy) for t in (full, reading))
        storage = policy.base_storage
        moved = 4 * unread.weight_bytes(storage) + 40 * MIB
        if storage == "fp8":
            assert unread.weight_bytes("fp8") < 300 * MIB
        training = (before.phase("training step"), after.phase("training step"))
        assert training[1].items["frozen weights outside the blocks"] == 60 * MIB
        assert after.host_bytes["trained layers' base weights (the training step never reads them)"] == moved
        if policy.base_placement == "resident":
            assert (training[0].items[f"frozen block weights ({storage})"]
                    - training[1].items[f"frozen block weights ({storage})"]) == moved - 40 * MIB
            assert after.base_device_bytes == before.base_device_bytes - moved
        else:  # what streams: the blocks less their trained layers' base
            assert before.host_bytes["streamed block weights"] - after.host_bytes["streamed block weights"] == \
                moved - 40 * MIB
            assert after.step_time.transfer_s < before.step_time.transfer_s
        assert before.phase("validation").items == after.phase("validation").items  # validation reads the base
    # On a CPU the host is the device: nothing is left apart.
    on_cpu = dataclasses.replace(d, compute_device="cpu")
    policy = OffloadPolicy(checkpointing="blocks")
    assert estimate(on_cpu, reading, SHAPE, policy).phase("training step").items == \
        estimate(on_cpu, full, SHAPE, policy).phase("training step").items
    with pytest.raises(ValueError, match="given for 3 blocks, the model has 4"):
        estimate(d, dataclasses.replace(reading, unread_base_blocks=(unread,) * 3), SHAPE, OffloadPolicy())


def test_a_plan_says_what_of_its_streamed_blocks_cannot_be_pinned():
    """Streamed blocks are pinned within what ComfyUI's pinned-memory share leaves (Windows: 40 % of the RAM); past
    it they cross from pageable memory: the plan says how much, on the node and in one line, its JSON carries both
    figures, and its predicted step prices those copies (tests/unit/test_time_model.py). Nothing is said when
    everything is pinned or the share is not known."""
    d = toy_description()
    policy = OffloadPolicy(base_placement="streamed", checkpointing="blocks")
    plan = estimate(d, TRAINABLE, SHAPE, policy, budget_bytes=int(3.5 * GIB))
    streamed = plan.host_bytes["streamed block weights"]
    assert streamed > 0 and plan.pageable_bytes == 0 and plan.pinned_line() == ""  # not known: nothing said
    limited = estimate(dataclasses.replace(d, pinnable_bytes=streamed // 4), TRAINABLE, SHAPE, policy,
                       budget_bytes=int(3.5 * GIB))
    block = streamed // len(limited.streamed_blocks)
    assert limited.pinnable_bytes == streamed // 4 and limited.pageable_bytes == streamed - block  # one block pinned
    assert limited.pinned_line() in limited.to_text() and "cross from pageable memory" in limited.pinned_line()
    assert "of blocks unpinned: slower" in limited.summary()
    assert limited.to_dict()["pinnable_bytes"] == streamed // 4
    assert limited.to_dict()["pageable_bytes"] == limited.pageable_bytes
    assert limited.predicted_s_per_step > plan.predicted_s_per_step
    everything = estimate(dataclasses.replace(d, pinnable_bytes=streamed), TRAINABLE, SHAPE, policy,
                          budget_bytes=int(3.5 * GIB))
    assert everything.pageable_bytes == 0 and "unpinned" not in everything.summary()
    assert "pageable" not in everything.to_text()
    assert everything.predicted_s_per_step == plan.predicted_s_per_step
