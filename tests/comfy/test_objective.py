"""The diffusion objective: noise levels, x_t, native-space losses and their weighting."""
from __future__ import annotations

import math

import pytest
import torch

from headroom.training.core.objective import Objective, ObjectiveConfig, SamplingDescriptor, step_seed, time_shift

SIGMAS = torch.linspace(0.03, 14.6, 1000)


def _objective(prediction, **config):
    descriptor = SamplingDescriptor(prediction, sigmas=None if prediction == "flow" else SIGMAS, flow_shift=3.0)
    return Objective(descriptor, ObjectiveConfig(**config))


def test_times_follow_the_chosen_distribution():
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    uniform = _objective("flow").sample_t(20000, g())
    logit = _objective("flow", timestep_sampling="logit_normal", logit_mean=1.0).sample_t(20000, g())
    shifted = _objective("flow", timestep_sampling="shifted").sample_t(20000, g())
    explicit = _objective("flow", timestep_sampling="shifted", shift=1.0).sample_t(20000, g())
    assert 0 < uniform.min() and uniform.max() < 1 and abs(uniform.mean() - 0.5) < 0.01
    assert abs(logit.logit().mean() - 1.0) < 0.03
    assert torch.allclose(shifted, time_shift(uniform, 3.0))  # the model's own shift by default
    assert torch.equal(explicit, uniform)


def test_discrete_models_train_on_their_sigma_table():
    objective = _objective("eps")
    sigma = objective.sample_sigma(1000, torch.Generator().manual_seed(1))
    assert set(sigma.tolist()) <= set(SIGMAS.tolist())
    assert objective.sigma_at(torch.tensor([0.0, 0.9999])).tolist() == [SIGMAS[0].item(), SIGMAS[-1].item()]


def test_x_t_matches_comfyui_noise_scaling_formulas():
    x0, noise, sigma = torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3), torch.tensor([0.2, 0.7])
    s = sigma.view(-1, 1, 1, 1)
    assert torch.allclose(_objective("eps").noisy(x0, noise, sigma), x0 + s * noise)
    assert torch.allclose(_objective("flow").noisy(x0, noise, sigma), s * noise + (1 - s) * x0)


@pytest.mark.parametrize("prediction", ["eps", "v", "flow"])
def test_loss_equals_native_space_mse(prediction):
    """x0_hat built from a native output the way ComfyUI's calculate_denoised does; the loss must be
    exactly the MSE between that output and the native target."""
    g = torch.Generator().manual_seed(2)
    x0, noise, output = (torch.randn(3, 4, 2, 2, generator=g) for _ in range(3))
    sigma = torch.tensor([0.1, 1.0, 5.0]) if prediction != "flow" else torch.tensor([0.05, 0.5, 0.95])
    s = sigma.view(-1, 1, 1, 1)
    objective = _objective(prediction)
    x_t = objective.noisy(x0, noise, sigma)
    if prediction == "eps":
        x0_hat, target = x_t - output * s, noise
    elif prediction == "flow":
        x0_hat, target = x_t - output * s, noise - x0
    else:  # ComfyUI V_PREDICTION with sigma_data = 1
        x0_hat = x_t / (s**2 + 1) - output * s / (s**2 + 1).sqrt()
        target = (x_t / (s**2 + 1) - x0) * (s**2 + 1).sqrt() / s
    expected = (output - target).square().flatten(1).mean(1).mean()
    torch.testing.assert_close(objective.loss(x0_hat, x0, sigma), expected, rtol=1e-5, atol=1e-6)


def _native_case(prediction, seed=2, sigma=None):
    """(x0, x0_hat, sigma, native output, native target), related as ComfyUI's calculate_denoised relates them."""
    g = torch.Generator().manual_seed(seed)
    x0, noise, output = (torch.randn(3, 4, 2, 2, generator=g) for _ in range(3))
    if sigma is None:
        sigma = torch.tensor([0.1, 1.0, 5.0]) if prediction != "flow" else torch.tensor([0.05, 0.5, 0.95])
    s = sigma.view(-1, 1, 1, 1)
    x_t = _objective(prediction).noisy(x0, noise, sigma)
    if prediction == "eps":
        x0_hat, target = x_t - output * s, noise
    elif prediction == "flow":
        x0_hat, target = x_t - output * s, noise - x0
    else:
        x0_hat = x_t / (s**2 + 1) - output * s / (s**2 + 1).sqrt()
        target = (x_t / (s**2 + 1) - x0) * (s**2 + 1).sqrt() / s
    return x0, x0_hat, sigma, output, target


