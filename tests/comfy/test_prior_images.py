"""Prior (regularisation) images: a second dataset mixed into training at a ratio, evenly interleaved, resumed
exactly, part of the run's identity."""
from __future__ import annotations

import pytest
import torch

from headroom.training.core.trainer import prior_steps_before


@pytest.mark.parametrize("ratio", [0.5, 0.25, 0.3])
def test_prior_steps_are_an_even_interleave_at_the_ratio(ratio):
    flags = [prior_steps_before(m + 1, ratio) > prior_steps_before(m, ratio) for m in range(200)]
    for n in (10, 50, 200):
        assert sum(flags[:n]) == int(n * ratio)  # floor: never ahead of the ratio, at most one behind
    if ratio == 0.5:
        assert flags[:6] == [False, True, False, True, False, True]


def _caches(captions, seed):
    from headroom.nodes import cache as cache_nodes, data as data_nodes

    with torch.inference_mode():
        images, _, _ = data_nodes.HeadroomSyntheticDataset.execute(len(captions), 32, seed).args
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, "\n".join(captions), 32, 32, "center",
                                                                False, 0).args[0]
        return dataset


@pytest.mark.comfyui
def test_prior_images_are_trained_on_at_the_ratio_and_resume_exactly(comfyui):
    from headroom.nodes import cache as cache_nodes
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.core.trainer import NonFiniteLossError
    from test_train_lora_nodes import _data, _init

    model, clip, vae, latents, texts = _data("sd15", count=4)
    with torch.inference_mode():
        prior_set = _caches(["a shape", "another shape", "a shape again"], seed=7)
        prior = dict(prior_latent_cache=cache_nodes.HeadroomCacheLatents.execute(prior_set, vae).args[0],
                     prior_text_cache=cache_nodes.HeadroomCacheText.execute(prior_set, clip).args[0])
    common = dict(rank=8, include_conv=True, lr=2e-2, batch_size=2)

    mixed = _init(model, latents, texts, "prior_mixed", prior_ratio=0.5, **common, **prior)
    assert [mixed.trainer._batch(m)[0] is mixed.trainer._prior for m in range(6)] == [False, True] * 3
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(mixed, 3)
        restarted_model, _, _ = build_tiny_models("sd15", 0)
        resumed = _init(restarted_model, latents, texts, "prior_mixed", prior_ratio=0.5, **common, **prior)
        assert resumed.step == 3
        T.HeadroomTrainSteps.execute(resumed, 8)
        straight = _init(model, latents, texts, "prior_straight", prior_ratio=0.5, **common, **prior)
        T.HeadroomTrainSteps.execute(straight, 8)
    a, b = resumed.adapters.state_dict(), straight.adapters.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), "a resumed run with prior images differs from the straight run"

    # The prior images are part of what the run is: other ones, or none, are another run.
    with pytest.raises(ValueError, match="already exists .*prior_data: stored"):
        _init(model, latents, texts, "prior_mixed", **common)

    # What a prior step trains on is the prior cache's items: poisoned, the second step (the first prior one) fails
    # naming them, after the first (training items) went through.
    class Poisoned:
        def __init__(self, cache):
            self._cache = cache

        def __getattr__(self, name):
            return getattr(self._cache, name)

        def __len__(self):
            return len(self._cache)

        def latent(self, index):
            return torch.full_like(self._cache.latent(index), float("nan"))

    poisoned = _init(model, latents, texts, "prior_poisoned", prior_ratio=0.5, **common,
                     prior_latent_cache=Poisoned(prior["prior_latent_cache"]),
                     prior_text_cache=prior["prior_text_cache"])
    with torch.inference_mode(), pytest.raises(NonFiniteLossError, match=r"step 2.*prior \d"):
        T.HeadroomTrainSteps.execute(poisoned, 4)
    assert poisoned.trainer.loss_history and poisoned.trainer.loss_history[0][0] == 1


@pytest.mark.comfyui
def test_incomplete_prior_inputs_are_refused(comfyui):
    from test_train_lora_nodes import _data, _init

    model, clip, vae, latents, texts = _data("sd15")
    with pytest.raises(ValueError, match="need both prior_latent_cache and prior_text_cache"):
        _init(model, latents, texts, "prior_half", rank=4, prior_latent_cache=latents)
    with pytest.raises(ValueError, match="prior_ratio=0 with prior caches connected"):
        _init(model, latents, texts, "prior_zero", rank=4, prior_latent_cache=latents, prior_text_cache=texts,
              prior_ratio=0.0)
