"""The training engine on a tiny plain-torch denoiser (no ComfyUI): the loop, resume, precision, errors."""
from __future__ import annotations

import copy

import math

import pytest
import torch

from headroom.training.core.adapters import AdapterConfig, AdapterSet, select_targets
from headroom.training.core.objective import ObjectiveConfig, SamplingDescriptor
from headroom.training.core.optimizers import OptimizerConfig
from headroom.training.memory.policy import run_policy
from headroom.training.core.run_dir import RunDir
from headroom.training.core.trainer import NonFiniteLossError, TrainConfig, Trainer
from memory_caches import MemoryLatentCache, MemoryTextCache

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ToyBlock(torch.nn.Module):
    def __init__(self, width: int, cond_dim: int):
        super().__init__()
        self.to_q = torch.nn.Linear(width, width)
        self.to_k = torch.nn.Linear(cond_dim, width)
        self.mlp = torch.nn.Linear(width, width)

    def forward(self, x, context, emb):
        attn = torch.softmax(self.to_q(x) @ self.to_k(context).transpose(1, 2) / math.sqrt(x.shape[-1]), dim=-1)
        x = x + attn @ self.to_k(context)
        return x + torch.nn.functional.silu(self.mlp(x + emb))


class ToyNet(torch.nn.Module):
    """An eps-prediction denoiser of [B, 4, 4, 4] latents conditioned on [B, T, 8] text."""

    def __init__(self, channels=4, cond_dim=8, width=32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.proj_in = torch.nn.Linear(channels, width)
        self.time = torch.nn.Linear(1, width)
        self.blocks = torch.nn.ModuleList([ToyBlock(width, cond_dim) for _ in range(2)])
        self.proj_out = torch.nn.Linear(width, channels)
        self.requires_grad_(False)

    def forward(self, x, sigma, context):
        b, c, h, w = x.shape
        tokens = self.proj_in(x.flatten(2).transpose(1, 2))
        emb = self.time(sigma.log().view(b, 1, 1))
        for block in self.blocks:
            tokens = block(tokens, context, emb)
        return self.proj_out(tokens).transpose(1, 2).reshape(b, c, h, w)


class ToyDenoiser:
    """The engine's Denoiser protocol over ToyNet, with ComfyUI's EPS parametrisation."""

    def __init__(self, net: ToyNet):
        self.net = net
        self.device = torch.device("cpu")
        self.sampling = SamplingDescriptor("eps", sigmas=torch.linspace(0.03, 14.6, 1000))

    def to_model_latent(self, latents):
        return latents * 0.5

    def predict(self, x_t, sigma, conds):
        context = torch.stack([c["cross_attn"] for c in conds])
        s = sigma.view(-1, 1, 1, 1)
        eps = self.net(x_t / (s.square() + 1).sqrt(), sigma, context)
        return x_t - eps.float() * s

    def blocks(self):
        return [(f"blocks.{i}", b) for i, b in enumerate(self.net.blocks)]


def toy_data(count=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    latents = [torch.randn(4, 4, 4, generator=g) for _ in range(count)]
    conds = {f"k{i}": {"cross_attn": torch.randn(3, 8, generator=g)} for i in range(count)}
    return MemoryLatentCache(latents, [f"k{i}" for i in range(count)]), MemoryTextCache(conds, {"cross_attn": torch.zeros(3, 8)})


def make_trainer(run_dir=None, config=TrainConfig(batch_size=2, seed=3), optimizer=OptimizerConfig(lr=1e-2),
                 adapter=AdapterConfig(rank=4, alpha=4, targets="all_linear"), train_items=None, policy=None,
                 text_cache=None):
    denoiser = ToyDenoiser(ToyNet())
    paths = select_targets(denoiser.net, None, adapter, [n for n, _ in denoiser.blocks()])
    adapters = AdapterSet(denoiser.net, paths, adapter)
    adapters.attach(denoiser.net)
    latents, texts = toy_data()
    texts = text_cache if text_cache is not None else texts
    return Trainer(denoiser, adapters, latents, texts, config, optimizer, train_items=train_items, run_dir=run_dir,
                   policy=policy)


def test_training_lowers_loss_and_validation_loss():
    trainer = make_trainer(config=TrainConfig(batch_size=4, seed=1), train_items=[0, 1, 2, 3])
    before = trainer.validation_loss([0, 1, 2, 3], times=4)
    assert trainer.validation_loss([0, 1, 2, 3], times=4) == before  # deterministic
    trainer.train_to(150)
    assert trainer.step == 150
    first = sum(l for _, l in trainer.loss_history[:10]) / 10
    last = sum(l for _, l in trainer.loss_history[-10:]) / 10
    assert last < 0.7 * first
    assert trainer.validation_loss([0, 1, 2, 3], times=4) < 0.7 * before


def test_train_to_same_step_does_no_work():
    trainer = make_trainer()
    trainer.train_to(3)
    weights = [p.clone() for p in trainer.params]
    trainer.train_to(3)
    trainer.train_to(2)
    assert trainer.step == 3 and len(trainer.loss_history) == 3
    assert all(torch.equal(a, b) for a, b in zip(weights, trainer.params))


@pytest.mark.parametrize("optimizer", ["AdamW", "Prodigy"])
def test_resume_is_bitwise_equal_to_straight_run(tmp_path, optimizer):
    config = TrainConfig(batch_size=2, grad_accum=2, seed=5, caption_dropout=0.3,
                         objective=ObjectiveConfig(timestep_sampling="logit_normal", noise_offset=0.05))
    opt = OptimizerConfig(name=optimizer, lr=1e-2 if optimizer == "AdamW" else 1.0, schedule="cosine",
                          warmup_steps=3, total_steps=20)
    adapter = AdapterConfig(kind="lora", rank=4, alpha=4, targets="all_linear", dropout=0.1)
    straight = make_trainer(config=config, optimizer=opt, adapter=adapter)
    straight.train_to(12)

    first = make_trainer(RunDir(tmp_path, "run"), config=config, optimizer=opt, adapter=adapter)
    first.train_to(6)
    first.save()
    torch.manual_seed(1234)  # a restart: whatever the global RNG holds now must not matter
    second = make_trainer(RunDir(tmp_path, "run"), config=config, optimizer=opt, adapter=adapter)
    assert second.resume() and second.step == 6
    second.train_to(12)
    for key, value in straight.trainable.state_dict().items():
        assert torch.equal(value, second.trainable.state_dict()[key]), key
    assert second.loss_history == straight.loss_history


def test_gradient_accumulation_averages_micro_step_gradients():
    config = TrainConfig(batch_size=2, grad_accum=2, seed=2, max_grad_norm=0)
    trainer = make_trainer(config=config)
    trainer.train_step()  # gradients stay on the parameters until the next step zeroes them
    accumulated = [p.grad.clone() for p in trainer.params]

    reference = make_trainer(config=config)
    with torch.inference_mode(False):
        losses = [reference._micro_step_loss(m)[0] for m in (0, 1)]
        ((losses[0] + losses[1]) / 2).backward()
    for a, b in zip(accumulated, reference.params):
        torch.testing.assert_close(a, b.grad, rtol=1e-5, atol=1e-7)


def test_gradient_checkpointing_gives_identical_weights():
    plain = make_trainer()
    plain.train_to(3)
    # the training nodes' gradient_checkpointing=True, checkpoint_depth=2, as the run's policy resolves them
    checkpointed = make_trainer(policy=run_policy(None, gradient_checkpointing=True, checkpoint_depth=2))
    assert (checkpointed.policy.checkpointing, checkpointed.policy.checkpoint_depth) == ("blocks", 2)
    checkpointed.train_to(3)
    for a, b in zip(plain.params, checkpointed.params):
        assert torch.equal(a, b)
    # restored: no instance-level forward remains on the blocks
    assert all("forward" not in m.__dict__ for m in checkpointed.denoiser.net.modules())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_trains_with_fp32_adapter_weights(precision):
    trainer = make_trainer(config=TrainConfig(batch_size=4, seed=1, precision=precision), optimizer=OptimizerConfig(lr=1e-2))
    trainer.train_to(40)
    assert all(p.dtype == torch.float32 for p in trainer.params)
    assert (trainer.scaler is not None) == (precision == "fp16")
    assert trainer.loss_history[-1][1] < trainer.loss_history[0][1]


def test_non_finite_loss_names_step_and_keeps_last_good_checkpoint(tmp_path):
    trainer = make_trainer(RunDir(tmp_path, "nan"))
    trainer.train_to(2)
    good = trainer.trainable.state_dict()
    trainer.denoiser.net.proj_out.bias.data[:] = float("nan")  # corrupt the model
    with pytest.raises(NonFiniteLossError, match=r"at step 3.*learning rate.*step 2"):
        trainer.train_to(5)
    restored = make_trainer(RunDir(tmp_path, "nan"))
    assert restored.resume() and restored.step == 2
    for key, value in good.items():
        assert torch.equal(restored.trainable.state_dict()[key], value)


def test_no_host_sync_between_forward_and_backward(monkeypatch):
    """The loss is read back once, after the last backward of the step (issue 41 item 4): the device keeps its queue
    across the forward -> backward turn. The losses reported are those .item() gives, bit for bit."""
    trainer = make_trainer(config=TrainConfig(batch_size=2, seed=3, grad_accum=2))
    events, read = [], []
    predict, micro = trainer.denoiser.predict, trainer._micro_step_loss
    monkeypatch.setattr(trainer.denoiser, "predict", lambda *a: events.append("forward") or predict(*a))

    def micro_step_loss(*args):
        loss, items = micro(*args)
        read.append(float(loss.detach().clone()))  # the test's own read, on a copy: not the trainer's
        loss.register_hook(lambda grad: events.append("backward"))
        return loss, items

    monkeypatch.setattr(trainer, "_micro_step_loss", micro_step_loss)
    for name in ("item", "tolist"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, _o=original: events.append("sync") or _o(self))
    trainer.train_to(2)
    turns = [events[k + 1] for k, event in enumerate(events) if event == "forward"]
    assert turns == ["backward"] * 4  # each forward straight into its backward, no read in between
    assert events[:5] == ["forward", "backward", "forward", "backward", "sync"]  # read once, after the last
    assert [loss for _, loss in trainer.loss_history] == [(read[0] + read[1]) / 2, (read[2] + read[3]) / 2]


def test_a_non_finite_loss_read_after_backward_still_stops_before_the_optimizer(tmp_path):
    """The check moved after backward: the same error, the weights, optimizer state and step untouched."""
    trainer = make_trainer(RunDir(tmp_path, "late"), config=TrainConfig(batch_size=2, seed=3, grad_accum=2))
    trainer.train_to(1)
    weights = {k: v.clone() for k, v in trainer.trainable.state_dict().items()}
    state = copy.deepcopy(trainer.optimizer.state_dict())
    trainer.denoiser.net.proj_out.bias.data[:] = float("nan")
    with pytest.raises(NonFiniteLossError, match=r"training loss became nan at step 2.*among items"):
        trainer.train_to(3)
    assert trainer.step == 1 and len(trainer.loss_history) == 1
    assert all(torch.equal(trainer.trainable.state_dict()[k], v) for k, v in weights.items())
    assert str(trainer.optimizer.state_dict()) == str(state)


def test_a_checkpoint_is_written_from_the_live_weights_without_a_copy(tmp_path, monkeypatch):
    """save() hands the run folder the trained tensors themselves (and the EMA's): a copy of a full fine-tune's
    difference is the size of the trained weights, on their device (an SDXL full fine-tune's save peaked 4.8 GiB
    higher on it). The file still holds that step's values."""
    trainer = make_trainer(RunDir(tmp_path, "live"), config=TrainConfig(batch_size=2, seed=3, ema_decay=0.9),
                           adapter=AdapterConfig(targets="all_linear", kind="full"))
    trainer.train_to(1)
    written = []
    write = RunDir.save_checkpoint
    monkeypatch.setattr(RunDir, "save_checkpoint", lambda self, checkpoint: (written.append(checkpoint),
                                                                            write(self, checkpoint))[1])
    trainer.save()
    live = {p.untyped_storage().data_ptr() for p in trainer.params}
    assert {t.untyped_storage().data_ptr() for t in written[0].adapter.values()} == live
    averaged = {t.untyped_storage().data_ptr() for t in trainer.ema.averaged}
    assert {t.untyped_storage().data_ptr() for t in written[0].ema.values()} == averaged
    expected = trainer.trainable.state_dict()
    trainer.train_to(2)  # changes the live weights after the save
    saved = RunDir(tmp_path, "live").load_checkpoint()
    assert saved.step == 1 and all(torch.equal(saved.adapter[k], v) for k, v in expected.items())
    assert not torch.equal(trainer.trainable.state_dict()[next(iter(expected))], expected[next(iter(expected))])


def test_bad_train_config_is_rejected():
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp8").validate()
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0).validate()
    with pytest.raises(ValueError, match="no training items"):
        make_trainer(train_items=[])


class InplaceBlock(torch.nn.Module):
    """Adds into its input after LayerNorm saved it, as ComfyUI's Flux blocks do (`x += ...`)."""

    def __init__(self, inplace=True):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.inplace = inplace

    def forward(self, x):
        update = self.lin(torch.nn.functional.layer_norm(x, (8,)))
        if self.inplace:
            x += update
            x += self.lin(torch.nn.functional.layer_norm(x, (8,)))
            return x
        x = x + update
        return x + self.lin(torch.nn.functional.layer_norm(x, (8,)))


def _block_gradient(blocks, **wrap):
    from headroom.training.memory.checkpointing import wrap_blocks

    restore = wrap_blocks(blocks, **wrap) if wrap else (lambda: None)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1)) * torch.ones(1, requires_grad=True)
    for block in blocks:
        x = block(x)
    x.square().sum().backward()
    restore()
    return blocks[0].lin.weight.grad


