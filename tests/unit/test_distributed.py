"""Data-parallel training on torch.distributed: 2 CPU ranks (gloo, separate processes) against one rank.

The ranks are processes running tests/distributed_worker.py on the toy denoiser of test_trainer.py, each forked from
a zygote that imported torch and peft once (distributed_worker.Zygote).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest
import torch
from distributed_worker import run_ranks, start_ranks, toy_run
from headroom.training.core.adapters import AdapterConfig
from headroom.training.core.run_dir import RunDir
from headroom.training.core.trainer import Trainer
from headroom.training.memory import planner
from headroom.training.memory.policy import OffloadPolicy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 10


def _start_ranks(job: dict, world: int = 2) -> list[subprocess.Popen]:
    return start_ranks(job, world, forked=True)  # each a process of its own, forked with the imports done


def _run_ranks(job: dict, world: int = 2) -> list[dict]:
    return run_ranks(job, world, forked=True)


def _assert_close(actual: dict, expected: dict, rel: float = 1e-6) -> None:
    assert set(actual) == set(expected)
    for key, value in expected.items():
        error = (actual[key] - value).norm() / value.norm().clamp_min(1e-12)
        assert error <= rel, f"{key}: relative difference {error:.3g}"


def _job(tmp_path, name: str, **extra) -> dict:
    return {"steps": STEPS, "batch_size": 4, "grad_accum": 2, "out": str(tmp_path / name), **extra}


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """An uninterrupted 2-rank run of STEPS steps: global batch 4 (2 per rank), 2 micro-steps per step."""
    tmp_path = tmp_path_factory.mktemp("two_ranks")
    return _run_ranks(_job(tmp_path, "straight"))


def _one_rank(job_extra: dict | None = None):
    trainer = toy_run({"batch_size": 4, "grad_accum": 2, **(job_extra or {})})
    return trainer


def test_two_ranks_equal_one_rank_with_the_whole_batch(two_rank_run):
    one = _one_rank()
    one.train_to(STEPS)
    reference = one.trainable.state_dict()
    for rank in (0, 1):
        _assert_close(two_rank_run[rank]["adapter"], reference)
    # the ranks hold the same weights (the same summed gradients), and report the global batch's loss
    for key, value in two_rank_run[0]["adapter"].items():
        assert torch.equal(value, two_rank_run[1]["adapter"][key]), key
    for (step, loss), (ref_step, ref_loss) in zip(two_rank_run[0]["losses"], one.loss_history, strict=True):
        assert step == ref_step and loss == pytest.approx(ref_loss, rel=1e-5)
    assert reference[next(iter(reference))].abs().sum() > 0  # it trained


def test_one_rank_resumes_a_two_rank_run_exactly(tmp_path, two_rank_run):
    """2 ranks with 2 items each for half the run, then 1 rank with the same global batch in chunks of 2 items
    (rank_batch: the same memory per rank): the weights of the uninterrupted 2-rank run."""
    _run_ranks(_job(tmp_path, "first", steps=STEPS // 2, run_root=str(tmp_path), run_name="run"))
    resumed = _one_rank({"run_root": str(tmp_path), "run_name": "run"})
    resumed.rank_batch = 2
    assert resumed.resume() and resumed.step == STEPS // 2
    resumed.train_to(STEPS)
    _assert_close(resumed.trainable.state_dict(), two_rank_run[0]["adapter"])
    assert [s for s, _ in resumed.loss_history] == list(range(1, STEPS + 1))


def test_rank_batch_chunks_one_rank_s_batch_into_the_same_step():
    whole = _one_rank()
    whole.train_to(3)
    chunked = _one_rank()
    chunked.rank_batch = 1  # a global batch of 4 in 4 forward / backward passes
    chunked.train_to(3)
    _assert_close(chunked.trainable.state_dict(), whole.trainable.state_dict())
    assert [loss for _, loss in chunked.loss_history] == pytest.approx([loss for _, loss in whole.loss_history], rel=1e-6)
    chunked.rank_batch = 0
    with pytest.raises(ValueError, match="rank_batch=0 must be >= 1"):
        chunked.train_to(4)


def test_only_rank_zero_writes_the_run_directory(tmp_path):
    trainer = _one_rank({"run_root": str(tmp_path), "run_name": "run"})
    trainer.train_to(1)

    class OtherRank:  # what DataParallel says on rank 1; save() only asks is_main
        is_main = False

    trainer.parallel = OtherRank()
    trainer.save()
    assert trainer.saved_step == 1 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_rank_fails_the_other_with_its_name_and_keeps_the_checkpoint(tmp_path, killed):
    log = tmp_path / "steps.log"
    job = _job(tmp_path, "killed", steps=10_000, run_root=str(tmp_path), run_name="run", checkpoint_every=2,
               step_log=str(log), step_seconds=0.2, timeout_s=30)
    ranks = _start_ranks(job)
    survivor = ranks[1 - killed]
    try:
        deadline = time.monotonic() + 120
        while f"rank {killed} step 5 " not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline and all(p.poll() is None for p in ranks), \
                [p.communicate()[1][-2000:] for p in ranks if p.poll() is not None]
            time.sleep(0.1)
        os.kill(ranks[killed].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = survivor.communicate(timeout=60)
        took = time.monotonic() - killed_at
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.communicate()
    assert survivor.returncode != 0
    assert "RankLostError" in err and f"rank {killed} stopped answering" in err, err[-3000:]
    assert took < 45  # the gloo timeout (30 s) bounds it; a killed peer is usually noticed at once
    checkpoint = RunDir(tmp_path, "run").load_checkpoint()
    assert checkpoint is not None and checkpoint.step >= 4 and checkpoint.step % 2 == 0
    resumed = _one_rank({"run_root": str(tmp_path), "run_name": "run"})
    assert resumed.resume() and resumed.step == checkpoint.step
    resumed.train_to(checkpoint.step + 1)


@pytest.mark.parametrize("kind", ["lora", "full", "full FSDP2"])
def test_a_nan_on_one_rank_stops_every_rank_at_the_same_step(tmp_path, kind):
    """Rank 1's model turns NaN after step 3: the global loss is NaN on both ranks, both stop at step 4, and rank 0
    keeps the checkpoint of step 3 (a full fine-tune's sharded optimizer state, and with FSDP2 its weights, gathered
    for it by both ranks)."""
    job = _job(tmp_path, "nan", steps=STEPS, run_root=str(tmp_path), run_name="run", corrupt_rank=1, corrupt_after=3,
               kind=kind.split()[0], shard_weights=kind.endswith("FSDP2"))
    ranks = _start_ranks(job)
    errors = [process.communicate(timeout=300)[1] for process in ranks]
    for process, err in zip(ranks, errors):
        assert process.returncode != 0 and "NonFiniteLossError: training loss became nan at step 4" in err, err[-3000:]
    assert "RankLostError" not in errors[0] + errors[1]
    checkpoint = RunDir(tmp_path, "run").load_checkpoint()
    assert checkpoint is not None and checkpoint.step == 3


# --- a full fine-tune: optimizer state sharded over the ranks (training/memory/sharded_optimizer.py) ---------------
@pytest.fixture(scope="module")
def two_rank_full_run(tmp_path_factory):
    return _run_ranks(_job(tmp_path_factory.mktemp("full"), "full", kind="full"))


def test_a_full_fine_tune_shards_its_optimizer_state_and_trains_the_one_rank_weights(two_rank_full_run):
    one = _one_rank({"kind": "full"})
    one.train_to(STEPS)
    reference = one.trainable.state_dict()
    assert not one.sharded and all(run["sharded"] for run in two_rank_full_run)
    for rank in (0, 1):
        _assert_close(two_rank_full_run[rank]["adapter"], reference)
    for key, value in two_rank_full_run[0]["adapter"].items():
        assert torch.equal(value, two_rank_full_run[1]["adapter"][key]), key
    # each rank holds the state of its share only: together the whole state, the largest share as planned
    whole = sum(v.nbytes for entries in one.optimizer.state.values() for v in entries.values() if v.ndim > 0)
    shares = [run["state_bytes"] for run in two_rank_full_run]
    assert sum(shares) == whole and 0 < min(shares) and max(shares) < whole
    spec = planner.TrainableSpec(tuple(two_rank_full_run[0]["shapes"]), "AdamW", state_ranks=2)
    assert spec.optimizer_share_bytes() == max(shares) and spec.optimizer_bytes() == whole


def test_a_sharded_run_resumes_exactly_at_two_ranks_and_at_one(tmp_path, two_rank_full_run):
    """The first half on 2 ranks; its checkpoint holds the whole optimizer state in the one-optimizer layout, so the
    second half on 2 ranks (each loading its share) and on 1 rank both give the uninterrupted 2-rank run's weights."""
    _run_ranks(_job(tmp_path, "first", steps=STEPS // 2, run_root=str(tmp_path), run_name="run", kind="full"))
    # Resumed and saved again at the same step (no training in between): rank 0 writes the whole state it loaded,
    # maybe while rank 1 still reads that step (RunDir.load_checkpoint then reads the new copy).
    again = _run_ranks(_job(tmp_path, "again", steps=STEPS // 2, run_root=str(tmp_path), run_name="run", kind="full"))
    assert [run["wrapper_state"] for run in again] == [0, 0]  # no second copy of a rank's share after loading it
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    second = _run_ranks(_job(tmp_path, "second", run_root=str(tmp_path), run_name="run", kind="full"))
    _assert_close(second[0]["adapter"], two_rank_full_run[0]["adapter"])
    resumed = _one_rank({"run_root": str(tmp_path), "run_name": "copy", "kind": "full"})
    resumed.rank_batch = 2
    assert resumed.resume() and resumed.step == STEPS // 2
    resumed.train_to(STEPS)
    _assert_close(resumed.trainable.state_dict(), two_rank_full_run[0]["adapter"])


def test_adafactor_state_shards_too(tmp_path):
    ranks = _run_ranks(_job(tmp_path, "adafactor", kind="full", optimizer="Adafactor", steps=4))
    one = _one_rank({"kind": "full", "optimizer": "Adafactor"})
    one.train_to(4)
    assert ranks[0]["sharded"]
    _assert_close(ranks[0]["adapter"], one.trainable.state_dict())


def test_prodigy_and_lora_runs_keep_the_whole_state_on_every_rank():
    """Prodigy's step size is estimated from every tensor at once, and a LoRA's state is small: not sharded."""
    full = AdapterConfig(kind="full")
    assert Trainer.shards_state(2, full, "AdamW", OffloadPolicy())
    assert not Trainer.shards_state(2, full, "Prodigy", OffloadPolicy())
    assert not Trainer.shards_state(2, AdapterConfig(), "AdamW", OffloadPolicy())
    assert not Trainer.shards_state(2, full, "AdamW", OffloadPolicy(optimizer_state="cpu"))
    assert not Trainer.shards_state(1, full, "AdamW", OffloadPolicy())


# --- a full fine-tune: weights, gradients and optimizer state sharded with FSDP2 (training/memory/sharded_weights.py) ---
@pytest.fixture(scope="module")
def two_rank_fsdp_run(tmp_path_factory):
    return _run_ranks(_job(tmp_path_factory.mktemp("fsdp"), "fsdp", kind="full", shard_weights=True, checkpointing=True))


def test_fsdp2_shards_a_full_fine_tune_and_trains_the_one_rank_weights(two_rank_fsdp_run):
    """Two buckets leave a rank an empty share at times (it trains a stand-in row weighted 0, so FSDP2's per-layer
    collectives pair up); grad_accum 2, caption dropout, per-block gradient checkpointing (each layer's difference
    gathered again for the recompute): the 1-rank weights (no checkpointing) within 1e-6."""
    one = _one_rank({"kind": "full"})
    one.train_to(STEPS)
    reference = one.trainable.state_dict()
    for rank in (0, 1):
        _assert_close(two_rank_fsdp_run[rank]["adapter"], reference)
        assert two_rank_fsdp_run[rank]["losses"][-1][1] == pytest.approx(one.loss_history[-1][1], rel=1e-6)
    # each rank holds half of every difference (dim 0 split) and of its AdamW state
    weights = sum(p.nbytes for p in one.params)
    state = sum(v.nbytes for entries in one.optimizer.state.values() for v in entries.values() if v.ndim > 0)
    assert [run["weight_bytes"] for run in two_rank_fsdp_run] == [weights // 2] * 2
    assert [run["state_bytes"] for run in two_rank_fsdp_run] == [state // 2] * 2
    # as the planner plans a rank's share (planner.TrainableSpec.weight_ranks)
    from headroom.training.memory import sharded_weights

    spec = planner.TrainableSpec(tuple(two_rank_fsdp_run[0]["shapes"]), "AdamW", state_ranks=2, weight_ranks=2, full=True)
    assert spec.optimizer_share_bytes() == state // 2 and sharded_weights.weights_share(spec.shapes, 4, 2) == weights // 2


def test_an_fsdp2_run_resumes_exactly_at_two_ranks_and_at_one(tmp_path, two_rank_fsdp_run):
    """Its checkpoints hold the whole weights and optimizer state (gathered on rank 0, torch's one-optimizer layout):
    the second half on 2 FSDP2 ranks (each taking its shards) and on 1 rank give the uninterrupted run's weights."""
    job = {"run_root": str(tmp_path), "run_name": "run", "kind": "full", "shard_weights": True, "checkpointing": True}
    _run_ranks(_job(tmp_path, "first", steps=STEPS // 2, **job))
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    second = _run_ranks(_job(tmp_path, "second", **job))
    _assert_close(second[0]["adapter"], two_rank_fsdp_run[0]["adapter"])
    resumed = _one_rank({"run_root": str(tmp_path), "run_name": "copy", "kind": "full"})
    assert resumed.resume() and resumed.step == STEPS // 2
    resumed.train_to(STEPS)
    _assert_close(resumed.trainable.state_dict(), two_rank_fsdp_run[0]["adapter"])


def test_fsdp2_refuses_what_it_cannot_shard_naming_the_setting(tmp_path):
    from headroom.training.memory import sharded_weights

    policy = OffloadPolicy()
    assert sharded_weights.problem("full", "AdamW", policy, ema=False) is None
    assert "kind full" in sharded_weights.problem("lora", "AdamW", policy, ema=False)
    assert "choose AdamW" in sharded_weights.problem("full", "Adafactor", policy, ema=False)
    assert "fused_backward off" in sharded_weights.problem("full", "AdamW", OffloadPolicy(fused_backward=True), False)
    assert "trained_weights" in sharded_weights.problem("full", "AdamW", OffloadPolicy(optimizer_state="cpu"), False)
    assert "ema_decay" in sharded_weights.problem("full", "AdamW", policy, ema=True)
    # through the ranks: the Trainer refuses before training (every rank alike)
    ranks = _start_ranks(_job(tmp_path, "refused", kind="full", optimizer="Adafactor", shard_weights=True))
    for process in ranks:
        _, err = process.communicate(timeout=300)
        assert process.returncode != 0 and "choose AdamW" in err, err[-2000:]
