"""Optimizer state streamed with its tensor (training/memory/streamed_optimizer_state.py, policy optimizer_state
"streamed"): the state lives in host RAM between steps and crosses to the step's device for each tensor's step inside
backward. The weights equal those of the same run with the state on the device, bit for bit; each state crosses once
each way per step; a checkpoint resumes exactly with its state back in host RAM; the planner counts it. On a CPU the
step's device is the host: the ring, the swaps and the counts run as on a card (the CUDA test runs the crossing)."""
from __future__ import annotations

import pytest
import torch

from headroom.training.memory import planner
from headroom.training.memory.cost import FeatureCost
from headroom.training.memory.policy import OffloadPolicy, PolicyError
from headroom.training.memory import streamed_optimizer_state
from headroom.training.memory.streamed_optimizer_state import streamed_state_cost
from headroom.training.memory.trained_weights_on_host import Crossings
from test_trained_weights_on_host import _train

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = torch.device("cpu")


def _state_bytes(fused) -> int:
    """The bytes of every state tensor the optimizers keep on the step's device (here: all but none)."""
    return sum(v.numel() * v.element_size() for state in fused.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def _same(a, b) -> bool:
    a, b = a.state_dict(), b.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("on_host, precision, optimizer, checkpointed", [
    (False, "fp32", "AdamW", False),           # weights on the device: stepped in fused backward's hook
    (False, "bf16_stochastic", "Adafactor", True),
    (True, "fp32", "Adafactor", True),          # weights in host RAM: stepped on the card in the layer's backward
    (True, "bf16_stochastic", "AdamW", False)])
def test_streamed_state_trains_the_weights_of_the_state_on_the_device(on_host, precision, optimizer, checkpointed):
    kwargs = dict(precision=precision, state="device", optimizer=optimizer, checkpointed=checkpointed, blocks=3,
                  clip=0.05)
    resident, resident_fused, _ = _train(CPU, on_host, **kwargs)
    crossed = []

    def between_steps(fused):  # every state tensor is its host home between steps, landed
        homes = fused.streamed_state._homes
        assert len(homes) == len(fused.params)
        for index, state in fused.state.items():
            assert all(state[name] is home for name, home in homes[index].items())
        crossed.append(fused.streamed_state.bytes_each_way)

    streamed, fused, _ = _train(CPU, on_host, streamed=True, after_step=between_steps, **kwargs)
    assert _same(resident, streamed)
    assert fused.most_gradients_alive == 1
    # the same state, bit for bit
    for index, state in resident_fused.state.items():
        for name, value in state.items():
            other = fused.state[index][name]
            assert (torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other), name
    # Each tensor's state crosses to the step once and back once per step (the first step makes it: back only)
    per_step = _state_bytes(fused)
    assert per_step > 0
    assert crossed[0] == (0, per_step)
    assert [(b[0] - a[0], b[1] - a[1]) for a, b in zip(crossed, crossed[1:])] == [(per_step, per_step)] * 3


def test_a_checkpoint_of_streamed_state_resumes_exactly_with_its_state_in_host_ram():
    """Two steps, saved; a new run loads it (torch puts the state where each tensor is stepped: parked back in host
    RAM at once) and trains two more: the weights of four steps in one go."""
    kwargs = dict(precision="bf16_stochastic", state="device", streamed=True, optimizer="AdamW", checkpointed=True,
                  blocks=2)
    whole, _, _ = _train(CPU, True, steps=4, **kwargs)
    first, fused, _ = _train(CPU, True, steps=2, **kwargs)
    saved = (first.state_dict(), fused.state_dict(), fused.schedule.state_dict(), 2)
    loaded, fused, _ = _train(CPU, True, steps=0, resume=saved, **kwargs)
    homes = fused.streamed_state._homes
    assert len(homes) == len(fused.params) == len(fused.state)
    for index, state in fused.state.items():  # in host RAM, as the optimizer state dict holds it
        assert all(state[name] is home for name, home in homes[index].items())
    resumed, _, _ = _train(CPU, True, steps=2, resume=saved, **kwargs)
    assert _same(whole, resumed)


def test_streamed_needs_fused_backward_and_says_where_the_state_is():
    with pytest.raises(PolicyError, match="streamed.*needs fused_backward on"):
        OffloadPolicy(optimizer_state="streamed")
    policy = OffloadPolicy(optimizer_state="streamed", fused_backward=True)
    assert "optimizer state streamed from host RAM" in policy.describe()
    assert OffloadPolicy.from_dict(policy.to_dict()) == policy


def test_the_staging_buffers_refuse_a_tensor_larger_than_they_were_made_for_or_grow_when_told():
    crossings = Crossings(CPU, (), buffer_bytes=16)
    crossings.to_device(torch.zeros(4))  # 16 bytes: fits
    with pytest.raises(RuntimeError, match=r"\(5,\) torch.float32 tensor does not fit the 16-byte staging buffers"):
        crossings.to_device(torch.zeros(5))
    growing = Crossings(CPU, (), buffer_bytes=16, grow=True)
    home = torch.zeros(4)
    growing.to_host(home, torch.ones(4))  # in flight until landed
    assert torch.equal(growing.to_device(torch.arange(6.0)), torch.arange(6.0)) and growing.buffer_bytes == 24
    assert torch.equal(home, torch.ones(4))  # landed before its buffer went
    # one large buffer per tensor-shaped state entry (AdamW's two fp32 moments; 1 byte each for the 8-bit ones), and
    # a ring of small ones for the rest
    assert streamed_optimizer_state.staging_layout("AdamW", 10 ** 6) == ((2, 4 * 10 ** 6), (32, 1 << 20))
    assert streamed_optimizer_state.staging_layout("AdamW8bit", 10 ** 7)[0] == (2, 10 ** 7)
    assert streamed_optimizer_state.staging_layout("Prodigy", 10 ** 6)[0] == (4, 4 * 10 ** 6)
    assert streamed_optimizer_state.largest_tensor_shaped("Adafactor", [(3072, 3072), (3072,)]) == 3072
    assert streamed_optimizer_state.largest_tensor_shaped("AdamW", [(3072, 3072), (3072,)]) == 3072 ** 2


def test_large_state_entries_cross_through_their_own_ring_and_the_rest_through_the_small_one(monkeypatch):
    """With the small ring's limit lowered below the tiny model's moments, the moments take the large ring (a buffer
    each) and the step counts the small one; a state entry larger than the large ring's buffers grows them: the
    weights stay those of the state on the device."""
    monkeypatch.setattr(streamed_optimizer_state, "SMALL_STATE_BYTES", 64)
    kwargs = dict(precision="fp32", state="device", optimizer="AdamW", checkpointed=False)
    resident, _, _ = _train(CPU, True, **kwargs)
    streamed, fused, _ = _train(CPU, True, streamed=True, **kwargs)
    assert _same(resident, streamed)
    large, small = fused.streamed_state.large, fused.streamed_state.small
    assert large.to_host_bytes > 0 and small.to_host_bytes > 0 and len(large._back) == 2
    moments = sum(v.numel() * v.element_size() for s in fused.state.values() for k, v in s.items()
                  if k != "step" and v.numel() * v.element_size() > 64)
    assert large.to_host_bytes == 4 * moments  # 4 steps
    monkeypatch.setattr(streamed_optimizer_state, "staging_layout", lambda optimizer, largest: ((2, 64), (32, 64)))
    squeezed, fused, _ = _train(CPU, True, streamed=True, **kwargs)  # the large ring's buffers grow to a moment's size
    assert _same(resident, squeezed) and fused.streamed_state.large.buffer_bytes == 4 * max(
        p.numel() for p in fused.params)


def test_the_planner_counts_streamed_state_in_host_ram_one_tensor_on_the_card_and_its_crossings():
    cost = streamed_state_cost("AdamW", 8 * 10 ** 7, 8 * 10 ** 6, 10 ** 6, pinned=True)
    assert cost.training == {"one tensor's optimizer state in its step (AdamW, streamed)": 8 * 10 ** 6}
    small = 32 * (1 << 20)  # each way: 32 small buffers of 1 MiB, and a buffer per moment (4 MB, rounded up to 4 MiB)
    for items in (cost.host, cost.host_added_training, cost.host_added_validation):
        assert items == {"optimizer state (AdamW, streamed from host RAM)": 8 * 10 ** 7,
                         "staging buffers (optimizer state streamed)": 2 * (2 * (1 << 22) + small)}
    assert streamed_state_cost("AdamW", 8 * 10 ** 7, 8 * 10 ** 6, 10 ** 6, pinned=False).host[
        "staging buffers (optimizer state streamed)"] == 2 * (2 * 4 * 10 ** 6 + small)
    spec = planner.TrainableSpec(((64, 32), (32, 32), (16,)), "AdamW", full=True)
    streamed = OffloadPolicy(optimizer_state="streamed", fused_backward=True)
    cost = planner.optimizer_placement_cost(streamed, spec, pinned=False)
    assert cost.training == {"one tensor's optimizer state in its step (AdamW, streamed)": 8 * 64 * 32}
    assert cost.host["optimizer state (AdamW, streamed from host RAM)"] == spec.optimizer_bytes()
    assert isinstance(cost, FeatureCost)
    # offered only with fused backward, between the state on the card and in host RAM
    states = [p.optimizer_state for p in planner.candidate_policies(OffloadPolicy(fused_backward=True))
              if p.base_placement == "resident" and p.checkpointing == "off"]
    assert states == ["gpu", "streamed", "cpu"]
    assert "streamed" not in {p.optimizer_state for p in planner.candidate_policies(OffloadPolicy())}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("on_host", [False, True])
def test_on_cuda_the_state_lives_in_host_ram_and_trains_the_weights_of_the_state_on_the_card(on_host):
    """The crossing itself (pinned staging buffers, non-blocking copies, events): between steps every state tensor the
    optimizer made on the card is in host RAM, and the weights equal those of the state kept on the card."""
    cuda = torch.device("cuda")
    kwargs = dict(precision="bf16_stochastic", state="device", optimizer="AdamW", checkpointed=True, blocks=3)
    resident, _, _ = _train(cuda, on_host, **kwargs)
    places = []

    def between_steps(fused):
        places.extend(v.device.type for state in fused.state.values() for v in state.values()
                      if isinstance(v, torch.Tensor) and v.numel() > 1)

    streamed, fused, _ = _train(cuda, on_host, streamed=True, after_step=between_steps, **kwargs)
    assert places and set(places) == {"cpu"}
    assert fused.streamed_state.pinned
    assert _same(resident, streamed)
