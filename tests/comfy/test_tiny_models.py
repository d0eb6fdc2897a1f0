"""The built-in tiny models are real ComfyUI objects that stock nodes sample, encode and train with."""
import pytest
import torch

pytestmark = pytest.mark.comfyui

FAMILIES = ["sd15", "sd2", "sdxl", "sd3", "flux", "flux2", "flux2_dev", "chroma", "zimage", "qwen_image", "hidream",
            "hunyuan_image", "krea2", "hidream_o1", "ideogram4", "wan21", "wan21_i2v", "hunyuan_video15", "ltx2"]


def _weights(patcher):
    return {k: v.detach().clone() for k, v in patcher.model.diffusion_model.state_dict().items()}


@pytest.mark.min_torch  # every family's tokenizers and text encoder on the portable build's transformers 4 too
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_samples_with_stock_nodes(comfyui, family):
    import comfy.model_base
    import comfy.sd
    import nodes
    from headroom.nodes.bridge.comfy_model import clear_model_caches
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, clip, vae = build_tiny_models(family, seed=0)
    assert isinstance(model.model, comfy.model_base.BaseModel)
    assert isinstance(clip, comfy.sd.CLIP) and isinstance(vae, comfy.sd.VAE)
    expected_base = {"sd15": comfy.model_base.BaseModel, "sd2": comfy.model_base.BaseModel, "sdxl": comfy.model_base.SDXL,
                     "sd3": comfy.model_base.SD3, "flux": comfy.model_base.Flux, "flux2": comfy.model_base.Flux2,
                     "flux2_dev": comfy.model_base.Flux2,
                     "chroma": comfy.model_base.Chroma, "zimage": comfy.model_base.Lumina2,
                     "qwen_image": comfy.model_base.QwenImage, "hidream": comfy.model_base.HiDream,
                     "hunyuan_image": comfy.model_base.HunyuanImage21, "krea2": comfy.model_base.Krea2,
                     "ideogram4": comfy.model_base.Ideogram4,
                     "hidream_o1": comfy.model_base.HiDreamO1,
                     "wan21": comfy.model_base.WAN21, "wan21_i2v": comfy.model_base.WAN21, "hunyuan_video15": comfy.model_base.HunyuanVideo15,
                     "ltx2": comfy.model_base.LTXAV}
    assert type(model.model) is expected_base[family]
    n_params = sum(p.numel() for p in model.model.diffusion_model.parameters())
    assert 10_000 < n_params < 10_000_000  # zimage: 8.6 M (Z-Image modulation needs width >= 256; see zimage.py)

    with torch.inference_mode():
        positive = nodes.CLIPTextEncode().encode(clip, "a red circle at the center")[0]
        negative = nodes.CLIPTextEncode().encode(clip, "")[0]
        channels = vae.latent_channels
        latent_side = 64 if family == "hidream_o1" else 8  # HiDream-O1: pixels, two of its 32-px patches
        latent = {"samples": torch.zeros(1, channels, latent_side, latent_side)}
        cfg = 1.0 if family in ("flux", "chroma") else 4.0
        samples = nodes.common_ksampler(model, 0, 4, cfg, "euler", "normal", positive, negative, latent)[0]
        image = nodes.VAEDecode().decode(vae, samples)[0]
        # HiDream-O1 keeps its text-prefix K/V across sampler calls (ComfyUI's `clear_kv_cache`): a second call with
        # the same prompt skips that prefix, which rounds differently (~1e-5). The same seed on the same path:
        clear_model_caches(model.model.diffusion_model)
        again = nodes.VAEDecode().decode(vae, nodes.common_ksampler(
            model, 0, 4, cfg, "euler", "normal", positive, negative, latent)[0])[0]
    frames = (1,) if model.model.latent_format.latent_dimensions == 3 else ()  # video latents: qwen_image, wan21, hunyuan_video15, ltx2
    assert samples["samples"].shape == (1, channels, *frames, latent_side, latent_side)
    side = latent_side * model.model.latent_format.spacial_downscale_ratio  # 8x; Flux.2: 16x
    assert vae.spacial_compression_decode() == model.model.latent_format.spacial_downscale_ratio
    assert image.shape == (1, side, side, 3)
    assert torch.isfinite(image).all() and image.std() > 0
    assert torch.equal(image, again), "same seed must give the same image"
    assert torch.isfinite(positive[0][0]).all()
    # The LLM text encoders (Flux.2 Klein's Qwen3, Z-Image's Qwen3, Qwen-Image's Qwen2.5-VL) and Chroma's T5-only
    # encoder have no pooled vector.
    assert (positive[0][1].get("pooled_output") is not None) == (family not in ("flux2", "flux2_dev", "chroma", "zimage",
                                                                                "qwen_image", "hunyuan_image", "krea2", "hidream_o1", "ideogram4", "wan21",
                                                                                "wan21_i2v",
                                                                                "hunyuan_video15", "ltx2"))


