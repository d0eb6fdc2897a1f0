"""Pretrains the built-in tiny SD1.5-family model on the synthetic shapes, deterministically from a seed.

    .venv/bin/python workflows/pretrain_tiny.py            # writes nodes/weights/tiny_sd15_shapes.safetensors

What it trains, all through ComfyUI's own classes (the same objects HeadroomTinyModel returns, so the weights
load back into them exactly):

1. The VAE (ComfyUI's AutoencoderKL, the tiny config of nodes/bridge/tiny_models.py) as a plain autoencoder on the
   mean latent (ComfyUI encodes with the mean), with a little latent noise so the decoder tolerates what a
   denoiser produces. It sees shapes in the six palette colours and in random colours: it is the codec and
   never reads a caption. Its latents are then renormalised per channel (folded into quant_conv /
   post_quant_conv) so that latent * 0.18215 (SD1.5's scale factor) has unit variance, as the family expects.
2. The UNet and the tiny CLIP-L text encoder together, at the family's own objective (eps prediction on
   SD1.5's scaled-linear schedule: diffusers' DDPMScheduler draws the timesteps and noise; its sigma table is
   checked against ComfyUI's model_sampling), through ComfyUI's `BaseModel.apply_model`, with min-SNR-5
   weighting, 10 % empty captions (for CFG), a cosine schedule and an EMA of the weights (diffusers'
   optimization / EMAModel). Captions never name the held-out colour (HELD_OUT, green): that is what the
   demo's LoRA teaches.

Writes one fp16 safetensors file with checkpoint-style prefixes (model.diffusion_model. / cond_stage_model. /
first_stage_model.) and the settings as metadata. One CPU thread (torch.set_num_threads(1)) and a fixed
free-memory figure for ComfyUI's chunking (FIXED_FREE_MEMORY): the result is reproducible on a machine, loaded or
not; docs/benchmarks/pretrain_demo.md has the time it took. A dev tool: it needs diffusers, which the nodes do not
(pyproject's `interop` extra; .ci/setup installs it), and is left out of the Registry's archive (.comfyignore).
"""
from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import pathlib
import shutil
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "nodes" / "weights" / "tiny_sd15_shapes.safetensors"
HELD_OUT = "green"
RESOLUTION = 64
# --shape-sizes: training/data/synthetic.py's SIZE_PRESETS (loaded from its file: headroom imports ComfyUI).
_spec = importlib.util.spec_from_file_location("_synthetic_sizes", REPO / "training" / "data" / "synthetic.py")
_synthetic = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(_synthetic)
SHAPE_SIZES = _synthetic.SIZE_PRESETS


FIXED_FREE_MEMORY = 64 << 30  # bytes: enough that nothing is chunked at the tiny model's sizes


def _fixed_free_memory(dev=None, torch_free_too=False):
    return (FIXED_FREE_MEMORY, FIXED_FREE_MEMORY) if torch_free_too else FIXED_FREE_MEMORY


