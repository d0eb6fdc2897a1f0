"""Full fine-tuning's memory features (issue 27): fused backward (training/memory/fused_backward.py) and bf16 weights
with stochastic rounding (training/memory/stochastic_rounding.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headroom.training.core.optimizers import OptimizerConfig, create_optimizer, create_scheduler
from headroom.training.memory.fused_backward import FusedBackward, gradients_cost
from headroom.training.memory.stochastic_rounding import stochastic_round_to_bf16


def _model(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 8)).to(dtype)


def _batches(count: int = 6):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=generator), torch.randn(8, 8, generator=generator)) for _ in range(count)]


def _loss(model, x, y):
    return F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)


def _config(name: str) -> OptimizerConfig:
    return OptimizerConfig(name=name, lr=1e-2, schedule="linear", warmup_steps=0, total_steps=10)


def _unfused(model, config, batches):
    optimizer = create_optimizer(model.parameters(), config)
    scheduler = create_scheduler(optimizer, config)
    for x, y in batches:
        _loss(model, x, y).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def _fused(model, config, batches, **options):
    fused = FusedBackward(list(model.parameters()), lambda group: create_optimizer(group, config),
                          lambda opt: create_scheduler(opt, config), **options)
    for x, y in batches:
        _loss(model, x, y).backward()
        fused.after_step()
    return model, fused


@pytest.mark.parametrize("name", ["AdamW", "Adafactor"])
def test_fused_backward_trains_the_weights_of_the_unfused_step(name):
    """The optimizer stepped inside backward, parameter by parameter, gives the weights of the plain step: bitwise in
    fp32 (same optimizer, the schedule advanced once per step), and at most one gradient exists at a time."""
    config = _config(name)
    plain = _unfused(_model(), config, _batches())
    fused_model, fused = _fused(_model(), config, _batches())
    for (name_a, a), (_, b) in zip(plain.named_parameters(), fused_model.named_parameters(), strict=True):
        assert torch.equal(a, b), name_a
    assert fused.most_gradients_alive == 1
    assert all(p.grad is None for p in fused_model.parameters())  # every gradient freed after its step
    assert not torch.equal(_model().state_dict()["0.weight"], fused_model.state_dict()["0.weight"])  # it trained


def test_fused_backward_with_the_state_in_host_ram_trains_the_same_weights():
    """state_on_host (policy optimizer_state cpu): each tensor is stepped on an fp32 copy beside its state, and copied
    back: the plain step's weights bit for bit in fp32; the state is where the host is. The copies of the weight
    and its gradient go into two host buffers the largest tensor's size, made at the first step and reused by every
    tensor of every step (fresh ones were first-touched each step: 1.2-1.4x the host step)."""
    config = _config("AdamW")
    plain = _unfused(_model(), config, _batches())
    fused_model, fused = _fused(_model(), config, _batches(1), state_on_host=True)
    buffers = [b.data_ptr() for b in fused._host_copies]
    largest = max(p.numel() for p in fused_model.parameters())
    assert [b.numel() for b in fused._host_copies] == [largest] * 2
    for x, y in _batches()[1:]:
        _loss(fused_model, x, y).backward()
        fused.after_step()
    assert [b.data_ptr() for b in fused._host_copies] == buffers  # the same buffers every step
    for (name, a), (_, b) in zip(plain.named_parameters(), fused_model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert all(v.device.type == "cpu" for entry in fused.state.values() for v in entry.values()
               if isinstance(v, torch.Tensor))
    assert fused.most_gradients_alive == 1


def test_fused_backward_resumes_exactly():
    config = _config("AdamW")
    batches = _batches(6)
    straight, _ = _fused(_model(), config, batches)
    first, fused = _fused(_model(), config, batches[:3])
    state, schedule = fused.state_dict(), fused.schedule.state_dict()
    weights = {k: v.clone() for k, v in first.state_dict().items()}
    fused.remove()
    resumed = _model(seed=5)
    resumed.load_state_dict(weights)
    again = FusedBackward(list(resumed.parameters()), lambda group: create_optimizer(group, config),
                          lambda opt: create_scheduler(opt, config))
    again.load_state_dict(state)
    again.schedule.load_state_dict(schedule)
    for x, y in batches[3:]:
        _loss(resumed, x, y).backward()
        again.after_step()
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters(), strict=True))
    with pytest.raises(ValueError, match="this run trains"):
        again.load_state_dict({**state, "param_groups": state["param_groups"][:2]})


def test_a_parameter_without_a_gradient_yet_follows_the_schedule_without_a_warning():
    """A parameter the loss does not reach at first (here: until the third step) has not stepped its optimizer when
    the schedule steps: no warning in the user's console, and its first update comes at the schedule's rate for that
    step, as every other parameter's."""
    import warnings

    config = _config("AdamW")
    model = _model()
    unreached = torch.nn.Parameter(torch.zeros(4))
    fused = FusedBackward([*model.parameters(), unreached], lambda group: create_optimizer(group, config),
                          lambda opt: create_scheduler(opt, config))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step, (x, y) in enumerate(_batches(3)):
            loss = _loss(model, x, y) + (unreached.sum() if step == 2 else 0.0)
            loss.backward()
            fused.after_step()
    reference = create_optimizer([torch.nn.Parameter(torch.zeros(1))], config)
    schedule = create_scheduler(reference, config)
    rates = []
    for _ in range(3):
        rates.append(reference.param_groups[0]["lr"])
        reference.step()
        schedule.step()
    assert rates[2] < rates[0]  # the schedule moved
    assert {optimizer.param_groups[0]["lr"] for optimizer in fused.optimizers} == {reference.param_groups[0]["lr"]}
    # AdamW's first move is its rate times the gradient's sign: the third step's rate
    assert torch.allclose(unreached.detach(), torch.full((4,), -rates[2]), rtol=1e-4)