def test_flux2_dev_tiny_tokenises_with_the_flux2_template_and_has_a_guidance_input(comfyui):
    """Flux.2 dev's tokenizer comes from its text encoder file (tekken JSON): the tiny one's, given as tokenizer_data,
    tokenises the Flux.2 template's control tokens as Mistral's ids and the prompt byte by byte; its encoder gives
    three stacked Mistral-3 layers per token, and the DiT ComfyUI detects from the tiny weights is dev (guidance)."""
    import comfy.model_detection
    from headroom.nodes.bridge.families import flux2
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, clip, _ = build_tiny_models("flux2_dev", seed=0)
    ids = [token for token, _ in clip.tokenize("a red circle")["mistral3_24b"][0]]
    template = clip.tokenizer.llama_template  # Flux2Tokenizer's
    assert ids[:2] == [1, 17]  # <s> [SYSTEM_PROMPT]
    assert ids[-len("a red circle") - 1:] == [byte + 20 for byte in b"a red circle"] + [4]  # ... [/INST]
    assert len(ids) == 1 + len(template.format("a red circle").encode()) - sum(
        len(t) - 1 for t in ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]"))
    with torch.inference_mode():
        cond = clip.encode_from_tokens_scheduled(clip.tokenize("a red circle"))[0][0]
    assert cond.shape == (1, len(ids), 3 * flux2.TINY_MISTRAL3["hidden_size"])
    detected = comfy.model_detection.detect_unet_config(model.model.diffusion_model.state_dict(), "")
    assert detected["image_model"] == "flux2" and detected["guidance_embed"] is True


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_weights_are_seeded(comfyui, family):
    from headroom.nodes.bridge.tiny_models import build_tiny_model_patcher

    a, b, c = (_weights(build_tiny_model_patcher(family, seed)) for seed in (0, 0, 1))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert all(torch.isfinite(v).all() for v in a.values())


def test_tiny_hidream_tokenizer_is_llama3s_layout_on_a_character_vocabulary(comfyui):
    """HiDream's Llama tokenizer (ComfyUI's ships without its vocabulary file): <|begin_of_text|> first, one token per
    character (a word boundary is one more), padded to 128 with <|eot_id|> as ComfyUI's HiDreamTokenizer pads; CLIP /
    T5 are ComfyUI's shipped ones."""
    from headroom.nodes.bridge.tiny_models import build_tiny_clip

    clip = build_tiny_clip("hidream", 0)
    tokens = clip.tokenize("a red circle")
    llama = [token for token, _ in tokens["llama"][0]]
    text_tokens = 1 + len("a red circle") + 1  # "▁a▁red▁circle" + <|begin_of_text|>
    assert llama[0] == 128000 and len(llama) == 128 and llama[text_tokens:] == [128009] * (128 - text_tokens)
    assert clip.tokenizer.llama.tokenizer.decode(llama[1:text_tokens]) == "a red circle"
    assert len(tokens["t5xxl"][0]) == 128 and len(tokens["l"][0]) == len(tokens["g"][0]) == 77
    with torch.inference_mode():
        cond, extras = clip.encode_from_tokens_scheduled(tokens)[0]
    # T5's 128 tokens; every Llama layer's hidden states (ComfyUI drops the embedding output) over its 128 tokens
    assert cond.shape == (1, 128, 32) and extras["conditioning_llama3"].shape == (1, 2, 128, 32)


# What the tiny tokenizer gave when transformers 5's LlamaTokenizerFast(vocab=..., merges=[]) built it (its token ids
# are what the tiny HiDream's text encoder was trained on); now built with `tokenizers`, on transformers 4 and 5 alike.
LLAMA_IDS_BEFORE = {
    "a photo of  a cat, \u00fcn\u00ef": [128000, 256, 321, 256, 336, 328, 335, 340, 335, 256, 335, 326, 256, 256, 321, 256,
                                   323, 321, 340, 268, 256, 195, 188, 334, 195, 175],
    "": [128000],
    " lead": [128000, 256, 332, 325, 321, 324],
    "x<|eot_id|>y": [128000, 256, 344, 128009, 345],
    "tab\there\nnew \u4e2d": [128000, 256, 340, 321, 322, 9, 328, 325, 338, 325, 10, 334, 325, 343, 256, 228, 184, 173],
}


