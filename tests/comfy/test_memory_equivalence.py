"""Each memory option leaves training unchanged: the same adapter weights after N steps as the plain run,
bitwise (no option here changes precision), on the engine's real Trainer and on a tiny ComfyUI model.

The toy model calls its blocks the way ComfyUI's DiTs do: two-stream blocks with keyword arguments that
return a tuple, then single-stream blocks; frozen buffers inside the blocks; LoRA on every linear.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from headroom.training.core.adapters import AdapterConfig, AdapterSet, select_targets
from headroom.training.core.objective import SamplingDescriptor
from headroom.training.memory.optimizer_parking import HostOptimizer, parked
from headroom.training.core.optimizers import OptimizerConfig, create_optimizer, create_scheduler
from headroom.training.memory.policy import OffloadPolicy, memory_features
from headroom.training.core.trainer import TrainConfig, Trainer
from memory_caches import MemoryLatentCache, MemoryTextCache

STEPS = 3


class TwoStreamBlock(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.mod = torch.nn.Linear(width, 2 * width)
        self.img_norm = torch.nn.LayerNorm(width)
        self.img_qkv = torch.nn.Linear(width, 3 * width)
        self.txt_qkv = torch.nn.Linear(width, 3 * width)
        self.img_out = torch.nn.Linear(width, width)
        self.txt_out = torch.nn.Linear(width, width)
        self.register_buffer("gate", torch.full((width,), 0.5))

    def forward(self, img, txt, vec):
        shift, scale = self.mod(F.silu(vec)).unsqueeze(1).chunk(2, dim=-1)
        q, k, v = self.img_qkv(self.img_norm(img) * (1 + scale) + shift).chunk(3, dim=-1)
        tq, tk, tv = self.txt_qkv(txt).chunk(3, dim=-1)
        attn = F.scaled_dot_product_attention(torch.cat([q, tq], 1), torch.cat([k, tk], 1), torch.cat([v, tv], 1))
        n = img.shape[1]
        return img + self.img_out(attn[:, :n]) * self.gate, txt + self.txt_out(attn[:, n:])


class SingleStreamBlock(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear1 = torch.nn.Linear(width, 2 * width)
        self.linear2 = torch.nn.Linear(2 * width, width)

    def forward(self, x, vec):
        return x + self.linear2(F.gelu(self.linear1(x + vec.unsqueeze(1))))


class ToyDiT(torch.nn.Module):
    """Predicts eps of [B, 4, 4, 4] latents from [B, T, 8] text."""

    def __init__(self, width=32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.img_in = torch.nn.Linear(4, width)
        self.txt_in = torch.nn.Linear(8, width)
        self.time_in = torch.nn.Linear(1, width)
        self.double_blocks = torch.nn.ModuleList([TwoStreamBlock(width) for _ in range(2)])
        self.single_blocks = torch.nn.ModuleList([SingleStreamBlock(width) for _ in range(2)])
        self.final = torch.nn.Linear(width, 4)
        self.requires_grad_(False)

    def forward(self, x, sigma, context):
        b, c, h, w = x.shape
        img = self.img_in(x.flatten(2).transpose(1, 2))
        txt = self.txt_in(context)
        vec = self.time_in(sigma.log().view(b, 1))
        for block in self.double_blocks:
            img, txt = block(img=img, txt=txt, vec=vec)
        x = torch.cat([txt, img], 1)
        for block in self.single_blocks:
            x = block(x, vec=vec)
        return self.final(x[:, txt.shape[1]:]).transpose(1, 2).reshape(b, c, h, w)


class ToyDenoiser:
    def __init__(self, net):
        self.net = net
        self.device = torch.device("cpu")
        self.sampling = SamplingDescriptor("eps", sigmas=torch.linspace(0.03, 14.6, 1000))

    def to_model_latent(self, latents):
        return latents

    def predict(self, x_t, sigma, conds):
        context = torch.stack([c["cross_attn"] for c in conds])
        s = sigma.view(-1, 1, 1, 1)
        return x_t - self.net(x_t / (s.square() + 1).sqrt(), sigma, context) * s

    def blocks(self):
        return [(f"double_blocks.{i}", b) for i, b in enumerate(self.net.double_blocks)] + \
               [(f"single_blocks.{i}", b) for i, b in enumerate(self.net.single_blocks)]


def make_trainer(optimizer=OptimizerConfig(lr=1e-2)) -> Trainer:
    denoiser = ToyDenoiser(ToyDiT())
    config = AdapterConfig(rank=4, alpha=4, targets="all_linear")
    adapters = AdapterSet(denoiser.net, select_targets(denoiser.net, None, config, [n for n, _ in denoiser.blocks()]), config)
    adapters.attach(denoiser.net)
    g = torch.Generator().manual_seed(0)
    latents = [torch.randn(4, 4, 4, generator=g) for _ in range(4)]
    conds = {f"k{i}": {"cross_attn": torch.randn(3, 8, generator=g)} for i in range(4)}
    return Trainer(denoiser, adapters, MemoryLatentCache(latents, list(conds)),
                   MemoryTextCache(conds, {"cross_attn": torch.zeros(3, 8)}), TrainConfig(batch_size=2, seed=3), optimizer)


def train(trainer: Trainer, around_steps=contextlib.nullcontext, between_steps=None) -> dict[str, torch.Tensor]:
    with torch.inference_mode(False):
        trainer.trainable.train(True)
        with around_steps():
            for _ in range(STEPS):
                trainer.train_step()
                if between_steps is not None:
                    between_steps(trainer)
    return trainer.trainable.state_dict()


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def plain() -> dict[str, torch.Tensor]:
    return train(make_trainer())


def blocks_of(trainer):
    return [m for _, m in trainer.denoiser.blocks()]


@pytest.mark.parametrize("checkpointing", ["blocks", "blocks_cpu_offload"])
@pytest.mark.parametrize("depth", [1, 2])
def test_checkpointing_options_are_bitwise_equal(plain, checkpointing, depth):
    trainer = make_trainer()
    policy = OffloadPolicy(checkpointing=checkpointing, checkpoint_depth=depth)
    result = train(trainer, lambda: memory_features(policy, blocks_of(trainer), "cpu"))
    assert_bitwise(plain, result)
    assert all("forward" not in m.__dict__ for m in trainer.denoiser.net.modules())  # undone


@pytest.mark.parametrize("checkpointing", ["blocks", "blocks_cpu_offload"])
def test_selective_checkpointing_is_bitwise_equal_and_wraps_the_planned_blocks(plain, checkpointing):
    """policy checkpoint_blocks (the planner's selection): exactly those blocks are checkpointed, the rest keep their
    activations, and the trained weights are the plain run's bit for bit."""
    trainer = make_trainer()
    blocks = blocks_of(trainer)
    selection = {0, len(blocks) - 1}
    policy = OffloadPolicy(checkpointing=checkpointing, checkpoint_blocks=",".join(map(str, sorted(selection))))
    wrapped = []

    @contextlib.contextmanager
    def selective():
        with memory_features(policy, blocks, "cpu"):
            wrapped.append({i for i, m in enumerate(blocks) if "forward" in m.__dict__})
            yield

    assert_bitwise(plain, train(trainer, selective))
    assert wrapped == [selection] and len(blocks) > len(selection)
    assert all("forward" not in m.__dict__ for m in trainer.denoiser.net.modules())  # undone


@pytest.mark.parametrize("checkpointing", ["blocks", "blocks_cpu_offload"])
def test_streamed_blocks_are_bitwise_equal(plain, checkpointing):
    trainer = make_trainer()
    host_weights = {n: t for n, t in trainer.denoiser.net.named_parameters()}
    policy = OffloadPolicy(base_placement="streamed", checkpointing=checkpointing)
    streamers = []

    @contextlib.contextmanager
    def streamed():
        with memory_features(policy, blocks_of(trainer), "cpu", exercise_on_cpu=True, record=True) as streamer:
            streamers.append(streamer)
            yield

    assert_bitwise(plain, train(trainer, streamed))
    streamer = streamers[0]
    n = len(blocks_of(trainer))
    backward = [("backward", i) for i in reversed(range(n))]
    # Block 0 is still on the device when the next step starts (installed by the last backward).
    first = [("forward", i) for i in range(n)] + backward
    later = [("forward", i) for i in range(1, n)] + backward
    assert streamer.install_log == first + later * (STEPS - 1)
    assert streamer.max_on_device <= 2
    # detached: the modules hold their own host tensors again
    assert all(t is host_weights[n] for n, t in trainer.denoiser.net.named_parameters())


def test_optimizer_parking_during_validation_is_bitwise_equal(plain):
    reference_losses, parked_losses = [], []

    def validate(losses, park):
        def between(trainer):
            context = parked(trainer.optimizer, trainer.params, exercise_on_cpu=True) if park else contextlib.nullcontext()
            with context:
                if park:
                    assert all(p.grad is None for p in trainer.params)
                losses.append(trainer.validation_loss([0, 1], times=2))
        return between

    reference = train(make_trainer(), between_steps=validate(reference_losses, park=False))
    assert_bitwise(plain, reference)
    assert_bitwise(plain, train(make_trainer(), between_steps=validate(parked_losses, park=True)))
    assert parked_losses == reference_losses


@pytest.mark.parametrize("name", ["AdamW", "Prodigy"])
def test_optimizer_state_on_host_is_bitwise_equal(name):
    config = OptimizerConfig(name=name, lr=1e-2 if name == "AdamW" else 1.0, schedule="cosine", warmup_steps=1,
                             total_steps=10)
    reference = make_trainer(config)
    expected = train(reference)
    trainer = make_trainer(config)
    trainer.optimizer = HostOptimizer(trainer.params, lambda host: create_optimizer(host, config, device="cpu"))
    trainer.scheduler = create_scheduler(trainer.optimizer, config)
    assert_bitwise(expected, train(trainer))
    assert trainer.optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"]
    assert trainer.optimizer.state_dict()["state"].keys() == reference.optimizer.state_dict()["state"].keys()


# --- the real trainer on a tiny ComfyUI model --------------------------------------------------------------
def _tiny_session(tmp_path, family, adapter=None):
    from headroom.nodes.bridge.run_lora import LoraRunConfig, open_lora_run
    from headroom.nodes.bridge.comfy_model import expected_cond_dims, model_family
    from headroom.nodes.bridge.start_image import start_image_node
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, _, _ = build_tiny_models(family)
    g = torch.Generator().manual_seed(0)
    channels = model.model.latent_format.latent_channels
    frames = (2,) * (model.model.latent_format.latent_dimensions - 2)  # video latents (wan21): 2 frames, a 5-frame clip
    latents = [torch.randn(channels, *frames, 8, 8, generator=g) for _ in range(2)]
    dims = expected_cond_dims(model.model)
    cond = lambda: {name: torch.randn(*((5, width) if name == "cross_attn" else (width,)), generator=g)  # noqa: E731
                    for name, width in dims.items()}
    conds = {f"k{i}": cond() for i in range(2)}
    latent_cache = MemoryLatentCache(latents, list(conds))
    latent_cache.buckets = {(64, 64): [0, 1]}
    if start_image_node(model.model):  # image-to-video (wan21_i2v, hunyuan_video15): each item's start conditioning,
        # as cached
        mask = torch.ones(1, *frames, 8, 8)
        mask[:, 0] = 0.0
        starts = [{"concat_latent_image": torch.randn(channels, *frames, 8, 8, generator=g), "concat_mask": mask}
                  for _ in latents]
        latent_cache.start_image, latent_cache.start = start_image_node(model.model), starts.__getitem__
    config = LoraRunConfig(family=model_family(model.model), adapter=adapter or AdapterConfig(rank=4, alpha=4),
                           optimizer=OptimizerConfig(lr=1e-3), train=TrainConfig(batch_size=2, seed=1), holdout=0)
    return open_lora_run(model, latent_cache, MemoryTextCache(conds, cond()), config, tmp_path, "run")


@pytest.mark.comfyui
# flux, flux2, chroma: blocks add in place; wan21, hunyuan_video15: video DiTs on 5-D latents (wan21_i2v and
# hunyuan_video15: with start images); ltx2: both (its blocks take a (video, audio) tuple)
@pytest.mark.parametrize("family", ["sd15", "sd3", "flux", "flux2", "chroma", "wan21", "wan21_i2v", "hunyuan_video15",
                                    "ltx2"])
def test_tiny_comfy_model_streamed_offloaded_checkpoints_bitwise(comfyui, tmp_path, family, monkeypatch):
    import comfy.model_management

    from headroom.nodes.bridge.comfy_model import training_blocks

    monkeypatch.setattr(comfy.model_management, "in_training", True)  # as TrainingRun.train_to sets it
    results, calls, streamers = [], [], []
    policies = (OffloadPolicy(), OffloadPolicy(checkpointing="blocks"),
                OffloadPolicy(base_placement="streamed", checkpointing="blocks_cpu_offload"))
    for index, policy in enumerate(policies):
        session = _tiny_session(tmp_path / str(index), family)
        blocks = [m for _, m in training_blocks(session.patcher.model.diffusion_model)]
        # a layer inside the last block that has one: its block is on the gradient path, so it is recomputed
        inner = next(m for b in reversed(blocks) for m in b.modules() if m is not b and isinstance(m, torch.nn.Linear))
        count = []
        handle = inner.register_forward_pre_hook(lambda *args: count.append(1))

        @contextlib.contextmanager
        def features():
            with memory_features(policy, blocks, session.denoiser.device, exercise_on_cpu=True, record=True,
                                 inplace_inputs=session.denoiser.inplace_blocks) as streamer:
                streamers.append(streamer)
                yield

        with session.attached():
            results.append(train(session.trainer, features))
        handle.remove()
        calls.append(len(count))
        session.release()
    for result in results[1:]:
        assert_bitwise(results[0], result)
    assert calls == [STEPS, 2 * STEPS, 2 * STEPS]  # the checkpointed runs recomputed each block in backward
    assert streamers[:2] == [None, None] and {phase for phase, _ in streamers[2].install_log} == {"forward", "backward"}


@pytest.mark.comfyui
@pytest.mark.parametrize("family", ["sd15", "flux"])  # a UNet; a DiT whose blocks add in place
def test_a_full_fine_tune_leaves_its_trained_base_in_host_ram_bitwise(comfyui, tmp_path, family, monkeypatch):
    """Issue 42: a full fine-tune's training step never reads its trained layers' base (adapters.FullLayer), so the
    streamer leaves those weights where they are (`unread`, the bridge's choice for every full fine-tune on a device):
    every block kept (a resident plan) or some streamed (partial), the run is the plain one bit for bit, and no trained
    layer's base weight is ever swapped for a device copy."""
    import comfy.model_management

    from headroom.nodes.bridge.comfy_model import training_blocks
    from headroom.training.core.adapters import FullLayer

    monkeypatch.setattr(comfy.model_management, "in_training", True)
    policy = OffloadPolicy(checkpointing="blocks")
    results, streamers = [], []
    for index, resident in enumerate([None, "all", (0,)]):
        session = _tiny_session(tmp_path / str(index), family, AdapterConfig(kind="full", targets="all_linear"))
        root = session.patcher.model.diffusion_model
        blocks = [m for _, m in training_blocks(root)]
        unread = session.trained.unread_base_layers()
        layers = list(session.trained.adapters.layers.values())
        assert len(unread) == len(layers) > 0 and all(isinstance(layer, FullLayer) for layer in layers)
        host = {id(t) for base in unread for t in base.parameters()}
        installed = []
        handles = [layer.register_forward_pre_hook(
            lambda m, args: installed.extend(id(t) in host for t in m.base_layer.parameters())) for layer in layers]

        @contextlib.contextmanager
        def features(resident=resident, blocks=blocks, unread=unread, root=root):
            inplace = session.denoiser.inplace_blocks
            if resident is None:  # no streamer: checkpointing alone
                with memory_features(policy, blocks, "cpu", inplace_inputs=inplace) as streamer:
                    assert streamer is None
                    yield
                return
            kept = range(len(blocks)) if resident == "all" else resident
            with memory_features(policy, blocks, "cpu", exercise_on_cpu=True, resident=kept, keep=[root],
                                 unread=unread, inplace_inputs=inplace) as streamer:
                streamers.append((streamer.streamed_blocks(), streamer.slot_bytes(), streamer.kept_bytes()))
                yield

        with session.attached():
            results.append(train(session.trainer, features))
        for handle in handles:
            handle.remove()
        assert installed and all(installed)  # the base weights stayed the host tensors all through
        session.release()
    for result in results[1:]:
        assert_bitwise(results[0], result)
    (all_streamed, all_slot, all_kept), (streamed, slot, kept) = streamers
    assert all_streamed == set() and all_slot == 0 and streamed == set(range(1, len(blocks)))
    assert 0 < slot and kept < all_kept


@pytest.mark.comfyui
def test_validation_images_are_identical_with_the_optimizer_parked(comfyui, tmp_path):
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.nodes.bridge.validation import sample_images

    _, clip, vae = build_tiny_models("sd15")
    session = _tiny_session(tmp_path, "sd15")
    with session.attached():
        train(session.trainer)
    trainer = session.trainer

    def images_and_latents():
        return sample_images(session, clip, vae, ["a red circle"], "", seed=3, steps=3, cfg=2.0, sampler_name="euler",
                             scheduler="normal", width=64, height=64)

    plain = images_and_latents()
    with parked(trainer.optimizer, trainer.params, exercise_on_cpu=True):
        assert all(p.grad is None for p in trainer.params)
        while_parked = images_and_latents()
    assert all(torch.equal(a, b) for a, b in zip(plain, while_parked, strict=True))
    session.release()


@pytest.mark.comfyui
@pytest.mark.parametrize("family", ["sd15", "sd3"])  # a UNet and a DiT
@pytest.mark.parametrize("lora_application", ["as_saved_file", "unmerged"])
def test_validation_on_its_own_placement_samples_the_same_images(comfyui, tmp_path, monkeypatch, family,
                                                                  lora_application):
    """Issue 28 item 3: while sampling, the base keeps to validation's planned share (TrainingRun.sampling_placement,
    after the sampler's own load); the blocks moved out are cast per layer by ComfyUI's partial unload, which gives
    the same images and latents, bitwise, as the base fully on the device. On a CPU nothing is planned (one device),
    so the share is set here and ComfyUI's partial unload runs CPU to CPU."""
    from headroom.nodes.bridge import comfy_bridge
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.nodes.bridge.validation import sample_images

    import comfy.model_management

    _, clip, vae = build_tiny_models(family)
    session = _tiny_session(tmp_path, family)
    with session.attached(), monkeypatch.context() as training:
        training.setattr(comfy.model_management, "in_training", True)  # as TrainingRun.train_to sets it
        train(session.trainer)
    assert session._validation_device_share() is None  # one device: nothing to place

    def images_and_latents():
        return sample_images(session, clip, vae, ["a red circle"], "", seed=3, steps=3, cfg=2.0, sampler_name="euler",
                             scheduler="normal", width=64, height=64, lora_application=lora_application)

    plain = images_and_latents()
    placed_bytes = []  # (moved out, left on the device) as the sampler's first step starts
    keep = comfy_bridge.keep_to_share
    monkeypatch.setattr(comfy_bridge, "keep_to_share",
                        lambda patcher, share: placed_bytes.append((keep(patcher, share), patcher.loaded_size())))
    total = session.placement.patcher.model_size()
    monkeypatch.setattr(session, "_validation_device_share", lambda: total // 3)
    placed = images_and_latents()
    # the sampled model kept to the share, the rest cast per layer; a clone loaded afresh (the saved file's) filled no
    # more than the share, so nothing was moved out (the training clone had been loaded whole for training)
    assert placed_bytes and all(0 < left <= total // 3 for _, left in placed_bytes)
    if lora_application == "as_saved_file":
        assert placed_bytes[0][0] == 0
    assert all(torch.equal(a, b) for a, b in zip(plain, placed, strict=True))
    session.release()


# --- LoRA+ (Optimizer Config loraplus_lr_ratio) --------------------------------------------------------------------
def _make_loraplus_trainer(ratio: float, policy: OffloadPolicy | None = None, kind: str = "lora") -> Trainer:
    trainer = make_trainer(OptimizerConfig(lr=1e-2, loraplus_lr_ratio=ratio))
    if policy is None:
        return trainer
    # the same run under `policy` (the optimizer paths are chosen in Trainer.__init__)
    return Trainer(trainer.denoiser, trainer.trainable, trainer.latent_cache, trainer.text_cache, trainer.config,
                   trainer.optimizer_config, policy=policy)


def test_loraplus_trains_the_up_matrices_at_ratio_times_the_rate():
    """AdamW's first step moves every weight with a gradient by lr (its update is lr * m / sqrt(v) = lr * sign):
    with loraplus_lr_ratio 8 the up matrices (B, zero at the start, so the down matrices get no gradient at the first
    step) move by 8 lr, and at the next step the down matrices at the optimizer's own rate."""
    lr, ratio = 1e-2, 8.0
    trainer = _make_loraplus_trainer(ratio)
    start = trainer.trainable.state_dict()
    with torch.inference_mode(False):
        trainer.trainable.train(True)
        trainer.train_step()
    after = trainer.trainable.state_dict()
    ups = [k for k in start if ".lora_B." in k]
    downs = [k for k in start if ".lora_A." in k]
    assert ups and downs
    moves = {key: (after[key] - start[key]).abs().max().item() for key in ups}
    # (the last two-stream block's text output reaches no prediction in this toy model: no gradient, no move)
    assert sum(move > 0 for move in moves.values()) >= len(ups) - 1
    for key, move in moves.items():
        assert move == 0 or move == pytest.approx(ratio * lr, rel=1e-3), key
    for key in downs:
        assert torch.equal(after[key], start[key]), key
    assert trainer.optimizer.param_groups[0]["lr"] == lr  # the 1x group first: what the chart reports
    with torch.inference_mode(False):
        trainer.train_step()
    moved = max((trainer.trainable.state_dict()[k] - after[k]).abs().max().item() for k in downs)
    # their first gradient at Adam's second step: m = 0.1 g, v = 0.001 g^2, bias-corrected by 1 - 0.9^2 and
    # 1 - 0.999^2: a move of 0.744 lr, at the 1x rate
    assert moved == pytest.approx(lr * (0.1 / 0.19) / (0.001 / (1 - 0.999 ** 2)) ** 0.5, rel=1e-3)


@pytest.mark.parametrize("policy", [OffloadPolicy(fused_backward=True), OffloadPolicy(optimizer_state="cpu"),
                                    OffloadPolicy(fused_backward=True, optimizer_state="cpu")],
                         ids=["fused_backward", "state_on_host", "fused_state_on_host"])
def test_loraplus_is_the_same_on_every_optimizer_path(policy):
    """The learning rates per tensor reach the optimizer stepped inside backward and the one in host RAM: their
    weights are the plain step's bit for bit."""
    expected = train(_make_loraplus_trainer(4.0))
    assert not torch.equal(expected["double_blocks.0.img_qkv.lora_B.default.weight"],
                           train(make_trainer())["double_blocks.0.img_qkv.lora_B.default.weight"])  # the ratio counts
    assert_bitwise(expected, train(_make_loraplus_trainer(4.0, policy)))


def test_loraplus_is_refused_where_there_is_no_up_matrix():
    with pytest.raises(ValueError, match="kind loha has none"):
        denoiser = ToyDenoiser(ToyDiT())
        config = AdapterConfig(kind="loha", rank=4, alpha=4, targets="all_linear")
        adapters = AdapterSet(denoiser.net, select_targets(denoiser.net, None, config,
                                                           [n for n, _ in denoiser.blocks()]), config)
        Trainer(denoiser, adapters, MemoryLatentCache([torch.zeros(4, 4, 4)], ["k"]),
                MemoryTextCache({"k": {"cross_attn": torch.zeros(3, 8)}}, {"cross_attn": torch.zeros(3, 8)}),
                TrainConfig(batch_size=1), OptimizerConfig(loraplus_lr_ratio=4.0))
    with pytest.raises(ValueError, match="Prodigy finds one step size"):
        OptimizerConfig(name="Prodigy", lr=1.0, loraplus_lr_ratio=4.0).validate()
    with pytest.raises(ValueError, match="between 1 \\(off\\) and 64"):
        OptimizerConfig(loraplus_lr_ratio=0.5).validate()