def test_fused_backward_clips_each_parameter_and_refuses_accumulation():
    """Clipping is per parameter (a global norm needs every gradient at once): a huge gradient moves each parameter
    by what a gradient of norm max_grad_norm would."""
    config = OptimizerConfig(name="AdamW", lr=1e-2)
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.zeros(4))
    seen = []
    FusedBackward([param], lambda group: _Recorder(group, seen), max_grad_norm=1.0)
    (param * torch.tensor([3e3, 4e3, 0.0, 0.0])).sum().backward()
    assert torch.linalg.vector_norm(seen[0]).item() == pytest.approx(1.0, rel=1e-4)
    FusedBackward.check_accumulation(1)
    with pytest.raises(ValueError, match="grad_accumulation 2"):
        FusedBackward.check_accumulation(2)
    del config


class _Recorder(torch.optim.Optimizer):
    """An optimizer that records the gradient it is given."""

    def __init__(self, params, seen):
        super().__init__(params, {"lr": 0.0})
        self.seen = seen

    def step(self, closure=None):
        self.seen += [p.grad.clone() for group in self.param_groups for p in group["params"]]


def test_stochastic_rounding_is_unbiased_and_keeps_what_bf16_holds():
    generator = torch.Generator().manual_seed(0)
    exact = torch.tensor([0.0, 1.0, -2.5, 2.0 ** 127, float("inf"), float("-inf")])
    assert torch.equal(stochastic_round_to_bf16(exact, generator).float(), exact.to(torch.bfloat16).float())
    assert torch.isnan(stochastic_round_to_bf16(torch.tensor([float("nan")]), generator)).all()
    # 1 + a quarter of a bf16 step (2^-7 at 1.0): up with probability 1/4, on both signs.
    for value in (1.0 + 2 ** -9, -(1.0 + 2 ** -9)):
        rounded = stochastic_round_to_bf16(torch.full((200_000,), value), generator).float()
        assert set(rounded.abs().unique().tolist()) == {1.0, 1.0 + 2 ** -7}
        assert rounded.mean().item() == pytest.approx(value, abs=2e-5)
        assert (rounded.abs() > 1.0).float().mean().item() == pytest.approx(0.25, abs=0.01)