@pytest.mark.min_torch
def test_tiny_hidream_tokenizer_gives_the_same_ids_on_every_transformers(comfyui):
    """The Windows portable build of early 2026 ships transformers 4.57.1, whose LlamaTokenizerFast takes no
    vocabulary in its constructor (the tiny HiDream failed to build there); the CI's min_torch venv holds that
    release. The folder ComfyUI's class reads gives the ids it gave before, and decodes them back."""
    from transformers import LlamaTokenizerFast

    from headroom.nodes.bridge.families.hidream import tiny_llama3_tokenizer_folder

    tokenizer = LlamaTokenizerFast.from_pretrained(tiny_llama3_tokenizer_folder())
    for text, ids in LLAMA_IDS_BEFORE.items():
        assert tokenizer(text).input_ids == ids, text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text.replace("<|eot_id|>", "").lstrip(" "), text


def test_deep_clone_goes_through_cached_patcher_init(comfyui):
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, clip, vae = build_tiny_models("sd15", seed=3)
    clone = model.clone(force_deepcopy=True)
    assert clone.model is not model.model
    original, copied = _weights(model), _weights(clone)
    assert all(torch.equal(original[k], copied[k]) for k in original)
    for patcher in (clip.patcher, vae.patcher):
        assert patcher.cached_patcher_init is not None
        rebuilt = patcher.cached_patcher_init[0](*patcher.cached_patcher_init[1], disable_dynamic=True)
        rebuilt_sd, sd = rebuilt.model.state_dict(), patcher.model.state_dict()
        assert all(torch.equal(rebuilt_sd[k], sd[k]) for k in sd)


def test_comfyui_native_trainer_runs_on_tiny_model(comfyui):
    """ComfyUI's own TrainLoraNode deep-clones the MODEL through cached_patcher_init: it must work."""
    import nodes
    from comfy_extras.nodes_train import TrainLoraNode
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, clip, vae = build_tiny_models("sd15", seed=0)
    with torch.inference_mode():
        positive = nodes.CLIPTextEncode().encode(clip, "a blue square")[0]
        latent = nodes.VAEEncode().encode(vae, torch.rand(1, 64, 64, 3))[0]
        out = TrainLoraNode.execute(
            model=[model], latents=[latent], positive=[positive], batch_size=[1], steps=[2],
            grad_accumulation_steps=[1], learning_rate=[1e-3], rank=[4], optimizer=["AdamW"],
            loss_function=["MSE"], seed=[0], training_dtype=["fp32"], lora_dtype=["fp32"],
            quantized_backward=[False], algorithm=["LoRA"], gradient_checkpointing=[False],
            checkpoint_depth=[1], offloading=[False], existing_lora=["[None]"], bucket_mode=[False],
            bypass_mode=[False],
        )
    lora, loss_map, steps = out.result
    assert steps == 2 and len(loss_map["loss"]) == 2
    assert any(k.endswith("lora_up.weight") for k in lora)


def test_tiny_model_node_schema(headroom_nodes):
    from headroom.nodes.bridge.tiny_models import FAMILIES as families
    from headroom.nodes.tiny import HeadroomTinyModel

    schema = HeadroomTinyModel.define_schema()
    assert schema.node_id == "HeadroomTinyModel"
    assert [o.io_type for o in schema.outputs] == ["MODEL", "CLIP", "VAE"]
    with pytest.raises(ValueError, match="unknown family 'wan'"):
        HeadroomTinyModel.execute(family="wan", seed=0)
    assert tuple(families) == tuple(FAMILIES)


@pytest.mark.parametrize("family", ["sd15", "flux2", "hunyuan_image"])
def test_training_conds_give_the_image_size_of_the_models_latent_format(comfyui, family):
    """The trainer calls the model's own extra_conds with the image size its latents stand for (8x; Flux.2: 16x),
    as the samplers do (HunyuanImage 2.1: 32x)."""
    from headroom.nodes.bridge.comfy_model import ComfyDenoiser
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, clip, _ = build_tiny_models(family, seed=0)
    denoiser = ComfyDenoiser(model)
    seen = []
    original = model.model.extra_conds

    def recording(**kwargs):
        seen.append((kwargs["width"], kwargs["height"]))
        return original(**kwargs)

    model.model.extra_conds = recording
    try:
        tokens = clip.tokenize("a red circle")
        cond = clip.encode_from_tokens(tokens, return_dict=True)
        cond = {"cross_attn": cond.pop("cond")[0], **{k: v[0] for k, v in cond.items() if torch.is_tensor(v)}}
        x_t = torch.zeros(1, model.model.latent_format.latent_channels, 3, 5)
        denoiser._model_conds(x_t, [cond])
    finally:
        del model.model.extra_conds
    downscale = {"sd15": 8, "flux2": 16, "hunyuan_image": 32}[family]
    assert seen == [(5 * downscale, 3 * downscale)]


