"""The planner adds up the memory features' costs (each feature module's own cost function:
training/memory/checkpointing.py, activation_offload.py, weight_streaming.py, lowbit.py, optimizer_parking.py). Its
plans are held to the planner as it was before the costs moved into the feature modules, kept here as the reference
(`reference_estimate`, with the host RAM a run adds written in since): every item, host figure and note of every phase, for three descriptions x every policy the
planner tries (storages, placements, checkpointing, optimizer state, parking) x budgets, shapes and optimizers. A
deliberate change of the cost model changes the reference with it."""
from __future__ import annotations

import math

from headroom.training.memory import planner
from headroom.training.memory.planner import (ActivationLaw, BlockProfile, ModelDescription, RunShape, TrainableSpec,
                                              candidate_policies, estimate)
from headroom.training.memory.policy import GIB, OffloadPolicy

MIB = 2 ** 20


def descriptions() -> dict[str, ModelDescription]:
    per_px = 1 / 4096
    toy = BlockProfile("b", 1 * GIB, linear_weight_bytes=GIB // 2, linear_weight_numel=GIB // 4, linear_rows=4096,
                       linear_count=8, saved=ActivationLaw(0, 200 * MIB * per_px, 0),
                       inputs=ActivationLaw(0, 20 * MIB * per_px, 0))
    # Uneven blocks with weight copies (manual cast), text-dependent and quadratic laws, a conv-only block.
    uneven = [BlockProfile(f"u{i}", (i + 1) * 300 * MIB, linear_weight_bytes=(i + 1) * 200 * MIB,
                           linear_weight_numel=(i + 1) * 100 * MIB, linear_rows=3072 * (i + 1), linear_count=4 + i,
                           saved=ActivationLaw(1e6, 3e4 * (i + 1), 0.5, 2e3, 7.0), inputs=ActivationLaw(2e5, 4e3, 0, 1e3),
                           weight_copy_bytes=(i + 1) * 120 * MIB, linear_copy_bytes=(i + 1) * 90 * MIB)
              for i in range(5)]
    uneven.append(BlockProfile("conv", 64 * MIB, saved=ActivationLaw(0, 1e4), inputs=ActivationLaw(0, 2e3)))
    return {
        "toy": ModelDescription("toy", (toy,) * 4, other_param_bytes=100 * MIB, latent_channels=4,
                                inference_bytes_per_latent_px=10 * MIB / 4096, text_encoder_bytes=300 * MIB,
                                vae_bytes=160 * MIB, vae_encode_bytes_per_px=500, vae_decode_bytes_per_px=2000),
        "uneven": ModelDescription("uneven", tuple(uneven), other_param_bytes=700 * MIB,
                                   outside_saved=ActivationLaw(5e5, 1e3, 0, 10.0), latent_channels=16,
                                   text_tokens=256, inference_bytes_per_latent_px=3e4, text_encoder_bytes=9 * GIB,
                                   vae_bytes=300 * MIB, vae_encode_bytes_per_px=900, vae_decode_bytes_per_px=4000,
                                   weight_copy_in_flight_bytes=150 * MIB, largest_linear_numel=80 * MIB,
                                   compute_element_size=2, stored_element_size=1,
                                   text_encoder_copy_in_flight_bytes=400 * MIB),
        "no encoders, one block": ModelDescription("bare", (toy,), other_param_bytes=0),
    }


def plans(estimate) -> dict:
    """{case: Plan.to_dict()} over the grid, by `estimate`."""
    result = {}
    shapes = {"512 px": RunShape(1, 512, 512), "1024x768 px, batch 2": RunShape(2, 1024, 768, text_tokens=300)}
    for name, description in descriptions().items():
        for optimizer in ("AdamW", "Adafactor"):
            trainable = TrainableSpec(((64, 4096), (4096, 64)) * 10 + ((32,),), optimizer)
            for shape_name, shape in shapes.items():
                for park in (True, False):
                    base = OffloadPolicy(park_optimizer_during_validation=park)
                    for policy in candidate_policies(base, ("as_loaded", "fp8", "int8", "nf4")):
                        for budget in (None, 3 * GIB, 12 * GIB):
                            if budget is None and policy.base_placement == "partial" and shape_name != "512 px":
                                continue
                            plan = estimate(description, trainable, shape, policy, budget)
                            key = f"{name} | {optimizer} | {shape_name} | {policy.describe()} | budget {budget}"
                            result[key] = memory_figures(plan.to_dict())
    return result


