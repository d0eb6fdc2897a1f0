"""The diffusion training objective: which sigma, how x_t is built, what the loss compares.

The model side is described by `SamplingDescriptor`, which the ComfyUI bridge fills from the MODEL's
own `model_sampling` (prediction type, discrete sigma table, flow shift), so training uses exactly
the noise parametrisation ComfyUI samples with:

- eps / v (ComfyUI `EPS`, `V_PREDICTION`, discrete schedule): x_t = x0 + sigma * noise
- flow (ComfyUI `CONST`, SD3 / Flux):                        x_t = sigma * noise + (1 - sigma) * x0
  (times the model's noise_scale on the noise where its sampling settings set one: HiDream-O1's 8.0)

The denoiser returns its x0 estimate (what ComfyUI's `BaseModel.apply_model` returns). The loss in the
model's native space (eps, v or flow velocity) is a per-sample multiple of the x0 error:
  eps:  |eps_hat - eps|^2 = |x0_hat - x0|^2 / sigma^2
  v:    |v_hat - v|^2     = |x0_hat - x0|^2 * (sigma^2 + 1) / sigma^2      (sigma_data = 1)
  flow: |u_hat - u|^2     = |x0_hat - x0|^2 / sigma^2
so one code path serves all three, with min-SNR-gamma weighting on top for eps / v, or the debiased estimation's
(Yu et al. 2024, kohya's debiased_estimation_loss): 1 / sqrt(SNR) for eps, 1 / (SNR + 1) for v, SNR capped at 1000.

`loss_type` l1 / huber compares the native-space error itself, (x0_hat - x0) * sqrt(factor above), with
|e| or torch's Huber loss (quadratic below `huber_delta`, linear above: robust to the outlier samples that
dominate a squared error). min-SNR keeps its per-sample factor on top. The validation loss stays the squared
error whatever the training loss, so validation curves compare across runs.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from ..checks import check_finite

Prediction = Literal["eps", "v", "flow"]
PREDICTIONS = ("eps", "v", "flow")
TIMESTEP_SAMPLINGS = ("uniform", "logit_normal", "shifted")
LOSS_WEIGHTINGS = ("none", "min_snr", "debiased")
# debiased: the SNR is capped here (kohya's cap) so that the least noisy times do not get a zero weight
DEBIASED_SNR_MAX = 1000.0
# multires_noise_iterations: the steps stop where the coarsest noise is 1 latent pixel wide (5-8 steps): more add
# nothing
MULTIRES_ITERATIONS_MAX = 16
LOSS_TYPES = ("mse", "l1", "huber")


@dataclasses.dataclass(frozen=True)
class SamplingDescriptor:
    """How a model turns a noise level into its input; filled from ComfyUI's `model_sampling`.

    sigmas: the discrete sigma table (ascending) for eps / v models; None for flow models, whose sigma
    is the flow time itself in [0, 1]. flow_shift: the model's own time shift in the SD3 form
    sigma = s*t / (1 + (s-1)*t) (Flux's exp(mu) form is converted by the bridge), 1.0 for none.
    """

    prediction: Prediction
    sigmas: torch.Tensor | None = None
    flow_shift: float = 1.0
    # The flow times the model's sampling reaches (trained times are clamped into it): (1e-4, 1) for SD3 / Flux; Cosmos
    # Predict2's rectified flow stops at its EDM sigma range, t = sigma / (1 + sigma) for sigma in [0.002, 80].
    flow_range: tuple[float, float] = (1e-4, 1.0)
    # The factor on the noise in a flow model's input (ComfyUI's CONST.noise_scaling: sigma * (s * noise) + (1 - sigma)
    # * x0): 1.0 for most; HiDream-O1's pixel-space model samples with 8.0. The loss is unchanged: the model's x0
    # estimate still gives its velocity as (x_t - x0_hat) / sigma.
    noise_scale: float = 1.0

    def __post_init__(self):
        if self.prediction not in PREDICTIONS:
            raise ValueError(f"prediction={self.prediction!r} is not one of {PREDICTIONS}")
        if self.prediction != "flow" and (self.sigmas is None or self.sigmas.ndim != 1 or len(self.sigmas) < 2):
            raise ValueError(f"a {self.prediction} model needs its discrete sigma table (1-D, ascending)")


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    timestep_sampling: str = "uniform"  # uniform | logit_normal | shifted
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float | None = None  # for "shifted": None = the model's own flow shift
    loss_weighting: str = "none"  # none | min_snr | debiased
    min_snr_gamma: float = 5.0
    noise_offset: float = 0.0
    loss_type: str = "mse"  # mse | l1 | huber
    huber_delta: float = 0.1
    # The part of the noise range trained, as times in [0, 1] (flow: the noise level sigma itself): a Wan 2.2 A14B
    # expert trains where it samples (high noise: 0.875..1, low noise: 0..0.875). Sampled times are mapped into it.
    noise_min: float = 0.0
    noise_max: float = 1.0
    # The loss weight of what a loss mask leaves out (0: not learned). OneTrainer's "unmasked weight": a little (0.1)
    # keeps the model's backgrounds from drifting while the masked subject is learned.
    masked_out_weight: float = 0.0
    # Input perturbation (Ning et al. 2023; kohya's ip_noise_gamma, diffusers' input_perturbation): the model's input
    # is noised with noise + gamma * extra while the loss still asks for what the noise alone implies, so the model
    # learns from inputs a little off the training images' exact path (less exposure bias). 0: off; 0.1 usual.
    ip_noise_gamma: float = 0.0
    # Multi-resolution (pyramid) noise, kohya's multires_noise_iterations / _discount: coarser normal noise added to the
    # noise at discount^i (`multires_noise`). 0 iterations: off.
    multires_noise_iterations: int = 0
    multires_noise_discount: float = 0.3
    # kohya's noise_offset_random_strength / ip_noise_gamma_random_strength: each sample's offset / perturbation at a
    # strength drawn uniformly from 0 to the setting (per sample here, kohya draws one per batch), so the model sees
    # the whole range rather than one strength.
    noise_offset_random_strength: bool = False
    ip_noise_gamma_random_strength: bool = False

    def validate(self, prediction: Prediction) -> None:
        check_finite("objective", min_snr_gamma=self.min_snr_gamma, logit_mean=self.logit_mean, logit_std=self.logit_std,
                     shift=self.shift, noise_offset=self.noise_offset, huber_delta=self.huber_delta,
                     noise_min=self.noise_min, noise_max=self.noise_max, masked_out_weight=self.masked_out_weight,
                     ip_noise_gamma=self.ip_noise_gamma, multires_noise_discount=self.multires_noise_discount)
        if int(self.multires_noise_iterations) != self.multires_noise_iterations or not \
                0 <= self.multires_noise_iterations <= MULTIRES_ITERATIONS_MAX:
            raise ValueError(f"multires_noise_iterations={self.multires_noise_iterations}: give a whole number from 0 "
                             f"(off) to {MULTIRES_ITERATIONS_MAX}; 6-10 is usual")
        if self.multires_noise_iterations and not 0.0 < self.multires_noise_discount <= 1.0:
            raise ValueError(f"multires_noise_discount={self.multires_noise_discount}: give more than 0, up to 1; 0.3 "
                             "is usual (0.1 for a light touch)")
        if not 0.0 <= self.ip_noise_gamma <= 1.0:
            raise ValueError(f"ip_noise_gamma={self.ip_noise_gamma}: give 0 (off) to 1; 0.1 is usual")
        for name, strength in (("ip_noise_gamma", self.ip_noise_gamma), ("noise_offset", self.noise_offset)):
            if getattr(self, f"{name}_random_strength") and not strength:
                raise ValueError(f"{name}_random_strength draws each sample's {name} from 0 to {name}, and {name} is "
                                 f"0: set {name} (the largest), or turn {name}_random_strength off")
        if not 0.0 <= self.masked_out_weight <= 1.0:
            raise ValueError(f"masked_out_weight={self.masked_out_weight}: give 0 (masked-out parts not learned) to 1 "
                             "(masks ignored)")
        if not 0.0 <= self.noise_min < self.noise_max <= 1.0:
            raise ValueError(f"noise_min={self.noise_min}, noise_max={self.noise_max}: need 0 <= noise_min < noise_max "
                             "<= 1 (the part of the noise range to train; 0 and 1: all of it)")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r}: choose one of {LOSS_TYPES}")
        if self.loss_type == "huber" and self.huber_delta <= 0:
            raise ValueError(f"huber_delta={self.huber_delta} must be > 0")
        if self.timestep_sampling not in TIMESTEP_SAMPLINGS:
            raise ValueError(f"timestep_sampling={self.timestep_sampling!r}: choose one of {TIMESTEP_SAMPLINGS}")
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss_weighting={self.loss_weighting!r}: choose one of {LOSS_WEIGHTINGS}")
        if self.loss_weighting != "none" and prediction == "flow":
            raise ValueError(f"loss_weighting={self.loss_weighting!r} is defined for eps / v models; this is a flow "
                             "model: use 'none'")
        if self.loss_weighting == "min_snr" and self.min_snr_gamma <= 0:
            raise ValueError(f"min_snr_gamma={self.min_snr_gamma} must be > 0")
        if self.logit_std <= 0:
            raise ValueError(f"logit_std={self.logit_std} must be > 0")
        if self.shift is not None and self.shift <= 0:
            raise ValueError(f"shift={self.shift} must be > 0")
        if self.noise_offset < 0:
            raise ValueError(f"noise_offset={self.noise_offset} must be >= 0")


def time_shift(t: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's resolution shift of a time in [0, 1]: more weight on high noise for shift > 1."""
    if shift == 1.0:
        return t
    return shift * t / (1 + (shift - 1) * t)


class Objective:
    """Samples training noise levels and computes the loss for one model parametrisation."""

    def __init__(self, sampling: SamplingDescriptor, config: ObjectiveConfig = ObjectiveConfig()):
        config.validate(sampling.prediction)
        self.sampling = sampling
        self.config = config

    # --- noise levels -------------------------------------------------------------------------------
    def sample_t(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """Times in (0, 1): the fraction of the way from clean (0) to pure noise (1)."""
        cfg = self.config
        if cfg.timestep_sampling == "logit_normal":
            t = torch.sigmoid(cfg.logit_mean + cfg.logit_std * torch.randn(batch, generator=generator))
        else:
            t = torch.rand(batch, generator=generator)
        if cfg.timestep_sampling == "shifted":
            t = time_shift(t, cfg.shift if cfg.shift is not None else self.sampling.flow_shift)
        return self._in_range(t)

    def _in_range(self, t: torch.Tensor) -> torch.Tensor:
        """Times of the whole range mapped into [noise_min, noise_max] (unchanged for the whole range)."""
        low, high = self.config.noise_min, self.config.noise_max
        return t if (low, high) == (0.0, 1.0) else low + (high - low) * t

    def sigma_at(self, t: torch.Tensor) -> torch.Tensor:
        """Noise level for times in [0, 1]. Discrete models pick a table entry, as their sampler does."""
        if self.sampling.prediction == "flow":
            return t.clamp(*self.sampling.flow_range)
        sigmas = self.sampling.sigmas
        index = (t * len(sigmas)).long().clamp(0, len(sigmas) - 1)
        return sigmas[index].float()

    def sample_sigma(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        return self.sigma_at(self.sample_t(batch, generator))

    def sample_noise(self, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        noise = torch.randn(like.shape, generator=generator, dtype=torch.float32)
        if self.config.noise_offset > 0:
            # Per-channel constant offset: lets the model learn overall brightness shifts.
            offset = torch.randn(like.shape[:2] + (1,) * (like.ndim - 2), generator=generator)
            noise = noise + self._strength(self.config.noise_offset, self.config.noise_offset_random_strength, like,
                                           generator) * offset
        if self.config.multires_noise_iterations:
            noise = self.multires_noise(noise, generator)
        return noise

    def multires_noise(self, noise: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Pyramid noise: for i = 0 .. iterations - 1, normal noise at the latent's size divided by r^i (r drawn in
        [2, 4) per step) upsampled bilinearly and added at discount^i, until a side reaches 1; then each sample rescaled
        to unit standard deviation. The coarse parts are low-frequency noise the model must also remove, which helps it
        learn overall tone and contrast (kohya's pyramid noise; per-sample rescaling here, so a sample's noise does not
        depend on the others in its batch). Clips: per frame, the frames kept. Written here: no library has it."""
        height, width = noise.shape[-2:]
        frames = tuple(noise.shape[2:-2])  # () for images, (T,) for clips
        mode = "bilinear" if not frames else "trilinear"
        total = noise
        for i in range(int(self.config.multires_noise_iterations)):
            r = 2.0 + 2.0 * float(torch.rand((), generator=generator))
            small_h, small_w = max(1, int(height / r ** i)), max(1, int(width / r ** i))
            coarse = torch.randn(*noise.shape[:2], *frames, small_h, small_w, generator=generator, dtype=noise.dtype)
            total = total + torch.nn.functional.interpolate(coarse, size=(*frames, height, width), mode=mode) * \
                self.config.multires_noise_discount ** i
            if small_h == 1 or small_w == 1:
                break
        spread = total.flatten(1).std(dim=1).view(-1, *([1] * (noise.ndim - 1)))
        return total / spread

    def sample_perturbation(self, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
        """The input perturbation's extra noise (ip_noise_gamma times a normal draw); None when off (nothing drawn, so
        every other draw of a run is what it was without the setting)."""
        if not self.config.ip_noise_gamma:
            return None
        extra = torch.randn(like.shape, generator=generator, dtype=torch.float32)
        return self._strength(self.config.ip_noise_gamma, self.config.ip_noise_gamma_random_strength, like,
                              generator) * extra

    @staticmethod
    def _strength(largest: float, random_strength: bool, like: torch.Tensor, generator: torch.Generator
                  ) -> float | torch.Tensor:
        """`largest`, or with `random_strength` one strength per sample drawn uniformly in [0, largest) (shaped to
        broadcast over the sample), drawn after the noise it scales so the draws before it are those of a run
        without it."""
        if not random_strength:
            return largest
        return largest * torch.rand(like.shape[0], generator=generator).view(-1, *([1] * (like.ndim - 1)))

    # --- x_t and loss -----------------------------------------------------------------------------------
    def perturbed(self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor, perturbation: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the model's input, the x0 the loss compares its estimate with). Without a perturbation: x_t and x0. With
        one, the input is noised with noise + perturbation and the target is the x0 estimate that would make the
        native output equal its target for the unperturbed noise: x0 + c_skip * (input - x_t), where c_skip is how
        ComfyUI's denoised estimate follows its input at a fixed model output (1 for eps and flow, 1 / (sigma^2 + 1)
        for v, sigma_data = 1). So the native-space loss is exactly kohya's: output vs the clean noise's target."""
        x_t = self.noisy(x0, noise, sigma)
        if perturbation is None:
            return x_t, x0
        model_input = self.noisy(x0, noise + perturbation.to(noise), sigma)
        skip = torch.ones_like(sigma, dtype=torch.float32)
        if self.sampling.prediction == "v":
            skip = 1.0 / (sigma.float().square() + 1.0)
        skip = skip.view(-1, *([1] * (x0.ndim - 1))).to(x0.device)
        return model_input, (x0.float() + skip * (model_input.float() - x_t.float())).to(x0.dtype)

    def noisy(self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        s = sigma.view(-1, *([1] * (x0.ndim - 1))).to(x0)
        if self.sampling.prediction == "flow":
            return s * (self.sampling.noise_scale * noise) + (1.0 - s) * x0
        return x0 + s * noise

    def sample_weight(self, sigma: torch.Tensor, weighting: bool = True) -> torch.Tensor:
        """Per-sample factor turning the x0 error into the native-space loss (and `loss_weighting` on top)."""
        sigma = sigma.float()
        inv_sq = 1.0 / sigma.square()
        if self.sampling.prediction == "v":
            weight = (sigma.square() + 1.0) * inv_sq
        else:
            weight = inv_sq
        snr = inv_sq  # x_t = x0 + sigma*eps  ->  SNR = 1 / sigma^2
        if weighting and self.config.loss_weighting == "debiased":
            capped = snr.clamp(max=DEBIASED_SNR_MAX)
            weight = weight / (capped + 1.0) if self.sampling.prediction == "v" else weight / capped.sqrt()
        if weighting and self.config.loss_weighting == "min_snr":
            gamma = torch.full_like(snr, self.config.min_snr_gamma)
            denominator = snr + 1.0 if self.sampling.prediction == "v" else snr
            weight = weight * torch.minimum(snr, gamma) / denominator
        return weight

    def loss(self, x0_hat: torch.Tensor, x0: torch.Tensor, sigma: torch.Tensor, weighted: bool = True,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """Mean native-space loss over the batch. weighted=False: the plain squared error, no loss_weighting
        (validation).

        mask [B, 1, h, w] (clips: [B, 1, T, h, w], one per latent frame) in 0..1 at latent resolution, broadcast over
        the channels: each sample's loss is the mask-weighted mean over its elements, so what is masked out (0) is not
        learned and a partly masked image weighs as much as a whole one; a sample masked out entirely contributes 0.
        With `masked_out_weight` w, the mask counts as w + (1 - w) * mask: what it leaves out weighs w."""
        if mask is not None and self.config.masked_out_weight:
            mask = self.config.masked_out_weight + (1.0 - self.config.masked_out_weight) * mask
        error = x0_hat.float() - x0.float()
        weight = self.sample_weight(sigma, weighting=weighted).to(error.device)
        if not weighted or self.config.loss_type == "mse":
            return (_per_sample_mean(error.square(), mask) * weight).mean()
        native = self.sample_weight(sigma, weighting=False).to(error.device)
        native_error = error * native.sqrt().view(-1, *([1] * (error.ndim - 1)))
        if self.config.loss_type == "l1":
            elements = native_error.abs()
        else:
            elements = torch.nn.functional.huber_loss(native_error, torch.zeros_like(native_error), reduction="none",
                                                      delta=self.config.huber_delta)
        return (_per_sample_mean(elements, mask) * (weight / native)).mean()  # weight / native: the weighting alone

    def fixed_times(self, count: int) -> torch.Tensor:
        """Evenly spread times for the deterministic validation loss (ends excluded), in the trained noise range."""
        return self._in_range((torch.arange(count, dtype=torch.float32) + 0.5) / count)


def _per_sample_mean(elements: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return elements.flatten(1).mean(dim=1)
    weights = mask.to(elements).expand_as(elements)
    return (elements * weights).flatten(1).sum(dim=1) / weights.flatten(1).sum(dim=1).clamp_min(1e-12)


def step_seed(seed: int, micro_step: int, salt: int = 0) -> int:
    """A seed per micro-step: randomness depends only on (seed, step), so a resumed run draws exactly
    what the straight run drew without saving generator states."""
    return (seed * 1_000_003 + micro_step * 7_919 + salt) % (2**63 - 1)
