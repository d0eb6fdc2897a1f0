"""OffloadPolicy: values, clear errors, budget resolution, JSON round trip, and the step-level switches."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from headroom.training.memory.policy import GIB, OffloadPolicy, PolicyError, memory_features, run_policy


def test_defaults_are_the_fastest_policy():
    policy = OffloadPolicy()
    assert (policy.base_placement, policy.base_storage, policy.checkpointing, policy.optimizer_state) == (
        "resident", "as_loaded", "off", "gpu")
    assert policy.budget_is_auto and policy.park_optimizer_during_validation


def test_json_round_trip_keeps_every_field():
    policy = OffloadPolicy(vram_budget_gb=7.5, reserve_gb=0.5, base_placement="streamed", base_storage="nf4",
                           checkpointing="blocks_cpu_offload", checkpoint_depth=2, optimizer_state="cpu",
                           park_optimizer_during_validation=False, vae_tiled_decode="on")
    again = OffloadPolicy.from_json(policy.to_json())
    assert again == policy
    assert json.loads(policy.to_json())["format"] == "headroom.offload_policy"
    assert OffloadPolicy.from_json(OffloadPolicy().to_json()) == OffloadPolicy()


@pytest.mark.parametrize("field, value", [
    ("vram_budget_gb", -1), ("vram_budget_gb", "lots"), ("vram_budget_gb", True), ("reserve_gb", -0.5),
    ("base_placement", "cloud"), ("base_storage", "int4"), ("checkpointing", "yes"), ("checkpoint_depth", 0),
    ("checkpoint_depth", 1.5), ("optimizer_state", "disk"), ("vae_tiled_decode", "sometimes"), ("encoders", "keep"),
    ("park_optimizer_during_validation", "no"), ("host_ram_budget_gb", float("nan")), ("host_ram_budget_gb", -2),
    ("host_ram_budget_gb", 0), ("host_ram_budget_gb", "plenty"), ("host_ram_budget_gb", True),
    ("checkpoint_blocks", "a,b"), ("checkpoint_blocks", "-1"), ("checkpoint_blocks", "1.5"), ("checkpoint_blocks", 3),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(PolicyError, match=field):
        OffloadPolicy(**{field: value})


@pytest.mark.parametrize("placement", ["partial", "streamed"])
def test_offloaded_base_needs_checkpointing(placement):
    with pytest.raises(PolicyError, match="needs checkpointing"):
        OffloadPolicy(base_placement=placement, checkpointing="off")
    assert OffloadPolicy(base_placement=placement, checkpointing="blocks").streams_blocks


def test_base_placement_is_decided_in_one_place():
    """What each base_placement does to the load through ComfyUI and to the streamer (weight_streaming.base_placement,
    asked by comfy_bridge.Placement.load and memory_features alike)."""
    decided = {placement: OffloadPolicy(base_placement=placement, checkpointing="blocks").placement
               for placement in ("resident", "partial", "streamed")}
    assert {name: (p.full_load, p.blocks_to_host, p.stream_blocks) for name, p in decided.items()} == {
        "resident": (True, False, False), "partial": (False, False, True), "streamed": (False, True, True)}
    assert not OffloadPolicy().streams_blocks


def test_json_errors_are_clear():
    with pytest.raises(PolicyError, match="not valid JSON"):
        OffloadPolicy.from_json("{nope")
    with pytest.raises(PolicyError, match="unknown field.*colour"):
        OffloadPolicy.from_json(json.dumps({"colour": "red"}))
    with pytest.raises(PolicyError, match="not a 'headroom.offload_policy'"):
        OffloadPolicy.from_json(json.dumps({"format": "something.else"}))
    with pytest.raises(PolicyError, match="base_placement"):
        OffloadPolicy.from_json(json.dumps({**OffloadPolicy().to_dict(), "base_placement": "moon"}))


def test_budget_bytes():
    assert OffloadPolicy(vram_budget_gb=8).budget_bytes() == 8 * GIB
    auto = OffloadPolicy(reserve_gb=1.5)
    assert auto.budget_bytes(free_bytes=10 * GIB) == int(8.5 * GIB)
    assert auto.resolved(10 * GIB).vram_budget_gb == 8.5
    with pytest.raises(PolicyError, match="free memory"):
        auto.budget_bytes()
    with pytest.raises(PolicyError, match="leaves nothing"):
        auto.budget_bytes(free_bytes=GIB)


def test_a_card_sets_the_budget_and_old_node_values_keep_the_policy():
    """"N GB": N GiB less the reserve, whatever vram_budget_gb says; "this GPU (auto)": free memory less the reserve;
    node values without the card (a workflow saved before it) give the policy they gave before, card custom."""
    card = OffloadPolicy(vram_budget_gb=3.0, reserve_gb=1.0, card="16 GB")
    assert card.fits_card and not card.budget_is_auto and card.budget_bytes() == 15 * GIB
    this_gpu = OffloadPolicy(vram_budget_gb=3.0, card="this GPU (auto)")
    assert this_gpu.budget_is_auto and this_gpu.budget_bytes(free_bytes=10 * GIB) == 9 * GIB
    assert this_gpu.resolved(10 * GIB).vram_budget_gb == 9.0 and this_gpu.resolved(10 * GIB).card == "custom"
    with pytest.raises(PolicyError, match="card '8 GB' less a reserve of 8"):
        OffloadPolicy(card="8 GB", reserve_gb=8.0).budget_bytes()
    with pytest.raises(PolicyError, match="card='96 GB' is not one of"):
        OffloadPolicy(card="96 GB")
    old = {name: default for name, spec, default in OffloadPolicy.node_inputs() if not spec.optional}
    assert "card" not in old and "host_ram_budget_gb" not in old
    assert OffloadPolicy.from_node_inputs({**old, "host_ram_budget_gb": 0.0}).host_ram_budget_gb == "auto"
    assert OffloadPolicy.from_node_inputs({**old, "host_ram_budget_gb": 48.0}).host_ram_budget_gb == 48.0
    assert OffloadPolicy.from_node_inputs({**old, "vram_budget_gb": 6.0}) == OffloadPolicy(vram_budget_gb=6.0)
    assert not OffloadPolicy(vram_budget_gb=6.0).fits_card


def test_policy_is_immutable_and_describes_itself():
    policy = OffloadPolicy(checkpointing="blocks", checkpoint_depth=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.checkpointing = "off"
    assert "depth 2" in policy.describe() and "budget auto" in policy.describe()


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("checkpointing", ["off", "blocks", "blocks_cpu_offload"])
def test_memory_features_switch_on_and_undo(checkpointing):
    blocks = [_Block(), _Block()]
    policy = OffloadPolicy(checkpointing=checkpointing)
    with memory_features(policy, blocks, "cpu") as streamer:
        wrapped = ["forward" in b.__dict__ for b in blocks]
        assert streamer is None
    assert wrapped == [checkpointing != "off"] * 2
    assert not any("forward" in b.__dict__ for b in blocks)


class _Residual(torch.nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.mark.parametrize("checkpointing", ["blocks", "blocks_cpu_offload"])
def test_selective_checkpointing_recomputes_exactly_the_planned_blocks_with_the_same_numerics(checkpointing):
    """policy checkpoint_blocks (the planner's selection): only those blocks are wrapped and run again in backward;
    the loss and every gradient equal the plain run's (checkpointing changes no numerics)."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_Residual() for _ in range(5))
    x = torch.randn(3, 8)

    def step(policy):
        blocks.zero_grad()
        for block in blocks:
            block.calls = 0
        with memory_features(policy, list(blocks), "cpu"):
            wrapped = {i for i, b in enumerate(blocks) if "forward" in b.__dict__}
            h = x.clone().requires_grad_(True)
            for block in blocks:
                h = block(h)
            loss = (h ** 2).mean()
            loss.backward()
        grads = [p.grad.clone() for p in blocks.parameters()]
        return wrapped, [b.calls for b in blocks], loss.detach(), grads

    _, plain_calls, plain_loss, plain_grads = step(OffloadPolicy())
    wrapped, calls, loss, grads = step(OffloadPolicy(checkpointing=checkpointing, checkpoint_blocks="1,3"))
    assert plain_calls == [1] * 5
    assert wrapped == {1, 3} and calls == [1, 2, 1, 2, 1]  # the planned ones, recomputed once in backward
    assert torch.allclose(loss, plain_loss, rtol=0, atol=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(grads, plain_grads))
    assert not any("forward" in b.__dict__ for b in blocks)  # undone
    every, _, _, _ = step(OffloadPolicy(checkpointing=checkpointing))
    assert every == set(range(5))
    with pytest.raises((ValueError, PolicyError), match="not among this model's 5 blocks"):
        step(OffloadPolicy(checkpointing=checkpointing, checkpoint_blocks="1,7"))
    policy = OffloadPolicy(checkpointing=checkpointing, checkpoint_blocks=" 3, 1,")
    assert policy.checkpoint_selection == {1, 3} and "2 selected blocks" in policy.describe()
    assert OffloadPolicy.from_json(policy.to_json()) == policy


def test_selective_checkpointing_always_recomputes_the_streamed_blocks():
    """Which blocks stream is the load's choice: every block the streamer moves is checkpointed whatever the selection
    (its device copy would otherwise stay until backward). Exercised on the CPU, where every block takes the trip."""
    blocks = [_Residual().requires_grad_(False) for _ in range(3)]  # a frozen base
    policy = OffloadPolicy(base_placement="partial", checkpointing="blocks", checkpoint_blocks="0")
    with memory_features(policy, blocks, "cpu", exercise_on_cpu=True):
        assert all("forward" in b.__dict__ for b in blocks)
    with memory_features(policy, blocks, "cpu"):  # the streamer idle (a CPU run): only the selection
        assert ["forward" in b.__dict__ for b in blocks] == [True, False, False]


def test_memory_features_streaming_undone_after_an_error():
    blocks = [_Block(), _Block()]
    weights = [b.inner.weight for b in blocks]
    policy = OffloadPolicy(base_placement="streamed", checkpointing="blocks")
    with pytest.raises(RuntimeError, match="boom"):
        with memory_features(policy, blocks, "cpu", exercise_on_cpu=True) as streamer:
            assert streamer.active
            blocks[0](torch.randn(2, 4))
            raise RuntimeError("boom")
    assert not streamer.active
    assert all(b.inner.weight is w for b, w in zip(blocks, weights))
    assert all(not b._forward_pre_hooks for b in blocks)



def test_exception_types_carry_a_clean_module_name():
    """ComfyUI's error report names a type module + "." + class, and its custom node loader imports this package
    under its folder path: our exception types say headroom.<module> wherever the package was imported from."""
    from headroom.training import public_module
    from headroom.training.data.cache_store import CacheStoreError
    from headroom.training.data.dataset import DatasetError
    from headroom.training.memory.oom import PhaseOutOfMemoryError
    from headroom.training.core.trainer import NonFiniteLossError

    assert public_module("/home/me/ComfyUI/custom_nodes/comfyui-headroom.training.data.dataset") == "headroom.training.data.dataset"
    assert public_module("comfyui_headroom.nodes.bridge.controlnet_build") == "headroom.nodes.bridge.controlnet_build"
    assert public_module("elsewhere") == "elsewhere"
    for error in (PolicyError, CacheStoreError, DatasetError, PhaseOutOfMemoryError, NonFiniteLossError):
        assert error.__module__.startswith("headroom.training.") and "/" not in error.__module__, error


def test_decode_tiled_is_one_rule():
    """Validation's decode and the planner's estimate both ask OffloadPolicy.decode_tiled."""
    assert OffloadPolicy(vae_tiled_decode="on").decode_tiled(None, None)
    assert not OffloadPolicy(vae_tiled_decode="off").decode_tiled(10, 1)
    auto = OffloadPolicy(vae_tiled_decode="auto")
    assert auto.decode_tiled(10, 9) and not auto.decode_tiled(10, 10) and not auto.decode_tiled(10, None)
    assert auto.decode_tiled(1, 0)  # an "auto" budget with nothing free


def test_run_policy_resolves_the_nodes_checkpointing_inputs_once():
    """The training nodes' gradient_checkpointing / checkpoint_depth map into the policy (the one place that
    configures checkpointing); a policy's own checkpointing takes precedence; None is the resident default."""
    assert run_policy(None) == OffloadPolicy()
    assert run_policy(None, gradient_checkpointing=False, checkpoint_depth=3) == OffloadPolicy()
    on = run_policy(None, gradient_checkpointing=True, checkpoint_depth=2)
    assert (on.checkpointing, on.checkpoint_depth) == ("blocks", 2) and on.replace(checkpointing="off") == OffloadPolicy(
        checkpoint_depth=2)
    own = OffloadPolicy(checkpointing="blocks_cpu_offload", checkpoint_depth=1, optimizer_state="cpu")
    assert run_policy(own, gradient_checkpointing=True, checkpoint_depth=3) is own
    streamed = OffloadPolicy(base_placement="streamed", checkpointing="blocks")
    assert run_policy(streamed) is streamed
    with pytest.raises(PolicyError, match=r"checkpoint_depth=0 must be >= 1"):
        run_policy(None, checkpoint_depth=0)


def test_every_field_carries_its_node_input_and_the_node_defaults_give_the_default_policy():
    """The policy node's inputs come from the fields (nodes/memory.HeadroomOffloadPolicy): each field has a NodeInput
    whose node default turns back into the field's default, and whose combo options are what validate accepts."""
    from headroom.training.memory.policy import NodeInput

    fields = dataclasses.fields(OffloadPolicy)
    inputs = OffloadPolicy.node_inputs()
    assert [name for name, _, _ in inputs] == [f.name for f in fields]
    for f, (name, spec, node_default) in zip(fields, inputs):
        assert isinstance(spec, NodeInput) and spec.kind in ("float", "int", "bool", "combo", "string") and spec.tooltip, name
        assert spec.field_value(node_default) == f.default, name
        if spec.kind == "combo":
            assert f.default in spec.options, name
            # every option is a valid value, with the settings it needs (trained weights in host RAM: a host step;
            # streamed optimizer state: fused backward)
            needs = {"trained_weights": {"fused_backward": True, "optimizer_state": "cpu"},
                     "optimizer_state": {"fused_backward": True}}.get(name, {})
            for option in spec.options:
                OffloadPolicy.from_node_inputs({**{n: d for n, _, d in inputs}, **needs, name: option,
                                                "checkpointing": option if name == "checkpointing" else "blocks"})
            with pytest.raises(PolicyError, match=name):
                OffloadPolicy.from_node_inputs({**{n: d for n, _, d in inputs}, name: "no-such-option"})
    assert OffloadPolicy.from_node_inputs({name: default for name, _, default in inputs}) == OffloadPolicy()
    # the budget's 0 stands for "auto"; other values are cast as the field expects
    node = {name: default for name, _, default in inputs}
    assert node["vram_budget_gb"] == 0.0
    policy = OffloadPolicy.from_node_inputs({**node, "vram_budget_gb": 6, "checkpoint_depth": 2.0})
    assert (policy.vram_budget_gb, policy.checkpoint_depth) == (6.0, 2)
    assert type(policy.vram_budget_gb) is float and type(policy.checkpoint_depth) is int
    with pytest.raises(PolicyError, match="unknown \\['typo'\\], missing \\['encoders'\\]"):
        OffloadPolicy.from_node_inputs({**{n: d for n, d in node.items() if n != "encoders"}, "typo": 1})


def test_trained_weights_in_host_ram_need_the_fused_step():
    """trained_weights host steps each tensor inside backward, where its optimizer state is (host RAM or the card):
    without fused backward the policy says what to set; a saved policy without the field keeps its weights on the
    card."""
    for fields in ({}, {"optimizer_state": "cpu"}):
        with pytest.raises(PolicyError, match="trained_weights 'host'.*needs fused_backward on"):
            OffloadPolicy(trained_weights="host", **fields)
    for state in ("cpu", "gpu"):
        policy = OffloadPolicy(trained_weights="host", fused_backward=True, optimizer_state=state)
        assert OffloadPolicy.from_json(policy.to_json()) == policy and "trained weights in host RAM" in policy.describe()
    saved = policy.to_dict()
    del saved["trained_weights"]
    assert OffloadPolicy.from_dict(saved).trained_weights == "device"


def test_trained_weights_card_blocks_need_the_trained_weights_in_host_ram_and_name_themselves():
    host = OffloadPolicy(fused_backward=True, trained_weights="host")
    kept = host.replace(trained_weights_card_blocks="3, 0,1")
    assert kept.trained_card_blocks == frozenset({0, 1, 3}) and host.trained_card_blocks == frozenset()
    assert "trained weights in host RAM (3 blocks' on the card)" in kept.describe()
    assert OffloadPolicy.from_dict(kept.to_dict()) == kept
    with pytest.raises(PolicyError, match="trained_weights_card_blocks keeps these blocks' trained weights on the card"):
        OffloadPolicy(trained_weights_card_blocks="0")
    with pytest.raises(PolicyError, match=r"trained_weights_card_blocks: 'x' is not a block index"):
        host.replace(trained_weights_card_blocks="0,x")
    with pytest.raises(PolicyError, match=r"checkpoint_blocks: 'x' is not a block index"):
        host.replace(checkpoint_blocks="x")