TIME_MODEL_KEYS = ("predicted_s_per_step", "step_time", "blocks")  # added with the time model: held in test_time_model
DISK_KEYS = ("checkpoint_bytes", "save_bytes", "save_bf16_bytes")  # the disk checks: in test_planner


def memory_figures(plan: dict) -> dict:
    """A plan's JSON without what the time model and the disk check added (its memory figures are what the reference
    holds)."""
    plan = {key: value for key, value in plan.items() if key not in TIME_MODEL_KEYS + DISK_KEYS}
    plan["policy"] = {key: value for key, value in plan["policy"].items() if key != "checkpoint_blocks"}
    return plan


def test_the_planner_adds_up_to_the_figures_it_gave_before():
    expected, got = plans(reference_estimate), plans(estimate)
    assert len(got) == len(expected) > 1000
    different = [key for key in expected if got[key] != expected[key]]
    assert different == [], f"{len(different)} plans differ, e.g. {different[0]}: {got[different[0]]}"


def test_the_reference_tells_the_policies_apart():
    """The grid is not degenerate: the plans differ between policies (a planner ignoring a field would be caught)."""
    steps = {key.split(" | ")[3]: (plan["phases"][2]["total_bytes"], plan["phases"][3]["total_bytes"])
             for key, plan in plans(reference_estimate).items()
             if key.startswith("uneven | AdamW | 512 px") and key.endswith("budget None")}
    assert len(steps) > 50 and len(set(steps.values())) > 0.6 * len(steps)


# --- the planner before issue 12's feature costs, kept as the reference ---------------------------------------
def _copies_kept(block: BlockProfile, storage: str) -> int:
    if storage == "as_loaded":
        return block.weight_copy_bytes
    return max(0, block.weight_copy_bytes - block.linear_copy_bytes)


def _weight_bytes(block: BlockProfile, storage: str) -> int:
    if storage == "as_loaded" or block.linear_count == 0:
        return block.param_bytes
    numel = block.linear_weight_numel
    packed = {
        "fp8": numel + 4 * block.linear_count,
        "int8": numel + 4 * block.linear_rows,
        "nf4": numel // 2 + 4 * math.ceil(numel / 64) + 64 * block.linear_count,
    }[storage]
    return block.param_bytes - block.linear_weight_bytes + packed