def test_flux2_conditioning_widths_and_guidance_per_variant(comfyui):
    """Flux.2 takes the stacked text-encoder layers (3 x its width) and no pooled vector; dev has a guidance input,
    Klein none (real configs on the meta device; the tiny model is Klein-like). A cache of another width is refused."""
    import comfy.model_detection
    from realsize_models import unet_config

    from headroom.nodes.bridge.comfy_model import check_caches, expected_cond_dims
    from headroom.nodes.bridge.tiny_models import build_tiny_model_patcher

    for arch, width, guidance in (("flux2_dev", 15360, True), ("flux2_klein_4b", 7680, False),
                                  ("flux2_klein_9b", 12288, False)):
        config = comfy.model_detection.model_config_from_unet_config(unet_config(arch, (0, 0)))
        model = config.get_model({}, "", device=torch.device("meta"))
        assert expected_cond_dims(model) == {"cross_attn": width}
        assert isinstance(model.diffusion_model.guidance_in, torch.nn.Identity) != guidance, arch
    tiny = build_tiny_model_patcher("flux2", 0).model
    assert expected_cond_dims(tiny) == {"cross_attn": 96} and not tiny.diffusion_model.params.guidance_embed

    class Latents:  # the two things check_caches reads of a latent cache
        latent_channels = 128

        def __len__(self):
            return 1

        def text_key(self, index):
            return "k"

    class Texts:
        def __init__(self, width):
            self.width = width

        def conditioning(self, key):
            return {"cross_attn": torch.zeros(512, self.width)}

    check_caches(tiny, Latents(), Texts(96))
    with pytest.raises(ValueError, match="'cross_attn' is 4096 wide but this model expects 96"):
        check_caches(tiny, Latents(), Texts(4096))


def test_ltx2_text_cache_keeps_the_flag_its_model_reads(comfyui, monkeypatch):
    """LTX-2's encoder marks its output as not yet through the DiT's connectors (`unprocessed_ltxav_embeds`, which
    LTX-2.3-style text decides on); the text cache keeps that flag and training gives it to the model's extra_conds as
    the bool CLIPTextEncode gives the sampler. The tiny model is LTX-2 (2.0) geometry: the connectors take the Gemma
    projection (64 wide here, 3840 released)."""
    import nodes
    from headroom.nodes import cache as cache_nodes, data as data_nodes
    from headroom.nodes.bridge.comfy_model import expected_cond_dims, model_inputs
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, clip, _ = build_tiny_models("ltx2", seed=0)
    with torch.inference_mode():
        images, captions, _ = data_nodes.HeadroomSyntheticDataset.execute(1, 64, 0).args
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, captions, 64, 64, "center", False, 0).args[0]
        texts, report = cache_nodes.HeadroomCacheText.execute(dataset, clip).args
        cached = texts.conditioning(texts.keys()[0])
        encoded = nodes.CLIPTextEncode().encode(clip, captions[0])[0][0]
        given = []
        extra_conds = model.model.extra_conds
        monkeypatch.setattr(model.model, "extra_conds", lambda **kw: given.append(kw) or extra_conds(**kw))
        noise = torch.zeros(1, 128, 1, 2, 2)
        trained = model_inputs(model.model, cached, noise, "cpu")["c_crossattn"].cond
        sampled = extra_conds(cross_attn=cached["cross_attn"].unsqueeze(0), unprocessed_ltxav_embeds=True, device="cpu",
                              noise=noise)["c_crossattn"].cond
    assert encoded[1]["unprocessed_ltxav_embeds"] is True and cached["unprocessed_ltxav_embeds"].item() is True
    assert "not cached" not in report
    assert given[0]["unprocessed_ltxav_embeds"] is True and torch.equal(trained, sampled)
    assert expected_cond_dims(model.model) == {"cross_attn": 64} and cached["cross_attn"].shape[-1] == 64