def _import_comfyui_and_headroom() -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from comfy_harness import (
        find_comfyui,  # the demo's discovery: $COMFYUI_PATH, then ~/comfy/ComfyUI, ...
    )

    path, how = find_comfyui()
    if path is None:
        sys.exit(f"pretrain_tiny: {how}")
    sys.path.insert(0, str(path))
    import comfy.options

    comfy.options.enable_args_parsing(False)
    from comfy.cli_args import args

    args.cpu = True
    args.base_directory = tempfile.mkdtemp(prefix="headroom-pretrain-")
    # A throw-away ComfyUI base (its input/ folder): removed when the script ends, as the tests' bases are.
    atexit.register(shutil.rmtree, args.base_directory, ignore_errors=True)
    import comfy.model_management

    # ComfyUI sizes its attention chunks (sub-quadratic on a CPU) and its VAE batches from the free RAM at call
    # time: under a loaded machine the same seed gave other weights (a CI run did). A fixed figure, as much as a
    # quiet machine reports, makes the result depend on the seed alone.
    comfy.model_management.get_free_memory = _fixed_free_memory
    if "headroom" not in sys.modules:
        spec = importlib.util.spec_from_file_location("headroom", REPO / "__init__.py",
                                                      submodule_search_locations=[str(REPO)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["headroom"] = module
        spec.loader.exec_module(module)


def _log(start: float, message: str) -> None:
    print(f"[{(time.monotonic() - start) / 60:5.1f} min] {message}", flush=True)


def vae_images(count: int, seed: int, sizes: dict):
    """Shapes for the autoencoder: half in the palette colours, half in uniformly random colours."""
    import torch
    from headroom.training.data.synthetic import COLOURS, SHAPES, generate_shapes

    data = generate_shapes(count, RESOLUTION, seed, **sizes)
    generator = torch.Generator().manual_seed(seed + 1)
    palette = torch.tensor(list(COLOURS.values()))
    random_colours = torch.rand(count, 3, generator=generator)
    use_palette = torch.rand(count, generator=generator) < 0.5
    picks = palette[torch.randint(len(palette), (count,), generator=generator)]
    colours = torch.where(use_palette[:, None], picks, random_colours)
    images = data.images.clone()
    mask = data.masks.unsqueeze(-1)
    images = torch.where(mask, colours[:, None, None, :], images)
    shapes = torch.tensor([SHAPES.index(label.shape) for label in data.labels])
    # [N, 3, H, W] in -1..1 (the VAE's own input range), the shape masks [N, 1, H, W], the shape indices [N]
    return images.movedim(-1, 1) * 2 - 1, data.masks.unsqueeze(1).float(), shapes


def train_vae(vae, args, start):
    import torch
    from diffusers.optimization import get_cosine_schedule_with_warmup

    from headroom.training.data.synthetic import SHAPES

    ae = vae.first_stage_model
    ae.train().requires_grad_(True)
    images, masks, shapes = vae_images(args.vae_images, args.seed, SHAPE_SIZES[args.shape_sizes])
    # The outline: a 1-pixel band on both sides of the shape's edge. Weighted up, a blob that spills over the
    # edge costs as much as one that falls short of it, so the decoder must draw the outline.
    edges = torch.nn.functional.max_pool2d(masks, 3, 1, 1) + torch.nn.functional.max_pool2d(-masks, 3, 1, 1)
    generator = torch.Generator().manual_seed(args.seed + 2)
    # A probe that names the shape from the window's latent (trained alongside, then dropped): its loss makes the
    # encoder put the shape into the latent early; the plain reconstruction error learns colour and place first
    # and draws every shape as the same disc for a long time.
    side = (args.vae_crop or RESOLUTION) // 8
    probe = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(ae.embed_dim * side * side, 128), torch.nn.SiLU(),
                                torch.nn.Linear(128, len(SHAPES))) if args.vae_shape_probe else torch.nn.Sequential()
    optimizer = torch.optim.AdamW([*ae.parameters(), *probe.parameters()], lr=args.vae_lr, weight_decay=0.0)
    schedule = get_cosine_schedule_with_warmup(optimizer, 50, args.vae_steps)
    for step in range(args.vae_steps):
        index = torch.randint(len(images), (args.vae_batch,), generator=generator)
        batch, mask, edge = crop_around_shapes(args.vae_crop, generator, images[index], masks[index], edges[index])
        # The shape covers ~5 % of the pixels: weighted up, or the plain error is met by a grey blob on the background.
        weight = 1.0 + args.vae_shape_weight * mask + args.vae_edge_weight * edge
        z = ae.encode(batch)
        z_std = z.detach().std().clamp_min(1e-3)
        noisy = z + args.vae_latent_noise * z_std * torch.randn(z.shape, generator=generator)
        out = ae.decode(noisy)
        error = out - batch
        loss = (weight * (error.square() + 0.5 * error.abs())).mean() / weight.mean() + 1e-4 * z.square().mean()
        if args.vae_shape_probe:
            loss = loss + args.vae_shape_probe * torch.nn.functional.cross_entropy(probe(z / z_std), shapes[index])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.vae_steps - 1:
            _log(start, f"vae step {step}/{args.vae_steps} loss {loss.item():.4f}")
    ae.eval().requires_grad_(False)
    _log(start, f"vae round trip of held-back shapes (colour / position / shape): "
                f"{vae_check(vae, SHAPE_SIZES[args.shape_sizes])}")
    return images


def crop_around_shapes(size: int, generator, *tensors):
    """Windows of `size` pixels, on the latent grid (multiples of 8), that hold each image's shape: the autoencoder
    is convolutional and the shape is all there is to learn, so a 32-pixel window costs a quarter of the image."""
    import torch

    images, masks = tensors[0], tensors[1]
    height = images.shape[-1]
    if not size or size >= height:
        return tensors
    corners = []
    for mask, jitter in zip(masks[:, 0], torch.rand(len(masks), 2, generator=generator)):
        corner = []
        for axis, dim in ((1, 0), (0, 1)):
            hits = torch.nonzero(mask.any(dim=axis)).flatten()
            first, last = int(hits[0]) // 8 * 8, max(int(hits[-1]) + 1 - size, 0)  # the window holds [first, last]
            low, high = min(last, height - size), min(first, height - size)
            options = list(range((low + 7) // 8 * 8, high + 1, 8)) or [high]
            corner.append(options[min(int(float(jitter[dim]) * len(options)), len(options) - 1)])
        corners.append(corner)
    return tuple(torch.stack([t[i, :, y:y + size, x:x + size] for i, (y, x) in enumerate(corners)]) for t in tensors)


def vae_check(vae, sizes: dict) -> dict:
    """The pixel classifier's figures on 216 synthetic images (a seed not trained on) encoded and decoded."""
    import torch
    from headroom.training.core.shape_classifier import score
    from headroom.training.data.synthetic import generate_shapes

    data = generate_shapes(216, RESOLUTION, 999_999, **sizes)
    with torch.no_grad():
        decoded = vae.first_stage_model.decode(vae.first_stage_model.encode(data.images.movedim(-1, 1) * 2 - 1))
    return score(((decoded.movedim(1, -1) + 1) / 2).clamp(0, 1), data.labels)


def normalise_latents(vae, images, scale_factor: float) -> None:
    """Folds a per-channel affine into quant_conv (mean rows) and post_quant_conv so that encoded latents
    have mean 0 and std 1 / scale_factor per channel; decoding is unchanged."""
    import torch

    ae = vae.first_stage_model
    with torch.no_grad():
        z = torch.cat([ae.encode(images[i:i + 256]) for i in range(0, len(images), 256)])
        mean = z.mean(dim=(0, 2, 3))
        std = z.std(dim=(0, 2, 3)).clamp_min(1e-4)
        gain = (1.0 / scale_factor) / std  # z' = (z - mean) * gain
        channels = len(mean)
        qw, qb = ae.quant_conv.weight, ae.quant_conv.bias  # [2C, 2C, 1, 1]: rows 0..C-1 give the mean
        qw[:channels] *= gain.view(-1, 1, 1, 1)
        qb[:channels] = (qb[:channels] - mean) * gain
        qb[channels:] += 2 * torch.log(gain)  # logvar follows (unused by ComfyUI's mean encode)
        pw, pb = ae.post_quant_conv.weight, ae.post_quant_conv.bias  # z = z' / gain + mean
        pb += (pw[:, :, 0, 0] @ mean)
        pw /= gain.view(1, -1, 1, 1)


def _clip_layer_forward_out_of_place(self, x, mask=None, optimized_attention=None):
    # ComfyUI's CLIPLayer.forward adds the residuals in place (`x += ...`), which autograd cannot
    # differentiate through (LayerNorm saved that x). Same computation, out of place: training only.
    x = x + self.self_attn(self.layer_norm1(x), mask, optimized_attention)
    return x + self.mlp(self.layer_norm2(x))


def caption_tokens(clip, captions):
    """Token ids (ComfyUI's SD1 tokenizer, 77 long) of each caption, for calling the CLIP-L model directly."""
    return [[token for token, _ in clip.tokenize(caption)["l"][0]] for caption in captions]


def train_denoiser(model, clip, vae, args, start):
    import torch
    from diffusers import DDPMScheduler
    from diffusers.optimization import get_cosine_schedule_with_warmup
    from diffusers.training_utils import EMAModel
    from headroom.training.data.synthetic import generate_shapes

    data = generate_shapes(args.images, RESOLUTION, args.seed + 3, **SHAPE_SIZES[args.shape_sizes])
    keep = [i for i, label in enumerate(data.labels) if label.colour != HELD_OUT]
    images = data.images[keep]
    captions = [data.captions[i] for i in keep]
    base = model.model
    with torch.no_grad():
        # Through ComfyUI's VAE.encode (what HeadroomCacheLatents does), then the family's latent scaling.
        latents = torch.cat([vae.encode(images[i:i + 256]) for i in range(0, len(images), 256)])
        latents = base.process_latent_in(latents).float()
    _log(start, f"denoiser data: {len(captions)} images without {HELD_OUT!r}, latent std {latents.std():.3f}")

    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                              beta_schedule="scaled_linear")
    alphas = scheduler.alphas_cumprod.float()
    sigmas = ((1 - alphas) / alphas).sqrt()
    comfy_sigmas = base.model_sampling.sigmas.float()
    if not torch.allclose(sigmas, comfy_sigmas, rtol=1e-4):
        sys.exit("pretrain_tiny: diffusers' DDPM schedule no longer matches ComfyUI's SD1.5 model_sampling")

    import comfy.clip_model

    comfy.clip_model.CLIPLayer.forward = _clip_layer_forward_out_of_place
    te = clip.cond_stage_model.clip_l
    te.float()  # ComfyUI keeps text encoders in fp16 on a CPU; Adam's eps underflows there (0/0 on unused rows)
    tokens = caption_tokens(clip, captions)
    empty = caption_tokens(clip, [""])[0]
    unet = base.diffusion_model
    unet.train().requires_grad_(True)
    te.train().requires_grad_(True)
    params = [*unet.parameters(), *te.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    schedule = get_cosine_schedule_with_warmup(optimizer, 100, args.steps)
    ema = EMAModel(params, decay=0.999, use_ema_warmup=True, power=2 / 3)
    generator = torch.Generator().manual_seed(args.seed + 4)
    running = None
    for step in range(args.steps):
        index = torch.randint(len(captions), (args.batch,), generator=generator)
        x0 = latents[index]
        drop = torch.rand(args.batch, generator=generator) < 0.1
        batch_tokens = [empty if drop[i] else tokens[int(j)] for i, j in enumerate(index)]
        context = te(batch_tokens)[0]
        timesteps = torch.randint(0, 1000, (args.batch,), generator=generator)
        noise = torch.randn(x0.shape, generator=generator)
        x_t = scheduler.add_noise(x0, noise, timesteps)  # sqrt(ab) x0 + sqrt(1-ab) eps
        sigma = sigmas[timesteps]
        x_comfy = x_t * (1 + sigma.square()).sqrt().view(-1, 1, 1, 1)  # = x0 + sigma * eps, ComfyUI's form
        x0_hat = base.apply_model(x_comfy, sigma, c_crossattn=context)
        snr = 1.0 / sigma.square()
        weight = torch.minimum(snr, torch.full_like(snr, 5.0)) / snr  # min-SNR-5 on the eps loss
        eps_error = (x0_hat - x0).square().flatten(1).mean(1) * snr  # |eps_hat - eps|^2
        loss = (eps_error * weight).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        ema.step(params)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 100 == 0 or step == args.steps - 1:
            _log(start, f"denoiser step {step}/{args.steps} loss {running:.4f}")
    ema.copy_to(params)
    unet.eval().requires_grad_(False)
    te.eval().requires_grad_(False)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT, help="safetensors file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape-sizes", choices=sorted(SHAPE_SIZES), default="large",
                        help="synthetic shape sizes for both stages (see SHAPE_SIZES)")
    parser.add_argument("--vae-steps", type=int, default=800)
    parser.add_argument("--vae-batch", type=int, default=32)
    parser.add_argument("--vae-lr", type=float, default=2e-3)
    parser.add_argument("--vae-images", type=int, default=4096)
    parser.add_argument("--vae-shape-weight", type=float, default=20.0, help="extra loss weight on shape pixels")
    parser.add_argument("--vae-edge-weight", type=float, default=20.0, help="extra loss weight on the outline "
                        "(a pixel either side of the shape's edge)")
    parser.add_argument("--vae-crop", type=int, default=0, help="train the autoencoder on windows of this many "
                        "pixels holding the shape (0: whole images)")
    parser.add_argument("--vae-shape-probe", type=float, default=1.0, help="weight of the shape probe's loss "
                        "on the latent (0: none)")
    parser.add_argument("--vae-latent-noise", type=float, default=0.05, help="latent noise, relative to its std")
    parser.add_argument("--images", type=int, default=216 * 20, help="synthetic images for the denoiser "
                        "(before the held-out colour is removed)")
    parser.add_argument("--steps", type=int, default=3400, help="denoiser + text encoder steps")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    _import_comfyui_and_headroom()
    import safetensors.torch
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    start = time.monotonic()
    with torch.inference_mode(False):
        model, clip, vae = build_tiny_models("sd15", args.seed)
        print("dtypes: unet", next(model.model.diffusion_model.parameters()).dtype, "te",
              next(clip.cond_stage_model.parameters()).dtype, "vae", next(vae.first_stage_model.parameters()).dtype)
        images = train_vae(vae, args, start)
        normalise_latents(vae, images, model.model.latent_format.scale_factor)
        train_denoiser(model, clip, vae, args, start)
    minutes = (time.monotonic() - start) / 60
    state = {}
    for prefix, module in (("model.diffusion_model.", model.model.diffusion_model),
                           ("cond_stage_model.", clip.cond_stage_model), ("first_stage_model.", vae.first_stage_model)):
        for key, value in module.state_dict().items():
            state[prefix + key] = value.detach().to(torch.float16).contiguous()
    settings = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()}
    metadata = {"headroom_family": "sd15", "headroom_held_out_colour": HELD_OUT, "headroom_resolution": str(RESOLUTION),
                "headroom_settings": json.dumps(settings), "headroom_minutes": f"{minutes:.1f}"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(state, str(args.out), metadata=metadata)
    _log(start, f"wrote {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB) in {minutes:.1f} min")


if __name__ == "__main__":
    main()
