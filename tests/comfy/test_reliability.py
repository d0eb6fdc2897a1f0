"""Reliability pieces one by one (issue 13): the streamed safetensors writer, file modes and the umask, temp
pruning, checkpoint re-saves and pruning, the checkpoint cadence, the cache commit interval, large images decoded
reduced, names and floats, missing optional packages, paths in messages, a vanished run folder, re-queue saves."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save

from headroom.training.data import cache_store, files
from headroom.training.core import trainer as trainer_module
from headroom.training.core.run_dir import Checkpoint, RunDir, check_name


# --- files ----------------------------------------------------------------------------------------------------------
def test_streamed_safetensors_are_the_librarys_bytes(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"z.w": torch.randn(3, 4, generator=g), "a": torch.randn(5, generator=g).bfloat16(), "s": torch.tensor(3.0),
               "empty": torch.zeros(0, 4), "i": torch.arange(7), "b": torch.tensor([True, False]),
               "f8": torch.randn(9, generator=g).to(torch.float8_e4m3fn), "h": torch.randn(2, 3, generator=g).half(),
               "strided": torch.randn(4, 6, generator=g)[:, ::2]}
    target = tmp_path / "x.safetensors"
    files.write_safetensors(target, tensors)
    assert target.read_bytes() == save({k: v.contiguous() for k, v in tensors.items()})
    files.write_safetensors(target, tensors, metadata={"b": "2", "a": "ü"})
    loaded = load_file(str(target))
    assert all(torch.equal(loaded[k].reshape(-1).view(torch.uint8), tensors[k].contiguous().reshape(-1).view(torch.uint8))
               for k in tensors)


@pytest.mark.parametrize("umask,file_mode,dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700), (0o002, 0o664, 0o775)])
def test_written_files_and_folders_follow_the_umask(tmp_path, umask, file_mode, dir_mode):
    """mkstemp makes 0600 files and mkdtemp 0700 folders; renamed into place they kept those modes whatever the
    umask (the issue: every saved file 0600, every checkpoint folder 0700)."""
    previous = os.umask(umask)
    try:
        files.write_bytes(tmp_path / "a.bin", b"x", "a file")
        files.save_safetensors(tmp_path / "b.safetensors", {"t": torch.zeros(2)}, "a file")
        run = RunDir(tmp_path, "run")
        folder = run.save_checkpoint(_checkpoint(1))
    finally:
        os.umask(previous)
    for path in (tmp_path / "a.bin", tmp_path / "b.safetensors", run.path / "latest.json", *folder.iterdir()):
        assert path.stat().st_mode & 0o777 == file_mode, path
    assert folder.stat().st_mode & 0o777 == dir_mode


def test_prune_removes_what_dead_writers_left_and_keeps_live_ones(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    (tmp_path / f".adapter.safetensors.hrtmp-{dead_pid}-abcd1234.tmp").write_bytes(b"half")
    (tmp_path / f".step_00000003.hrtmp-{dead_pid}-00ff00ff").mkdir()
    (tmp_path / f".mine.hrtmp-{os.getpid()}-00000000.tmp").write_bytes(b"in flight")
    old = tmp_path / ".shard-legacy.tmp"
    old.write_bytes(b"")
    os.utime(old, (time.time() - 2 * files.STALE_TEMP_SECONDS,) * 2)
    (tmp_path / ".manifest-young.tmp").write_bytes(b"")  # pid-less and young: maybe a live writer of an older version
    (tmp_path / "config.json").write_text("{}")
    removed = files.prune_temp(tmp_path)
    assert sorted(removed) == sorted([f".adapter.safetensors.hrtmp-{dead_pid}-abcd1234.tmp",
                                      f".step_00000003.hrtmp-{dead_pid}-00ff00ff", ".shard-legacy.tmp"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".mine.hrtmp-{os.getpid()}-00000000.tmp", ".manifest-young.tmp", "config.json"])


def test_messages_name_paths_relative_to_comfyui_folders(tmp_path):
    files.register_display_root("output", tmp_path / "out")
    assert files.display_path(tmp_path / "out" / "headroom_runs" / "x" / "latest.json") == \
        "output/headroom_runs/x/latest.json"
    assert files.display_path("/somewhere/else/deep/file.txt") == ".../deep/file.txt"
    assert files.relative_text(f"cannot open {tmp_path / 'out' / 'a.png'}") == "cannot open output/a.png"


def test_reading_our_files_refuses_symlinks_fifos_and_nan(tmp_path):
    (tmp_path / "real.json").write_text('{"a": 1}')
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "nan.json").write_text('{"a": NaN}')
    assert files.read_json(tmp_path / "real.json", "x") == {"a": 1}
    for name, problem in (("link.json", "symlink"), ("fifo.json", "not a regular file"), ("nan.json", "not valid JSON")):
        with pytest.raises(files.UntrustedFileError, match=problem):
            files.read_json(tmp_path / name, "x")
    with pytest.raises(ValueError):
        files.write_json(tmp_path / "out.json", {"a": float("nan")}, "x")  # never written
    with pytest.raises(files.UntrustedFileError, match="not a file name inside"):
        files.path_in(tmp_path, "../real.json", "pointer")


# --- names and floats -------------------------------------------------------------------------------------------------
def test_names_are_matched_whole():
    """`^...$` with re.match let a final newline through: folders and files named "x\\n" were created."""
    for bad in ("x\n", "run\n", "a\nb"):
        with pytest.raises(ValueError, match="not allowed"):
            check_name(bad)


def test_float_configs_refuse_nan_and_infinity():
    from headroom.training.core.adapters import AdapterConfig
    from headroom.training.core.objective import ObjectiveConfig
    from headroom.training.core.optimizers import OptimizerConfig
    from headroom.training.memory.policy import OffloadPolicy, PolicyError
    from headroom.training.core.trainer import TrainConfig

    nan, inf = float("nan"), float("inf")
    with pytest.raises(ValueError, match="weight_decay=nan"):
        OptimizerConfig(weight_decay=nan).validate()  # passed `< 0` before
    with pytest.raises(ValueError, match="lr=inf"):
        OptimizerConfig(lr=inf).validate()
    with pytest.raises(ValueError, match="max_grad_norm=nan"):
        TrainConfig(max_grad_norm=nan).validate()
    with pytest.raises(ValueError, match="noise_offset=nan"):
        ObjectiveConfig(noise_offset=nan).validate("eps")
    with pytest.raises(ValueError, match="alpha=inf"):
        AdapterConfig(alpha=inf).validate()
    with pytest.raises(PolicyError, match="reserve_gb=nan"):
        OffloadPolicy(reserve_gb=nan)


def test_a_missing_optional_optimizer_package_is_named(monkeypatch):
    from headroom.training.core.optimizers import MissingPackageError, OptimizerConfig, create_optimizer

    monkeypatch.setitem(sys.modules, "came_pytorch", None)  # as if not installed
    with pytest.raises(MissingPackageError, match=r"pip package 'came-pytorch'.*pip install came-pytorch"):
        create_optimizer([torch.nn.Parameter(torch.zeros(2))], OptimizerConfig(name="CAME"))
    monkeypatch.setitem(sys.modules, "prodigyopt", None)
    with pytest.raises(MissingPackageError, match="'prodigyopt'"):
        create_optimizer([torch.nn.Parameter(torch.zeros(2))], OptimizerConfig(name="Prodigy"))


# --- checkpoints -----------------------------------------------------------------------------------------------------
def _checkpoint(step: int) -> Checkpoint:
    return Checkpoint(step=step, micro_step=step, adapter={"w": torch.full((2, 2), float(step))},
                      optimizer={"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}, scheduler={}, scaler=None,
                      rng={"torch": torch.get_rng_state()}, loss_history=[[step, 0.5]], validation_history=[])


def test_resaving_a_step_never_moves_the_checkpoint_latest_names(tmp_path, monkeypatch):
    """A re-save of the same step (after every validation) moved the folder latest.json names aside before the
    new one was in place: a kill in between left latest.json pointing at nothing."""
    run = RunDir(tmp_path, "run")
    run.save_checkpoint(_checkpoint(1))
    run.save_checkpoint(_checkpoint(2))
    pointed = tmp_path / "run" / "checkpoints" / "step_00000002"
    moves = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (moves.append((str(src), str(dst))), real_replace(src, dst))[1])
    again = _checkpoint(2)
    again.validation_history = [[2, 0.25]]
    folder = run.save_checkpoint(again)
    assert folder.name == "step_00000002.1"
    assert moves[0][1] == str(folder), "the first rename must put the new checkpoint in place"
    assert all(src != str(pointed) for src, _ in moves[:2]), "the pointed folder was moved before latest.json changed"
    assert json.loads((tmp_path / "run" / "latest.json").read_text())["checkpoint"] == "checkpoints/step_00000002.1"
    assert run.load_checkpoint().validation_history == [[2, 0.25]]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000001", "step_00000002.1"]


def test_a_nan_validation_loss_does_not_make_the_run_unresumable(tmp_path):
    run = RunDir(tmp_path, "run")
    checkpoint = _checkpoint(3)
    checkpoint.validation_history = [[3, float("nan")]]
    run.save_checkpoint(checkpoint)
    loaded = run.load_checkpoint()
    assert loaded.step == 3 and loaded.validation_history[0][0] == 3 and loaded.validation_history[0][1] != 0.5


class _CountingRun(RunDir):
    def __init__(self, root):
        super().__init__(root, "cadence")
        self.saved_steps = []

    def save_checkpoint(self, checkpoint):
        self.saved_steps.append(checkpoint.step)
        return super().save_checkpoint(checkpoint)


def _engine_trainer(run_dir):
    from test_trainer import make_trainer

    return make_trainer(run_dir)


def test_periodic_checkpoints_every_n_steps_and_every_m_seconds(tmp_path, monkeypatch):
    """HeadroomTrainSteps saved only at the end: a kill at step 84 of 100000 kept step 20."""
    run = _CountingRun(tmp_path)
    trainer = _engine_trainer(run)
    trainer.train_to(10, checkpoint_every=3)
    assert run.saved_steps == [3, 6, 9]  # the last step is the caller's to save
    clock = iter(range(0, 10_000, 7))  # each call to the clock: 7 "seconds" later
    monkeypatch.setattr(trainer_module.time, "monotonic", lambda: next(clock))
    trainer.train_to(16, checkpoint_seconds=20)
    assert run.saved_steps == [3, 6, 9, 13]  # 21 s after the start (3 clock reads later) and not again within 20 s


# --- caches -----------------------------------------------------------------------------------------------------------
def test_cache_entries_are_committed_within_the_interval(tmp_path, monkeypatch):
    """Shards were written only per 16 MiB: a kill at item 1004 of 3000 kept none."""
    now = [0.0]
    monkeypatch.setattr(cache_store.time, "monotonic", lambda: now[0])
    store = cache_store.ShardStore(tmp_path / "cache", shard_bytes=1 << 30, commit_seconds=5.0)
    with store.writer() as writer:
        for index in range(12):
            writer.add(f"{index:064x}", {"latent": torch.full((4,), float(index))})
            now[0] += 1.0  # an item a second
            listed = len(cache_store.ShardStore(tmp_path / "cache").entries)
            assert listed >= index - 5, f"item {index}: only {listed} committed"
    assert len(cache_store.ShardStore(tmp_path / "cache").entries) == 12


# --- images -----------------------------------------------------------------------------------------------------------
def test_large_images_are_decoded_reduced_to_what_the_bucket_needs(tmp_path):
    """A 12000 x 12000 PNG (419 KB) decoded at full size in float32 (+4.4 GB of RSS) to become a 512 px sample."""
    from headroom.training.data.cache_store import ShardStore, cache_latents
    from headroom.training.data.dataset import dataset_from_folder

    folder = tmp_path / "data"
    folder.mkdir()
    Image.new("RGB", (4000, 3000), (30, 60, 90)).save(folder / "big.png")
    Image.new("RGB", (4000, 3000), (90, 60, 30)).save(folder / "big_jpeg.jpg", quality=90)
    for stem in ("big", "big_jpeg"):
        (folder / f"{stem}.txt").write_text("large")
    dataset = dataset_from_folder(folder, resolution=64, step=64)
    shapes = []
    for item in dataset.items:
        real = item.image.load
        item.image.load = lambda reduce=1, real=real: (lambda t: (shapes.append(tuple(t.shape)), t)[1])(real(reduce))
    cache, _ = cache_latents(dataset, ShardStore(tmp_path / "cache"), lambda x: x.movedim(-1, 1)[:, :, ::8, ::8],
                             "id", {})
    assert len(cache) == 2
    for height, width, _ in shapes:  # the 85x64 bucket needs 85 px: decoded at >= 2x that, far below 4000 x 3000
        assert 128 <= height <= 400 and 170 <= width <= 520, shapes


def test_oversize_images_are_refused_by_their_header(tmp_path):
    from test_hostile_inputs import png_header_only

    from headroom.training.data.dataset import DatasetError, dataset_from_folder

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "bomb.png").write_bytes(png_header_only(13_000, 13_000))
    (folder / "bomb.txt").write_text("boom")
    Image.new("RGB", (32, 32)).save(folder / "ok.png")
    (folder / "ok.txt").write_text("fine")
    with pytest.raises(DatasetError, match=r"bomb.png: 13000x13000 pixels \(169 Mpx\) is more than"):
        dataset_from_folder(folder, resolution=32, step=32)
    dataset = dataset_from_folder(folder, resolution=32, step=32, skip_bad=True)
    assert [item.name for item in dataset.items] == ["ok.png"] and "bomb.png" in dataset.warnings[0]


def test_dataset_symlinks_leading_outside_are_refused(tmp_path):
    from headroom.training.data.dataset import dataset_from_folder

    secret = tmp_path / "secret.txt"
    secret.write_text("a system file")
    folder = tmp_path / "data"
    folder.mkdir()
    Image.new("RGB", (32, 32)).save(folder / "a.png")
    (folder / "a.txt").symlink_to(secret)
    Image.new("RGB", (32, 32)).save(folder / "b.png")
    (folder / "b.txt").write_text("fine")
    dataset = dataset_from_folder(folder, resolution=32, step=32, skip_bad=True)
    assert [item.caption for item in dataset.items] == ["fine"]
    assert "a.txt leads outside" in dataset.warnings[0]


# --- runs in ComfyUI ---------------------------------------------------------------------------------------------------
@pytest.mark.comfyui
def test_a_vanished_run_folder_is_detected_not_recreated(comfyui):
    import shutil

    from test_train_lora_nodes import _data, _init

    from headroom.nodes import train_lora as T
    from headroom.training.core.run_dir import RunFolderError

    model, _, _, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "vanishing", rank=4, batch_size=2)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 1)
    fingerprint = T.HeadroomTrainLoraInit.fingerprint_inputs(run_name="vanishing")
    assert T.HeadroomTrainLoraInit.fingerprint_inputs(run_name="vanishing") == fingerprint  # cached while unchanged
    shutil.rmtree(run.run_dir.path)
    with torch.inference_mode(), pytest.raises(RunFolderError, match="was deleted or replaced"):
        T.HeadroomTrainSteps.execute(run, 3)
    assert not run.run_dir.path.exists(), "the vanished folder was re-created (without config.json)"
    # ComfyUI runs Init again (its fingerprint changed) instead of handing on the session whose folder is gone.
    assert T.HeadroomTrainLoraInit.fingerprint_inputs(run_name="vanishing") != fingerprint
    fresh = _init(model, latents, texts, "vanishing", rank=4, batch_size=2)
    assert fresh.step == 0 and fresh.run_dir.exists()
    # A folder with checkpoints but no config.json (what the old code left) is refused, not resumed unchecked.
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(fresh, 1)
    (fresh.run_dir.path / "config.json").unlink()
    with pytest.raises(ValueError, match="holds checkpoints but no config.json"):
        _init(model, latents, texts, "vanishing", rank=4, batch_size=2)


@pytest.mark.comfyui
def test_requeue_saves_a_step_an_earlier_save_missed(comfyui, monkeypatch):
    """After a failed checkpoint write, queueing "train to N" again reported success at N with nothing saved."""
    from faults import disk_full_for
    from test_train_lora_nodes import _data, _init

    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.model_files import runs_root
    from headroom.training.data.files import DiskFullError

    model, _, _, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "requeue", rank=4, batch_size=2)
    disk_full_for(monkeypatch, "adapter.safetensors")
    with torch.inference_mode(), pytest.raises(DiskFullError, match="last checkpoint on disk: none"):
        T.HeadroomTrainSteps.execute(run, 2)
    monkeypatch.undo()
    assert run.step == 2 and RunDir(runs_root(), "requeue").latest_step() is None
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 2)  # nothing to train, but step 2 is saved now
    assert RunDir(runs_root(), "requeue").latest_step() == 2


@pytest.mark.comfyui
def test_the_missing_package_is_named_when_the_optimizer_is_chosen(comfyui, monkeypatch):
    from headroom.nodes.train_lora import HeadroomOptimizerConfig
    from headroom.training.core.optimizers import MissingPackageError

    monkeypatch.setitem(sys.modules, "prodigyopt", None)
    with pytest.raises(MissingPackageError, match=r"Optimizer Config \(Headroom\): optimizer Prodigy needs the pip package"):
        HeadroomOptimizerConfig.execute("Prodigy", 1.0, 0.0, "constant", 0, 10)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # optional too: the 8-bit optimizers
    for name in ("AdamW8bit", "PagedAdamW8bit", "Lion8bit"):
        with pytest.raises(MissingPackageError, match=rf"Optimizer Config \(Headroom\): optimizer {name} needs the pip "
                           r"package 'bitsandbytes'.*python_embeded\\python\.exe -m pip install bitsandbytes"):
            HeadroomOptimizerConfig.execute(name, 1e-4, 0.0, "constant", 0, 10)
    assert HeadroomOptimizerConfig.execute("AdamW", 1e-4, 0.0, "constant", 0, 10).result[0].name == "AdamW"


@pytest.mark.comfyui
@pytest.mark.parametrize("optimizer,ema", [("AdamW", False), ("Adafactor", True)])
def test_init_sizes_a_checkpoint_as_it_is_written(comfyui, optimizer, ema):
    """The size the Init node checks the disk's room with (planner.TrainableSpec.checkpoint_bytes: trained weights,
    optimizer state, EMA, what each tensor adds to its file) is what the run's first checkpoint takes on disk, within
    10 %, for a small adapter whose files' per-tensor entries are a third of it."""
    from test_train_lora_nodes import _data, _init

    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.model_files import runs_root
    from headroom.nodes.bridge.planning import lora_trainable

    model, _, _, latents, texts = _data("sd15")
    name = f"sized_{optimizer}"
    run = _init(model, latents, texts, name, rank=4, batch_size=2, optimizer=optimizer,
                ema_decay=0.99 if ema else 0.0)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 1)
    written = sum(p.stat().st_size for p in (runs_root() / name / "checkpoints").rglob("*") if p.is_file())
    spec = lora_trainable(model, run.config.adapter, optimizer)
    estimated = dataclasses.replace(spec, ema=ema).checkpoint_bytes()
    assert abs(written - estimated) <= 0.1 * written, (written, estimated)


