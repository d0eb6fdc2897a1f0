"""Parking optimizer state and gradients in host RAM, and the optimizer whose state lives there."""
from __future__ import annotations

import copy

import pytest
import torch

from headroom.training.memory.optimizer_parking import HostOptimizer, parked
from headroom.training.core.optimizers import OptimizerConfig, create_optimizer, create_scheduler



def make_params(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(64, 80)), torch.nn.Parameter(torch.randn(80))]


def loss_of(params, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(5, 80, generator=g)
    return ((x @ params[0].T).tanh().sum(0) @ params[0] + params[1]).square().mean()


def run(params, optimizer, steps, between=None, scheduler=None):
    for step in range(steps):
        optimizer.zero_grad()
        loss_of(params, step).backward()
        if between is not None:
            between(step)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return [p.detach().clone() for p in params]


def state_tensors(optimizer):
    return {(i, k): v for i, s in enumerate(optimizer.state.values()) for k, v in s.items() if torch.is_tensor(v)}


@pytest.mark.parametrize("name", ["AdamW", "AdamW8bit", "Prodigy"])
def test_parking_between_backward_and_step_changes_nothing(name):
    config = OptimizerConfig(name=name, lr=1e-2 if name != "Prodigy" else 1.0)
    params = make_params()
    expected = run(params, create_optimizer(params, config, device="cpu"), 4)

    params = make_params()
    optimizer = create_optimizer(params, config, device="cpu")

    def park_and_check(step):
        before = {k: v.clone() for k, v in state_tensors(optimizer).items()}
        grads = [p.grad.clone() for p in params]
        with parked(optimizer, params, exercise_on_cpu=True):
            assert all(p.grad is None for p in params)
            assert all(v is not before_v for v, before_v in zip(state_tensors(optimizer).values(), before.values()))
        assert all(torch.equal(state_tensors(optimizer)[k], v) for k, v in before.items())
        assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))

    assert all(torch.equal(a, b) for a, b in zip(expected, run(params, optimizer, 4, between=park_and_check)))


def test_shared_state_tensors_stay_shared():
    params = [torch.nn.Parameter(torch.randn(64, 80)) for _ in range(2)]  # >= 4096 values: 8-bit state
    optimizer = create_optimizer(params, OptimizerConfig(name="AdamW8bit"), device="cpu")
    sum(p.square().sum() for p in params).backward()
    optimizer.step()
    qmaps = [state["qmap1"] for state in optimizer.state.values() if "qmap1" in state]
    assert len(qmaps) == 2 and qmaps[0] is qmaps[1]  # bitsandbytes shares its quantisation map
    with parked(optimizer, params, exercise_on_cpu=True):
        pass
    after = [state["qmap1"] for state in optimizer.state.values()]
    assert after[0] is after[1] and after[0] is not qmaps[0]


def test_restored_after_an_error_and_cpu_tensors_stay_put_by_default():
    params = make_params()
    optimizer = torch.optim.AdamW(params)
    run(params, optimizer, 1)
    loss_of(params, 9).backward()
    originals = state_tensors(optimizer)
    grads = [p.grad for p in params]
    with parked(optimizer, params):  # CPU tensors are already in host RAM: nothing moves
        assert all(v is originals[k] for k, v in state_tensors(optimizer).items())
        assert all(p.grad is g for p, g in zip(params, grads))
    with pytest.raises(RuntimeError, match="validation failed"):
        with parked(optimizer, params, exercise_on_cpu=True):
            raise RuntimeError("validation failed")
    assert all(torch.equal(v, originals[k]) for k, v in state_tensors(optimizer).items())
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))


def test_paged_states_are_left_to_the_driver():
    params = make_params()
    optimizer = torch.optim.AdamW(params)
    run(params, optimizer, 1)
    paged = optimizer.state[params[0]]["exp_avg"]
    paged.is_paged = True  # what bitsandbytes marks its unified-memory buffers with
    with parked(optimizer, params, exercise_on_cpu=True):
        assert optimizer.state[params[0]]["exp_avg"] is paged
        assert optimizer.state[params[0]]["exp_avg_sq"] is not paged


@pytest.mark.parametrize("name", ["AdamW", "Adafactor", "Prodigy"])
def test_host_optimizer_is_bitwise_the_device_optimizer(name):
    config = OptimizerConfig(name=name, lr=1e-2 if name != "Prodigy" else 1.0, schedule="cosine", warmup_steps=1,
                             total_steps=8)
    params = make_params()
    reference = create_optimizer(params, config)
    expected = run(params, reference, 5, scheduler=create_scheduler(reference, config))

    params = make_params()
    host = HostOptimizer(params, lambda host_params: create_optimizer(host_params, config, device="cpu"))
    assert [p for g in host.param_groups for p in g["params"]] == params
    result = run(params, host, 5, scheduler=create_scheduler(host, config))
    assert all(torch.equal(a, b) for a, b in zip(expected, result))
    assert host.param_groups[0]["lr"] == reference.param_groups[0]["lr"]
    if name == "Prodigy":
        assert host.param_groups[0]["d"] == reference.param_groups[0]["d"]
    assert all(p.grad is None for p in host.host_params)


def test_host_optimizer_checkpoints_are_interchangeable_with_the_device_optimizer():
    config = OptimizerConfig(lr=1e-2)
    params = make_params()
    straight = create_optimizer(params, config)
    expected = run(params, straight, 6)

    params = make_params()
    first = HostOptimizer(params, lambda hp: create_optimizer(hp, config))
    run(params, first, 3)
    # deep copy: state_dict() returns the live tensors, as a checkpoint file would not
    saved_weights, saved_state = [p.detach().clone() for p in params], copy.deepcopy(first.state_dict())

    # resume with the plain optimizer from the host optimizer's checkpoint, and the other way round
    resumed = make_params()
    with torch.no_grad():
        for p, w in zip(resumed, saved_weights):
            p.copy_(w)
    plain = create_optimizer(resumed, config)
    plain.load_state_dict(copy.deepcopy(saved_state))
    for step in range(3, 6):
        plain.zero_grad()
        loss_of(resumed, step).backward()
        plain.step()
    assert all(torch.equal(a, b) for a, b in zip(expected, resumed))

    again = make_params()
    with torch.no_grad():
        for p, w in zip(again, saved_weights):
            p.copy_(w)
    host = HostOptimizer(again, lambda hp: create_optimizer(hp, config))
    host.load_state_dict(saved_state)
    for step in range(3, 6):
        host.zero_grad()
        loss_of(again, step).backward()
        host.step()
    assert all(torch.equal(a, b) for a, b in zip(expected, again))


def test_host_optimizer_refuses_closures_and_empty_parameter_lists():
    params = make_params()
    host = HostOptimizer(params, lambda hp: torch.optim.SGD(hp, lr=0.1))
    with pytest.raises(ValueError, match="closure"):
        host.step(lambda: 0.0)
    with pytest.raises(ValueError, match="no parameters"):
        HostOptimizer([], lambda hp: torch.optim.SGD(hp, lr=0.1))