def reference_estimate(description: ModelDescription, trainable: TrainableSpec, shape: RunShape, policy: OffloadPolicy,
                       budget_bytes: int | None = None) -> planner.Plan:
    """planner.estimate as it was before the feature modules cost themselves (issue 12), verbatim but for the
    low-bit sizes, which are this file's copies too."""
    area, tokens, batch = shape.latent_area(description), shape.tokens(description), shape.batch
    blocks = description.blocks
    storage = policy.base_storage
    block_weights = [_weight_bytes(b, storage) for b in blocks]
    saved = [b.saved.at(area, tokens) * batch for b in blocks]
    copies = [_copies_kept(b, storage) for b in blocks]  # per block, whatever the batch
    inputs = [b.inputs.at(area, tokens) * batch for b in blocks]
    outside = description.outside_saved.at(area, tokens) * batch
    host: dict[str, int] = {}  # what the policy keeps in host RAM instead

    # Trainables.
    trainables = {"trainable weights (fp32)": trainable.param_bytes(), "gradients (fp32)": trainable.param_bytes()}
    optimizer = trainable.optimizer_bytes()
    if policy.optimizer_state == "gpu":
        trainables[f"optimizer state ({trainable.optimizer})"] = optimizer
    else:
        host["optimizer state + fp32 master weights"] = optimizer + trainable.param_bytes()

    # Activations of one step.
    activations: dict[str, int] = {}
    recomputed = max((a + c for a, c in zip(saved, copies)), default=0)  # one block's saved set, copies included
    if policy.checkpointing == "off":
        activations["saved activations, all blocks"] = int(sum(saved))
        activations["weight copies kept for backward, all blocks (manual cast)"] = int(sum(copies))
    elif policy.checkpointing == "blocks":
        activations["checkpointed block inputs"] = int(sum(inputs))
        activations["one block recomputed in backward"] = int(recomputed)
    else:
        activations["block inputs in flight (2 blocks)"] = int(2 * max(inputs, default=0))
        activations["one block recomputed in backward"] = int(recomputed)
        host["offloaded block inputs"] = int(sum(inputs))
    activations["saved activations outside the blocks"] = int(outside)
    activations["gradient buffers of one block"] = int(2 * max(inputs, default=0))
    in_flight = description.weight_copy_in_flight_bytes
    if storage != "as_loaded":
        in_flight = max(in_flight, description.largest_linear_numel * description.compute_element_size)
    activations["one layer's weight copy in flight (cast / dequantised)"] = int(in_flight)

    # Frozen weights by placement.
    all_blocks = sum(block_weights)
    weights = {"frozen weights outside the blocks": description.other_param_bytes}
    notes = []
    if policy.base_placement == "resident":
        weights[f"frozen block weights ({storage})"] = all_blocks
    else:
        weights["streamed block buffers (2 blocks)"] = 2 * max(block_weights, default=0)  # in use + in flight
        resident_part = 0
        if policy.base_placement == "partial":
            if budget_bytes is None:
                resident_part = all_blocks
                notes.append("partial placement without a budget: estimated as fully resident")
            else:
                rest = sum(weights.values()) + sum(trainables.values()) + sum(activations.values())
                room = int(budget_bytes / (1 + planner.ALLOCATOR_OVERHEAD)) - rest
                resident_part = max(0, min(all_blocks, room))
            weights[f"resident block weights ({storage}, partial)"] = resident_part
            if resident_part >= all_blocks:
                weights["streamed block buffers (2 blocks)"] = 0
        if all_blocks > resident_part:
            host["streamed block weights"] = all_blocks - resident_part

    training_items = {**weights, **trainables, **activations}
    training_items["allocator overhead (5%)"] = int(planner.ALLOCATOR_OVERHEAD * sum(training_items.values()))
    training = planner.PhaseEstimate("training step", training_items, notes)

    # Validation: the frozen weights placed on their own (issue 28 item 3: "resident" stays resident, "partial" and
    # "streamed" keep the blocks that fit beside what validation holds), the adapter, ComfyUI's inference estimate
    # for cond + uncond.
    validation_items = {"frozen weights outside the blocks": description.other_param_bytes}
    validation_items["adapter weights (fp32)"] = trainable.param_bytes()
    if not policy.park_optimizer_during_validation:
        validation_items["gradients (fp32)"] = trainable.param_bytes()
        if policy.optimizer_state == "gpu":
            validation_items[f"optimizer state ({trainable.optimizer})"] = optimizer
    validation_items["sampling working set (ComfyUI estimate, cond+uncond)"] = int(
        description.inference_bytes_per_latent_px * area * 2)
    # the GPU kit's Flux.1-dev validation at 6 GiB: the allocator's cache holds more than is live beside it
    validation_items["allocator slack beside the working set (validation's per-layer casts fragment the cache)"] = int(
        planner.VALIDATION_SLACK * int(description.inference_bytes_per_latent_px * area * 2))
    validation_items["one layer's weight copy in flight (cast / dequantised)"] = int(in_flight)
    # Validation as the saved file (the default, nodes/bridge/comfy_bridge.AsSavedWeight) merges the LoRA into that layer's
    # weight as it runs: the LoRA product in fp32 (ComfyUI's LoRA compute dtype on a CPU; fp16 on some GPUs, so this
    # is the upper bound), the merge rounded to the stored dtype, and that back in compute precision.
    validation_items["one layer's LoRA merge in flight (validation as the saved file)"] = int(
        description.largest_linear_numel * (4 + description.stored_element_size + description.compute_element_size))
    validation_blocks = all_blocks
    if policy.base_placement == "resident":
        validation_items[f"frozen block weights ({storage})"] = all_blocks
    elif budget_bytes is None:  # no room to fill: training's placement ("streamed": none resident)
        validation_blocks = 0 if policy.base_placement == "streamed" else all_blocks
    else:
        room = int(budget_bytes / (1 + planner.ALLOCATOR_OVERHEAD)) - sum(validation_items.values())
        validation_blocks = max(0, min(all_blocks, room - 2 * max(block_weights, default=0)))
    if policy.base_placement == "streamed" and budget_bytes is None:
        validation_items["streamed block buffers (2 blocks)"] = 2 * max(block_weights, default=0)
    elif policy.base_placement != "resident":
        validation_items["streamed block buffers (2 blocks)"] = (
            0 if validation_blocks >= all_blocks else 2 * max(block_weights, default=0))
        validation_items[f"resident block weights ({storage}, partial)"] = validation_blocks
    validation_items["allocator overhead (5%)"] = int(planner.ALLOCATOR_OVERHEAD * sum(validation_items.values()))
    validation = planner.PhaseEstimate("validation", validation_items)
    if policy.park_optimizer_during_validation:
        validation.notes.append("optimizer state and gradients parked in host RAM while sampling")
    if description.inference_bytes_per_latent_px == 0:
        validation.notes.append("no inference estimate in the model description")

    pixels = shape.width * shape.height
    decode_full = int(description.vae_decode_bytes_per_px * pixels)
    decode_tiled = int(description.vae_decode_bytes_per_px * min(pixels, planner.TILE_PX * planner.TILE_PX))
    tiled = policy.decode_tiled(description.vae_bytes + decode_full, budget_bytes)
    decode = planner.PhaseEstimate("validation decode", {
        "VAE weights": description.vae_bytes,
        "decode working set" + (" (tiled 512 px)" if tiled else ""): decode_tiled if tiled else decode_full,
    }, ["after the denoiser is released"])

    cache_text = planner.PhaseEstimate("caching (text encoders)", {
        "text encoder weights": description.text_encoder_bytes,
        "one weight copy in flight (fp32 cast)": description.text_encoder_copy_in_flight_bytes,
    })
    cache_vae = planner.PhaseEstimate("caching (VAE encode)", {
        "VAE weights": description.vae_bytes,
        "encode working set": int(description.vae_encode_bytes_per_px * pixels * batch),
    })
    for phase in (cache_text, cache_vae, decode):
        if not any(phase.items.values()):
            phase.notes.append("encoder sizes not given (connect CLIP / VAE to the plan node)")

    save_items = {k: v for k, v in training_items.items() if k in weights or k in trainables}
    save_items["allocator overhead (5%)"] = int(planner.ALLOCATOR_OVERHEAD * sum(save_items.values()))
    save = planner.PhaseEstimate("save", save_items)

    # Host RAM the run adds beyond the loaded models (issue 28, training/memory/host_ram.py), as the rule it is.
    added_training: dict[str, int] = {}
    added_validation: dict[str, int] = {}
    if policy.optimizer_state == "cpu":
        added_training["optimizer state + fp32 master weights + gradients"] = optimizer + 2 * trainable.param_bytes()
        added_validation["optimizer state + fp32 master weights"] = optimizer + trainable.param_bytes()
    elif policy.park_optimizer_during_validation:
        added_validation["parked optimizer state + gradients"] = optimizer + trainable.param_bytes()
    if policy.checkpointing == "blocks_cpu_offload":
        added_training["offloaded block inputs"] = int(sum(inputs))

    training_blocks = all_blocks if policy.base_placement == "resident" else (
        all_blocks - host.get("streamed block weights", 0))
    return planner.Plan(policy, [cache_text, cache_vae, training, validation, decode, save], budget_bytes, host_bytes=host,
                        base_device_bytes=description.other_param_bytes + training_blocks,
                        validation_base_device_bytes=description.other_param_bytes + validation_blocks,
                        host_added={"training step": added_training, "validation": added_validation})