@pytest.mark.comfyui
def test_init_warns_when_the_checkpoints_it_keeps_would_fill_the_disk(comfyui, monkeypatch):
    """Room for one checkpoint but not for the latest and the next written beside it: the run opens, and the Init
    node says how much the checkpoints take against what is free (the refusal when not even one fits is met on a
    real full tmpfs: tests/disk_full_cases.py "room for checkpoints"). Room for two keeps saving: a resumed run's
    older checkpoint counts as room, and its next save removes it first, as Train Steps says. The free space is the
    one thing faked here."""
    from test_train_lora_nodes import _data, _init

    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge import model_files
    from headroom.nodes.bridge.planning import lora_trainable
    from headroom.training.core import run_dir
    from headroom.training.data.files import DiskFullError, format_bytes

    model, _, _, latents, texts = _data("sd15")
    run = _init(model, latents, texts, "roomy", rank=4, batch_size=2)
    assert run.disk_note == "" and not any(note.startswith("disk:") for note in run.notes)  # this disk has room
    one = lora_trainable(model, run.config.adapter, "AdamW").checkpoint_bytes()
    run.release()
    two = run_dir.disk_room_needed(one, 0)  # room for two (with what a save asks to spare): no note
    assert two > 2 * one
    monkeypatch.setattr(model_files, "free_bytes", lambda path: two)
    run = _init(model, latents, texts, "disk_two_fit", rank=4, batch_size=2)
    assert run.disk_note == "", run.disk_note
    run.release()
    monkeypatch.setattr(model_files, "free_bytes", lambda path: two - 1)
    run = _init(model, latents, texts, "cramped", rank=4, batch_size=2)
    assert run.disk_note.startswith("disk: each checkpoint of run 'cramped' takes about ") and \
        "a save writes the next beside the latest" in run.disk_note and \
        run.disk_note.count(": a later save will find it full") == 1, run.disk_note
    # AdamW's two moments are most of it: what the optimizer with the least state would take is said
    lean = dataclasses.replace(lora_trainable(model, run.config.adapter, "Adafactor"), ema=False).checkpoint_bytes()
    assert run.disk_note.endswith(f"(with the Adafactor optimizer each would take about {format_bytes(lean)})")
    assert run.disk_note in T.opened_text(run)
    run.release()
    monkeypatch.setattr(model_files, "free_bytes", lambda path: one - 1)
    refused = (r"disk full: the checkpoints of run 'tight' cannot be saved in output/headroom_runs \(each needs "
               r"about .*AdamW state .* is free there\) \(with the Adafactor optimizer each would take about .*\)\. "
               r"Free space on that disk")
    with pytest.raises(DiskFullError, match=refused):
        _init(model, latents, texts, "tight", rank=4, batch_size=2)
    assert not (model_files.runs_root() / "tight").exists()  # nothing was written
    # a resumed run with its two checkpoints on disk: its older one's room counts (nothing free: it opens, and says
    # a later save will find the disk full; half a checkpoint free: no note)
    monkeypatch.undo()
    run = _init(model, latents, texts, "disk_resumed", rank=4, batch_size=2)
    with torch.inference_mode():
        for step in (1, 2):
            T.HeadroomTrainSteps.execute(run, step)
    run.release()
    monkeypatch.setattr(model_files, "free_bytes", lambda path: 0)
    run = _init(model, latents, texts, "disk_resumed", rank=4, batch_size=2)
    assert run.step == 2 and "a later save will find it full" in run.disk_note, run.disk_note
    run.release()
    monkeypatch.setattr(model_files, "free_bytes", lambda path: one // 2)
    run = _init(model, latents, texts, "disk_resumed", rank=4, batch_size=2)
    assert run.step == 2 and run.disk_note == "", run.disk_note
    # and its next save removes the older first (the disk holding half a checkpoint here), as Train Steps says
    folder = model_files.runs_root() / "disk_resumed" / "checkpoints"
    monkeypatch.setattr(run_dir, "free_bytes", lambda path: run_dir._folder_bytes(folder / "step_00000002") // 2)
    with torch.inference_mode():
        text = T.HeadroomTrainSteps.execute(run, 3).ui["text"]
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000002", "step_00000003"]
    assert [line for line in text if line.startswith("disk:")] == [run.run_dir.room_note] and \
        run.run_dir.room_note.startswith("disk: the older checkpoint (step 1) was removed before step 3 was saved")
    run.release()