@pytest.mark.parametrize("prediction", ["eps", "v", "flow"])
@pytest.mark.parametrize("loss_type", ["l1", "huber"])
def test_l1_and_huber_compare_the_native_space_error(prediction, loss_type):
    x0, x0_hat, sigma, output, target = _native_case(prediction)
    objective = _objective(prediction, loss_type=loss_type, huber_delta=0.3)
    if loss_type == "l1":
        expected = (output - target).abs().flatten(1).mean(1).mean()
    else:
        expected = torch.nn.functional.huber_loss(output, target, delta=0.3, reduction="none").flatten(1).mean(1).mean()
    torch.testing.assert_close(objective.loss(x0_hat, x0, sigma), expected, rtol=1e-5, atol=1e-6)
    # The validation loss stays the squared error whatever the training loss.
    torch.testing.assert_close(objective.loss(x0_hat, x0, sigma, weighted=False),
                               _objective(prediction).loss(x0_hat, x0, sigma, weighted=False))


def test_huber_is_half_the_squared_error_below_delta_and_min_snr_still_applies():
    x0, x0_hat, sigma, output, target = _native_case("eps", seed=5)
    wide = _objective("eps", loss_type="huber", huber_delta=1e3).loss(x0_hat, x0, sigma)
    torch.testing.assert_close(wide, 0.5 * _objective("eps").loss(x0_hat, x0, sigma), rtol=1e-5, atol=1e-6)
    snr_l1 = _objective("eps", loss_type="l1", loss_weighting="min_snr", min_snr_gamma=5.0).loss(x0_hat, x0, sigma)
    factor = torch.minimum(1 / sigma**2, torch.tensor(5.0)) / (1 / sigma**2)
    expected = ((output - target).abs().flatten(1).mean(1) * factor).mean()
    torch.testing.assert_close(snr_l1, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prediction", ["eps", "v"])
def test_min_snr_gamma_caps_low_noise_weights(prediction):
    sigma = torch.tensor([0.05, 0.2, 1.0, 5.0])
    plain = _objective(prediction).sample_weight(sigma)
    capped = _objective(prediction, loss_weighting="min_snr", min_snr_gamma=5.0).sample_weight(sigma)
    snr = 1 / sigma**2
    factor = torch.minimum(snr, torch.tensor(5.0)) / (snr + 1 if prediction == "v" else snr)
    torch.testing.assert_close(capped, plain * factor)
    assert capped[0] < plain[0] and capped[-1] == plain[-1] * factor[-1]


@pytest.mark.parametrize("prediction", ["eps", "v"])
def test_debiased_weighting_is_kohyas_on_the_native_loss(prediction):
    """loss_weighting debiased: the native-space squared error times 1 / sqrt(SNR) (eps) or 1 / (SNR + 1) (v), SNR =
    1 / sigma^2 capped at 1000, as sd-scripts' apply_debiased_estimation; the validation loss stays unweighted."""
    x0, x0_hat, sigma, output, target = _native_case(prediction, sigma=torch.tensor([0.01, 1.0, 5.0]))  # SNR 1e4: capped
    objective = _objective(prediction, loss_weighting="debiased")
    snr = (1 / sigma**2).clamp(max=1000.0)
    weight = 1 / (snr + 1) if prediction == "v" else 1 / snr.sqrt()
    native = _objective(prediction).sample_weight(sigma)
    per_sample = (output - target).square().flatten(1).mean(1)  # the native-space squared error
    torch.testing.assert_close(objective.loss(x0_hat, x0, sigma), (per_sample * weight).mean(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(objective.loss(x0_hat, x0, sigma, weighted=False), per_sample.mean(), rtol=1e-5,
                               atol=1e-7)
    # the noisiest times weigh the most, relative to the plain loss
    ratio = objective.sample_weight(sigma) / native
    assert ratio[0] < ratio[1] < ratio[2]
    with pytest.raises(ValueError, match="loss_weighting='debiased' is defined for eps / v models; this is a flow"):
        _objective("flow", loss_weighting="debiased")


@pytest.mark.parametrize("prediction", ["eps", "v", "flow"])
def test_input_perturbation_keeps_the_clean_noises_target(prediction):
    """ip_noise_gamma: the model's input is noised with noise + perturbation, and the loss of its x0 estimate is the
    native-space error against the target of the clean noise, as sd-scripts computes it (eps: the noise; v: the
    velocity of the clean x_t; flow: noise - x0). Off: nothing is drawn and x_t, x0 are as before."""
    g = torch.Generator().manual_seed(4)
    x0, noise, output = (torch.randn(3, 4, 2, 2, generator=g) for _ in range(3))
    sigma = torch.tensor([0.1, 1.0, 5.0]) if prediction != "flow" else torch.tensor([0.05, 0.5, 0.95])
    s = sigma.view(-1, 1, 1, 1)
    objective = _objective(prediction, ip_noise_gamma=0.1)
    perturbation = objective.sample_perturbation(x0, torch.Generator().manual_seed(5))
    torch.testing.assert_close(perturbation, 0.1 * torch.randn(x0.shape, generator=torch.Generator().manual_seed(5)))
    model_input, target = objective.perturbed(x0, noise, sigma, perturbation)
    torch.testing.assert_close(model_input, _objective(prediction).noisy(x0, noise + perturbation, sigma))
    clean = objective.noisy(x0, noise, sigma)
    if prediction == "v":  # ComfyUI's V_PREDICTION.calculate_denoised, sigma_data 1
        x0_hat = model_input / (s**2 + 1) - output * s / (s**2 + 1).sqrt()
        native_target = (clean / (s**2 + 1) - x0) * (s**2 + 1).sqrt() / s
    else:  # EPS and CONST: input - output * sigma
        x0_hat = model_input - output * s
        native_target = noise if prediction == "eps" else noise - x0
    expected = (output - native_target).square().flatten(1).mean(1).mean()
    torch.testing.assert_close(objective.loss(x0_hat, target, sigma), expected, rtol=1e-5, atol=1e-6)
    off = _objective(prediction)
    assert off.sample_perturbation(x0, g) is None
    unperturbed = off.perturbed(x0, noise, sigma, None)
    assert torch.equal(unperturbed[0], clean) and unperturbed[1] is x0
    with pytest.raises(ValueError, match=r"ip_noise_gamma=1.5: give 0 \(off\) to 1"):
        _objective(prediction, ip_noise_gamma=1.5)


def test_multires_noise_adds_coarse_noise_and_keeps_unit_spread():
    """multires_noise_iterations: one iteration adds a second full-size draw (discount^0 = 1, upsampling to the same
    size changes nothing), then each sample is rescaled to unit std; more iterations add low-frequency noise
    (visible after pooling); clips keep their frames; off, the noise is the plain draw."""
    like = torch.zeros(3, 4, 32, 48)
    plain = _objective("eps").sample_noise(like, torch.Generator().manual_seed(6))
    torch.testing.assert_close(plain, torch.randn(like.shape, generator=torch.Generator().manual_seed(6)))
    one = _objective("eps", multires_noise_iterations=1).sample_noise(like, torch.Generator().manual_seed(6))
    g = torch.Generator().manual_seed(6)
    first = torch.randn(like.shape, generator=g)
    torch.rand((), generator=g)  # the size factor, unused at i = 0
    total = first + torch.randn(like.shape, generator=g)
    torch.testing.assert_close(one, total / total.flatten(1).std(dim=1).view(-1, 1, 1, 1))
    pyramid = _objective("eps", multires_noise_iterations=8, multires_noise_discount=0.8).sample_noise(
        like, torch.Generator().manual_seed(6))
    assert pyramid.shape == like.shape
    torch.testing.assert_close(pyramid.flatten(1).std(dim=1), torch.ones(3))
    pooled = [torch.nn.functional.avg_pool2d(n, 8).std().item() for n in (plain, pyramid)]
    assert pooled[1] > 2 * pooled[0], pooled  # white noise averages out over 8x8 pixels; the coarse part does not
    clip = _objective("eps", multires_noise_iterations=4).sample_noise(torch.zeros(1, 4, 3, 16, 16),
                                                                      torch.Generator().manual_seed(1))
    assert clip.shape == (1, 4, 3, 16, 16) and torch.isfinite(clip).all()
    with pytest.raises(ValueError, match=r"multires_noise_iterations=17: give a whole number from 0 \(off\) to 16"):
        _objective("eps", multires_noise_iterations=17)
    with pytest.raises(ValueError, match=r"multires_noise_discount=0.0: give more than 0, up to 1"):
        _objective("eps", multires_noise_iterations=6, multires_noise_discount=0.0)
    _objective("eps", multires_noise_discount=0.0)  # unused while off


def test_noise_offset_shifts_each_channel_by_a_constant():
    like = torch.zeros(2, 4, 8, 8)
    plain = _objective("eps").sample_noise(like, torch.Generator().manual_seed(3))
    offset = _objective("eps", noise_offset=0.5).sample_noise(like, torch.Generator().manual_seed(3))
    difference = offset - plain
    assert torch.allclose(difference, difference[:, :, :1, :1].expand_as(difference))
    assert difference.abs().max() > 0


def test_random_strengths_draw_each_samples_offset_and_perturbation_strength():
    """noise_offset_random_strength / ip_noise_gamma_random_strength: each sample's offset / perturbation at a strength
    drawn uniformly in [0, the setting), after the draws a fixed-strength run makes (which are unchanged); on with a
    setting of 0, refused naming both inputs."""
    like = torch.zeros(64, 4, 8, 8)
    g = torch.Generator().manual_seed(3)
    plain = torch.randn(like.shape, generator=g)
    offset = torch.randn(64, 4, 1, 1, generator=g)
    strength = 0.5 * torch.rand(64, generator=g).view(-1, 1, 1, 1)
    random_offset = _objective("eps", noise_offset=0.5, noise_offset_random_strength=True).sample_noise(
        like, torch.Generator().manual_seed(3))
    torch.testing.assert_close(random_offset, plain + strength * offset)
    assert 0 <= strength.min() < 0.1 and 0.4 < strength.max() < 0.5  # the whole range, per sample
    g = torch.Generator().manual_seed(5)
    extra = torch.randn(like.shape, generator=g)
    gamma = 0.1 * torch.rand(64, generator=g).view(-1, 1, 1, 1)
    perturbation = _objective("eps", ip_noise_gamma=0.1, ip_noise_gamma_random_strength=True).sample_perturbation(
        like, torch.Generator().manual_seed(5))
    torch.testing.assert_close(perturbation, gamma * extra)
    assert len(gamma.unique()) == 64
    for name in ("noise_offset", "ip_noise_gamma"):
        with pytest.raises(ValueError, match=f"{name}_random_strength draws each sample's {name} from 0 to {name}, and "
                                             f"{name} is 0: set {name} \\(the largest\\), or turn "
                                             f"{name}_random_strength off"):
            _objective("eps", **{f"{name}_random_strength": True})


def test_bad_objective_settings_are_rejected():
    with pytest.raises(ValueError, match="min_snr' is defined for eps / v"):
        _objective("flow", loss_weighting="min_snr")
    with pytest.raises(ValueError, match="timestep_sampling='cubic'"):
        _objective("eps", timestep_sampling="cubic")
    with pytest.raises(ValueError, match="needs its discrete sigma table"):
        SamplingDescriptor("eps")
    with pytest.raises(ValueError, match="loss_type='l2'"):
        _objective("eps", loss_type="l2")
    with pytest.raises(ValueError, match="huber_delta=0"):
        _objective("eps", loss_type="huber", huber_delta=0.0)
    with pytest.raises(ValueError, match="huber_delta"):
        _objective("eps", loss_type="huber", huber_delta=float("nan"))


def test_step_seeds_differ_per_step_and_salt():
    seeds = {step_seed(0, m, salt) for m in range(100) for salt in (1, 2)}
    assert len(seeds) == 200


@pytest.mark.comfyui
@pytest.mark.parametrize("family", ["sd15", "sd2", "sdxl", "sd3", "flux", "flux2", "chroma", "zimage", "qwen_image",
                                    "krea2", "hidream_o1", "ideogram4"])
def test_descriptor_from_comfyui_model_sampling(comfyui, family):
    from headroom.nodes.bridge.comfy_model import sampling_descriptor
    from headroom.nodes.bridge.tiny_models import build_tiny_model_patcher

    model_sampling = build_tiny_model_patcher(family, 0).model.model_sampling
    descriptor = sampling_descriptor(model_sampling)
    objective = Objective(descriptor)
    t = torch.tensor([0.1, 0.5, 0.9])
    if family in ("sd15", "sd2", "sdxl"):
        assert descriptor.prediction == ("v" if family == "sd2" else "eps")  # the tiny SD2 is SD2.1-768-v
        torch.testing.assert_close(descriptor.sigmas, model_sampling.sigmas.float())
    else:
        assert descriptor.prediction == "flow"
        # The shift in SD3 form reproduces the model's own schedule (Flux's exp(mu) form included).
        torch.testing.assert_close(time_shift(t, descriptor.flow_shift),
                                   torch.tensor([float(model_sampling.percent_to_sigma(1 - float(x))) for x in t]), rtol=1e-5, atol=1e-6)
    if family == "ideogram4":  # ModelType.FLOW: ModelSamplingDiscreteFlow at shift 1.0, timestep multiplier 1.0
        import comfy.model_sampling

        assert isinstance(model_sampling, comfy.model_sampling.ModelSamplingDiscreteFlow)
        assert (float(model_sampling.shift), float(model_sampling.multiplier), descriptor.flow_shift) == (1.0, 1.0, 1.0)
    if family == "hidream_o1":  # its sampling settings: shift 3.0, noise scaled by 8.0 (supported_models.HiDreamO1)
        assert (descriptor.flow_shift, descriptor.noise_scale) == (3.0, 8.0)
    else:
        assert descriptor.noise_scale == 1.0
    x0, noise, sigma = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2), objective.sigma_at(t)
    torch.testing.assert_close(objective.noisy(x0, noise, sigma), model_sampling.noise_scaling(sigma, noise, x0))
    assert math.isfinite(float(objective.loss(x0, x0 + 0.1, sigma)))