def test_an_outer_layers_copy_in_flight_counts_only_above_the_blocks_activations():
    """A layer outside the blocks (Ideogram 4's 53248 x 4608 text projection) casts its weight at the start of the
    forward, before any block holds activations, and never in backward: the training step counts the larger of the
    largest block layer's copy and that one less the step's block activations; validation the larger of the block
    copy and that one less ComfyUI's sampling working set. Without the block copy told apart (None), the largest copy
    of all counts, as before."""
    import dataclasses

    base = descriptions()["toy"]
    trainable = TrainableSpec(((64, 4096), (4096, 64)), "AdamW")
    shape, policy = RunShape(1, 1024, 1024), OffloadPolicy(checkpointing="blocks")
    name = "one layer's weight copy in flight (cast / dequantised)"

    def items(outer, block):
        plan = estimate(dataclasses.replace(base, weight_copy_in_flight_bytes=outer,
                                            block_weight_copy_in_flight_bytes=block), trainable, shape, policy)
        return {p.phase: p.items for p in plan.phases}

    step, sampling = items(10 * MIB, 10 * MIB)["training step"], items(10 * MIB, 10 * MIB)["validation"]
    others = sum(v for k, v in step.items() if k in (
        "checkpointed block inputs", "one block recomputed in backward", "saved activations outside the blocks",
        "gradient buffers of one block"))
    working = sampling["sampling working set (ComfyUI estimate, cond+uncond)"]
    assert others > 100 * MIB and working > 0
    big = items(2 * GIB, 10 * MIB)
    assert big["training step"][name] == 2 * GIB - others
    assert big["validation"][name] == 2 * GIB - working
    small = items(others // 2, 10 * MIB)  # smaller than the blocks' activations: only the block layer's copy counts
    assert small["training step"][name] == 10 * MIB
    assert items(2 * GIB, None)["training step"][name] == 2 * GIB