def test_cpu_rounding_noise_is_unbiased_per_weight_and_follows_its_generator():
    """The CPU's counter-based noise (stochastic_rounding._round_on_cpu, past one 2^20-element chunk): every weight's
    mean over many roundings is its fp32 value, each rounding is one of its two bf16 neighbours, values bf16 holds
    stay, inf and NaN (any payload) stay, and the same generator state gives the same rounding."""
    values = torch.randn(3 * 2 ** 19, generator=torch.Generator().manual_seed(5)) * 10.0 ** torch.randint(
        -6, 6, (3 * 2 ** 19,), generator=torch.Generator().manual_seed(6))
    generator = torch.Generator().manual_seed(0)
    total = torch.zeros_like(values, dtype=torch.float64)
    down = values.to(torch.bfloat16).float()  # a neighbour; the other is one bf16 step away
    rounds = 64
    for _ in range(rounds):
        rounded = stochastic_round_to_bf16(values, generator).float()
        step = (rounded - down).abs()
        assert bool((step <= down.abs() * 2 ** -7 * 1.001).all())  # one of its two neighbours
        total += rounded.double()
    step = torch.ldexp(torch.ones_like(values), torch.frexp(down)[1] - 8).double()  # the gap between its neighbours
    error = (total / rounds - values.double()) / step  # in bf16 steps
    # Unbiased: the signed errors average out over 1.5 M weights; each mean of 64 roundings is within its standard
    # error (at most 1/16 step; 0.039 step expected on average) of the value.
    assert abs(error.mean().item()) < 0.002 and error.abs().mean().item() < 0.045 and error.abs().max().item() < 0.5
    positions = torch.randint(0, values.numel(), (64,), generator=torch.Generator().manual_seed(7))
    special = values.to(torch.bfloat16).float()  # values bf16 holds
    special[positions[:16]] = float("inf")
    special[positions[16:32]] = float("-inf")
    special.view(torch.int32)[positions[32:48]] = -1  # 0xFFFFFFFF: a NaN whose payload fills every bit
    special.view(torch.int32)[positions[48:]] = 0x7FFFFFFF  # adding noise would carry it past the sign bit
    rounded = stochastic_round_to_bf16(special, generator).float()
    nan = torch.isnan(special)
    assert int(nan.sum()) == len(set(positions[32:].tolist())) and torch.isnan(rounded[nan]).all()
    assert torch.equal(rounded[~nan], special[~nan])  # inf, -inf and every value bf16 holds: unchanged
    a, b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert torch.equal(stochastic_round_to_bf16(values, a), stochastic_round_to_bf16(values, b))
    assert not torch.equal(stochastic_round_to_bf16(values, a), stochastic_round_to_bf16(values, b.manual_seed(10)))


def test_bf16_weights_learn_with_stochastic_rounding_where_rounding_to_nearest_stalls():
    """Updates below half a bf16 step vanish when rounded to nearest; stochastic rounding keeps them in expectation.
    Measured as how far each bf16 run went along the fp32 run's path (the projection of its displacement from its
    own start on the fp32 displacement: 1 = all of it; the rounding noise is orthogonal to it on average)."""
    config = OptimizerConfig(name="AdamW", lr=1e-4)
    batches = _batches(40)
    fp32 = _unfused(_model(), config, batches)
    nearest = _unfused(_model(dtype=torch.bfloat16), config, batches)
    stochastic, fused = _fused(_model(dtype=torch.bfloat16), config, batches, bf16_stochastic=True, seed=3)

    def displacement(model):
        start = _model(dtype=next(model.parameters()).dtype)  # the bf16 start is the fp32 one rounded
        return torch.cat([(p.float() - q.float()).flatten() for p, q in zip(model.parameters(), start.parameters())])

    path = displacement(fp32)
    along = {name: (torch.dot(displacement(model), path) / torch.dot(path, path)).item()
             for name, model in (("nearest", nearest), ("stochastic", stochastic))}
    print(f"bf16 runs along the fp32 run's path: {along}")
    assert all(p.dtype == torch.bfloat16 for p in stochastic.parameters())
    assert along["nearest"] < 0.5  # rounding to nearest dropped most of the updates
    assert 0.85 < along["stochastic"] < 1.15
    state = fused.state_dict()
    assert state["state"][0]["exp_avg"].dtype == torch.float32  # fp32 optimizer state
    with pytest.raises(ValueError, match="not all bf16"):
        FusedBackward(list(_model().parameters()), lambda group: create_optimizer(group, config), bf16_stochastic=True)


def test_costs_say_what_full_fine_tuning_keeps():
    shapes = [(1024, 1024), (4096, 1024), (1024,)]
    assert gradients_cost(shapes, 2, fused=False).training == {"gradients (bf16)": 2 * (1024 * 1024 + 4096 * 1024 + 1024)}
    assert gradients_cost(shapes, 2, fused=True).training == {
        "one tensor's gradient (fused backward)": 2 * 4096 * 1024,
        "one tensor's fp32 copy + gradient in its step (stochastic rounding)": 8 * 4096 * 1024}
    assert gradients_cost(shapes, 4, fused=True).training == {"one tensor's gradient (fused backward)": 4 * 4096 * 1024}