@pytest.mark.parametrize("checkpoint_depth", [None, 1])
def test_inplace_blocks_get_exact_gradients(checkpoint_depth):
    reference = _block_gradient([InplaceBlock(inplace=False)] * 2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _block_gradient([InplaceBlock()] * 2)
    blocks = [InplaceBlock()] * 2
    torch.testing.assert_close(_block_gradient(blocks, checkpoint_depth=checkpoint_depth, inplace_inputs=True), reference)
    assert all("forward" not in b.__dict__ for b in blocks)


class InplaceStreamsBlock(InplaceBlock):
    """Takes and returns its streams as one tuple and adds into the first in place, as ComfyUI's LTX-2 blocks do
    (`vx, ax = x; vx.addcmul_(...)`); the second stream is empty, as in a video-only run."""

    def forward(self, streams):
        x, empty = streams
        return super().forward(x), empty


def _streams_gradient(blocks, **wrap):
    from headroom.training.memory.checkpointing import wrap_blocks

    restore = wrap_blocks(blocks, **wrap) if wrap else (lambda: None)
    streams = (torch.randn(2, 8, generator=torch.Generator().manual_seed(1)) * torch.ones(1, requires_grad=True),
               torch.zeros(2, 0))
    for block in blocks:
        streams = block(streams)
    streams[0].square().sum().backward()
    restore()
    return blocks[0].lin.weight.grad


@pytest.mark.parametrize("checkpoint_depth", [None, 1])
def test_inplace_blocks_taking_a_tuple_of_streams_get_exact_gradients(checkpoint_depth):
    reference = _streams_gradient([InplaceStreamsBlock(inplace=False)] * 2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _streams_gradient([InplaceStreamsBlock()] * 2)
    blocks = [InplaceStreamsBlock()] * 2
    torch.testing.assert_close(_streams_gradient(blocks, checkpoint_depth=checkpoint_depth, inplace_inputs=True),
                               reference)


def test_a_checkpointed_block_saves_the_streams_of_its_tuple_input():
    """The checkpoint saves (and activation offload moves to the host) the tensors inside a tuple input, not just an
    empty anchor: they go into the reentrant checkpoint as its own inputs."""
    from headroom.training.memory.checkpointing import wrap_blocks

    block = InplaceStreamsBlock()
    restore = wrap_blocks([block], checkpoint_depth=1, inplace_inputs=True)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1)) * torch.ones(1, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        block((x, torch.zeros(2, 0)))
    restore()
    assert any(t.shape == x.shape and torch.equal(t, x) for t in saved), [t.shape for t in saved]


class KeywordDropoutBlock(torch.nn.Module):
    """A block ComfyUI calls with keyword tensors alone (as Qwen-Image's), with LoRA-like dropout inside."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, *, hidden_states, encoder_hidden_states, scale=1.0):
        return self.linear(self.dropout(hidden_states)) * scale + encoder_hidden_states


def _keyword_block_gradients(device, checkpointed: bool, monkeypatch=None):
    from headroom.training.memory.checkpointing import wrap_blocks

    torch.manual_seed(0)
    block = KeywordDropoutBlock().to(device)
    restore = wrap_blocks([block], checkpoint_depth=1) if checkpointed else (lambda: None)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    context = torch.randn(4, 8, device=device, requires_grad=True)
    torch.manual_seed(1)
    if device.type == "cuda":
        torch.cuda.manual_seed(1)
    block(hidden_states=x, encoder_hidden_states=context, scale=2.0).square().sum().backward()
    restore()
    return x.grad, context.grad, block.linear.weight.grad


def test_a_block_called_with_keyword_tensors_tells_the_checkpoint_their_devices(monkeypatch):
    """torch's checkpoint restores the RNG state of the devices of its positional tensors only: a block called with
    keywords alone must hand them over positionally, or on a GPU its recompute draws dropout masks other than its
    forward's (the CUDA test below). Here: the checkpoint is asked for every tensor's device, and the gradients are
    those of the plain block."""
    import torch.utils.checkpoint as torch_checkpoint

    asked = []  # the devices it looks for are those of these tensors (the same *args go to get_device_states)
    original = torch_checkpoint._infer_device_type
    monkeypatch.setattr(torch_checkpoint, "_infer_device_type",
                        lambda *args: asked.append([a for a in args if torch.is_tensor(a)]) or original(*args))
    cpu = torch.device("cpu")
    checkpointed = _keyword_block_gradients(cpu, True)
    assert asked and len(asked[0]) == 2 and asked[0][0].shape == (4, 8)
    for got, want in zip(checkpointed, _keyword_block_gradients(cpu, False)):
        assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the device's RNG state across the recompute")
def test_a_checkpointed_block_called_with_keyword_tensors_recomputes_the_same_dropout_on_cuda():
    cuda = torch.device("cuda")
    for got, want in zip(_keyword_block_gradients(cuda, True), _keyword_block_gradients(cuda, False)):
        assert torch.equal(got, want)


def test_inplace_blocks_refuse_finer_checkpoints():
    from headroom.training.memory.checkpointing import wrap_blocks

    with pytest.raises(ValueError, match="must be at depth 1"):
        wrap_blocks([InplaceBlock()], checkpoint_depth=2, inplace_inputs=True)


@pytest.mark.parametrize("dropout,expected_empty", [(0.0, 0), (1.0, 4)])
def test_caption_dropout_trains_on_the_cached_empty_prompt(dropout, expected_empty):
    trainer = make_trainer(config=TrainConfig(batch_size=4, seed=0, caption_dropout=dropout))
    seen = []
    predict = trainer.denoiser.predict
    trainer.denoiser.predict = lambda x_t, sigma, conds: seen.extend(conds) or predict(x_t, sigma, conds)
    trainer.train_step()
    empty = trainer.text_cache.empty_conditioning()
    assert sum(c is empty for c in seen) == expected_empty and len(seen) == 4


def test_gradients_are_clipped_to_max_norm():
    trainer = make_trainer(config=TrainConfig(batch_size=4, seed=0, max_grad_norm=1e-4),
                           optimizer=OptimizerConfig(lr=1e-3))
    trainer.train_step()
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.params if p.grad is not None]))
    assert total <= 1e-4 * 1.0001


def test_checkpointed_inplace_blocks_recompute_in_backward():
    blocks = [InplaceBlock(), InplaceBlock()]
    calls = []
    handles = [b.lin.register_forward_pre_hook(lambda *a: calls.append(1)) for b in blocks]
    reference = _block_gradient([InplaceBlock(inplace=False), InplaceBlock(inplace=False)])
    calls.clear()
    gradient = _block_gradient(blocks, checkpoint_depth=1, inplace_inputs=True)
    for handle in handles:
        handle.remove()
    torch.testing.assert_close(gradient, reference)
    assert len(calls) == 2 * 2 * 2  # 2 blocks x 2 linear calls, once in forward and again in backward
