"""A Wan 2.1 MODEL whose block weights are ComfyUI's INT8 (the `int8_tensorwise` layout of its mixed-precision loader,
QuantizedTensor weights): Wan's feed-forward hands its down-projection to comfy.ops.linear_input_act, which reads the
layer's weight and, outside training, runs ComfyUI's fused INT8 kernel on the layer itself. With a LoRA or OFT layer
in its place (the training clone, for the validation loss and "unmerged" sampling) that stopped validation with an
AttributeError; the layers Headroom attaches are now always called as modules (comfy_model.training_code_paths)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from family_checks import cached_data, empty_latent, int8_tensorwise, loaded_as_a_file
from test_train_lora_nodes import _init

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]
SAMPLING = dict(sample_seed=3, sample_steps=2, cfg=2.0, sampler_name="euler", scheduler="simple")
PROMPT = "a red circle"


@pytest.fixture(scope="module")
def int8_wan(comfyui):
    """(INT8 MODEL, clip, vae, latent cache, text cache) of the tiny Wan 2.1, loaded as UNETLoader loads a file."""
    import comfy.supported_models

    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, clip, vae = build_tiny_models("wan21", seed=0)
    latents, texts = cached_data(model, clip, vae)
    state_dict = int8_tensorwise(model.model.diffusion_model.state_dict(), ("blocks.",))
    config = comfy.supported_models.WAN21_T2V  # its detection keeps UMT5-XXL's text width: the tiny encoder's here
    int8 = loaded_as_a_file(state_dict, config, {**config.unet_extra_config, "text_dim": 32})
    down = int8.model.diffusion_model.blocks[0].ffn[2].weight
    assert type(down).__name__ == "QuantizedTensor" and down._layout_cls == "TensorWiseINT8Layout"
    return int8, clip, vae, latents, texts


def _validate(run, clip, vae, application):
    from headroom.nodes import train_lora as T

    T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=PROMPT, negative="", loss_timesteps=1, width=32,
                               height=32, lora_application=application, **SAMPLING)
    return load_file(str(run.run_dir.validation_dir / f"step_{run.step:08d}_latents.safetensors"))["samples"]


@pytest.mark.parametrize("kind", ["lora", "oft"])
def test_a_lora_on_an_int8_wan_validates_and_the_as_saved_sample_is_the_stock_one(int8_wan, kind):
    import comfy.model_management
    import nodes

    from headroom.nodes import train_lora as T

    int8, clip, vae, latents, texts = int8_wan
    run = _init(int8, latents, texts, f"int8_wan_{kind}", kind=kind, rank=4, lr=2e-2)
    with torch.inference_mode():
        assert any(path.endswith("ffn.2") for path in run.adapters.layers)  # the layer Wan hands to linear_input_act
        T.HeadroomTrainSteps.execute(run, 3)
        unmerged = _validate(run, clip, vae, "unmerged")
        as_saved = _validate(run, clip, vae, "as_saved_file")
        name = T.HeadroomSaveLora.execute(run, f"headroom/int8_wan_{kind}", "", "fp32").args[0]
        positive = nodes.CLIPTextEncode().encode(clip, PROMPT)[0]
        negative = nodes.CLIPTextEncode().encode(clip, "")[0]
        lora_model = nodes.LoraLoaderModelOnly().load_lora_model_only(int8, name, 1.0)[0]
        stock = nodes.common_ksampler(lora_model, SAMPLING["sample_seed"], SAMPLING["sample_steps"], SAMPLING["cfg"],
                                      SAMPLING["sampler_name"], SAMPLING["scheduler"], positive, negative,
                                      empty_latent(int8, 32, 32))[0]["samples"].float()
        comfy.model_management.unload_all_models()
    print(f"{kind}: as saved vs stock max abs diff {(as_saved - stock).abs().max().item():.3g}; unmerged vs stock "
          f"{(unmerged - stock).abs().max().item():.3g}")
    assert torch.equal(as_saved, stock)
    assert torch.isfinite(unmerged).all() and unmerged.shape == stock.shape
    run.release()
