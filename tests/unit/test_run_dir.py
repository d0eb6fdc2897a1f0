"""Run directories: safe names, atomic checkpoints, exact round trips, incompatible-config errors."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from headroom.training.core.run_dir import Checkpoint, CheckpointError, RunDir, check_name, check_subfolder
from page_cache import cached_bytes


def _checkpoint(step: int) -> Checkpoint:
    g = torch.Generator().manual_seed(step)
    return Checkpoint(
        step=step, micro_step=2 * step, adapter={"a.lora_A.default.weight": torch.randn(4, 8, generator=g)},
        optimizer={"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(4, 8, generator=g)}},
                   "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}]},
        scheduler={"last_epoch": step, "_last_lr": [0.1]}, scaler=None,
        rng={"torch": torch.get_rng_state()}, loss_history=[[i + 1, 1.0 / (i + 1)] for i in range(step)],
        validation_history=[[step, 0.5]],
    )


def test_names_cannot_escape_the_folder():
    for good in ("run1", "my_lora-v2.1", "A"):
        assert check_name(good) == good
    for bad in ("", "..", "../x", "a/b", "/abs", "a\\b", ".hidden", "a..b", "x" * 101, "ü"):
        with pytest.raises(ValueError, match="run name"):
            check_name(bad)
    assert check_subfolder("headroom/tests") == "headroom/tests"
    for bad in ("../up", "/etc", "a/../b", "c:/x", "a//b"):
        with pytest.raises(ValueError):
            check_subfolder(bad)


def test_checkpoint_round_trip_is_exact_and_keeps_the_last_two(tmp_path):
    run = RunDir(tmp_path, "run")
    assert run.load_checkpoint() is None and run.latest_step() is None
    for step in (5, 10, 15):
        run.save_checkpoint(_checkpoint(step))
    assert run.latest_step() == 15
    assert sorted(p.name for p in (run.path / "checkpoints").iterdir()) == ["step_00000010", "step_00000015"]
    loaded, expected = run.load_checkpoint(), _checkpoint(15)
    assert loaded.step == 15 and loaded.micro_step == 30
    assert torch.equal(loaded.adapter["a.lora_A.default.weight"], expected.adapter["a.lora_A.default.weight"])
    assert torch.equal(loaded.optimizer["state"][0]["exp_avg"], expected.optimizer["state"][0]["exp_avg"])
    assert loaded.loss_history == expected.loss_history and loaded.scheduler == expected.scheduler
    assert torch.equal(loaded.rng["torch"], expected.rng["torch"])
    run.save_checkpoint(_checkpoint(15))  # the same step again replaces it
    assert run.latest_step() == 15
    assert not [p for p in run.path.rglob("*") if p.name.startswith(".")], "temporary files left behind"


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path):
    run = RunDir(tmp_path, "run")
    run.save_checkpoint(_checkpoint(3))
    broken = _checkpoint(6)
    broken.optimizer = {"state": {}, "param_groups": [{"hook": lambda: None}]}  # torch.save cannot write a lambda
    with pytest.raises(Exception):
        run.save_checkpoint(broken)
    assert run.latest_step() == 3 and run.load_checkpoint().step == 3
    assert sorted(p.name for p in (run.path / "checkpoints").iterdir()) == ["step_00000003"]


def test_an_incompatible_config_is_refused_with_the_differences(tmp_path):
    run = RunDir(tmp_path, "run")
    config = {"adapter": {"rank": 4, "kind": "lora"}, "seed": 0}
    run.check_compatible(config)  # nothing stored yet
    run.write_config(config)
    run.check_compatible(json.loads(json.dumps(config)))
    with pytest.raises(ValueError, match=r"adapter.rank: stored 4, now 8; seed: stored 0, now 1"):
        run.check_compatible({"adapter": {"rank": 8, "kind": "lora"}, "seed": 1})


def test_settings_added_or_removed_later_let_older_runs_resume(tmp_path):
    """A key newer than a stored run resumes at the value that run had; a key older runs store that is no longer
    part of a run (the training nodes' checkpointing, now the offload policy's) is ignored when the new
    configuration has none, and only then."""
    run = RunDir(tmp_path, "run")
    run.write_config({"train": {"seed": 0, "gradient_checkpointing": True, "checkpoint_depth": 2}})
    removed = ("train.gradient_checkpointing", "train.checkpoint_depth")
    run.check_compatible({"train": {"seed": 0, "ema_decay": 0.0}}, added_later={"train.ema_decay": 0.0},
                         removed_later=removed)
    with pytest.raises(ValueError, match=r"train.gradient_checkpointing: stored True, now None"):
        run.check_compatible({"train": {"seed": 0}})
    # (stored before the setting existed: the run ran with its added_later value, which the message shows)
    with pytest.raises(ValueError, match=r"train.ema_decay: stored 0.0, now 0.5"):
        run.check_compatible({"train": {"seed": 0, "ema_decay": 0.5}}, added_later={"train.ema_decay": 0.0},
                             removed_later=removed)
    with pytest.raises(ValueError, match=r"train.checkpoint_depth: stored 2, now 1"):
        run.check_compatible({"train": {"seed": 0, "gradient_checkpointing": True, "checkpoint_depth": 1}},
                             removed_later=removed)


def test_a_checkpoint_saved_again_while_another_rank_reads_it_is_read_from_its_new_folder(tmp_path, monkeypatch):
    """Several ranks read one run: rank 0 may save the step it resumed while rank 1 still reads it, and prune the
    folder rank 1 reads. Rank 1 then reads the copy latest.json names (bounded: a folder replaced at every read
    fails with the file's name)."""
    from headroom.training.core import run_dir as run_dir_module

    writer = RunDir(tmp_path, "run")
    writer.save_checkpoint(_checkpoint(15))
    reader = RunDir(tmp_path, "run")
    load_torch, saves = run_dir_module._load_torch, []

    def rank0_saves_while_rng_is_read(path, what):
        if path.name == "rng.pt" and len(saves) < limit:
            saves.append(writer.save_checkpoint(_checkpoint(15)))  # prunes the folder `path` is in
        return load_torch(path, what)

    monkeypatch.setattr(run_dir_module, "_load_torch", rank0_saves_while_rng_is_read)
    limit = 1
    loaded = reader.load_checkpoint()
    assert loaded.step == 15 and [p.name for p in saves] == ["step_00000015.1"]
    assert torch.equal(loaded.adapter["a.lora_A.default.weight"], _checkpoint(15).adapter["a.lora_A.default.weight"])
    assert sorted(p.name for p in (writer.path / "checkpoints").iterdir()) == ["step_00000015.1"]
    limit = 10  # replaced at every read: the reader gives up after READ_ATTEMPTS reads, naming the file
    with pytest.raises(CheckpointError, match="rng.pt"):
        reader.load_checkpoint()
    assert len(saves) == 1 + run_dir_module.READ_ATTEMPTS


LINUX_ONLY = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise: Linux's page cache")


@LINUX_ONLY
def test_a_checkpoints_large_files_leave_the_page_cache_once_on_disk(tmp_path):
    """A checkpoint of a few GB would stay in Linux's page cache, pushing out what users' programs cached; its
    adapter, optimizer state and EMA leave it as they reach the disk. Other writes (a LoRA a loader reads next) stay
    cached: the control, which shows the measurement sees cached pages."""
    from headroom.training.data.files import write_bytes

    size = 16 << 20
    write_bytes(tmp_path / "lora.safetensors", bytes(size), "a LoRA")
    assert cached_bytes(tmp_path / "lora.safetensors") >= size // 2
    checkpoint = _checkpoint(3)
    checkpoint.adapter = {"a.weight": torch.ones(size // 4)}
    checkpoint.optimizer["state"][0]["exp_avg"] = torch.ones(size // 4)
    checkpoint.ema = {"a.weight": torch.ones(size // 4)}
    folder = RunDir(tmp_path, "run").save_checkpoint(checkpoint)
    for name in ("adapter.safetensors", "optimizer.pt", "ema.safetensors"):
        assert (folder / name).stat().st_size >= size and cached_bytes(folder / name) <= size // 64, name
    assert torch.equal(RunDir(tmp_path, "run").load_checkpoint().optimizer["state"][0]["exp_avg"], torch.ones(size // 4))


@LINUX_ONLY
def test_a_large_file_leaves_the_page_cache_while_it_is_written(tmp_path, monkeypatch):
    """A full fine-tune's optimizer state can be tens of GB: cached whole until its end, one file would still push
    out the users' cached files. Every DROP_BEHIND_BYTES written is flushed and dropped, and the rest at close."""
    from headroom.training import os_compat

    monkeypatch.setattr(os_compat, "DROP_BEHIND_BYTES", 4 << 20)
    path = tmp_path / "optimizer.pt"
    with os_compat.open_to_write(path, drop_cached=True) as handle:
        for _ in range(32):
            handle.write(bytes(1 << 20))
        handle.flush()
        assert path.stat().st_size == 32 << 20 and cached_bytes(path) <= 5 << 20  # at most the part since the last drop
    assert cached_bytes(path) == 0 and path.read_bytes() == bytes(32 << 20)


def test_the_room_checkpoints_need_counts_the_ones_a_run_already_has(tmp_path):
    """A new run needs room for its latest checkpoint and the next, written beside it (older ones go first where the
    disk holds no more); a resumed run's folders already take theirs. Only step folder names count (not temp or
    other names)."""
    from headroom.training.core.run_dir import (KEEP_CHECKPOINTS, checkpoints_on_disk, disk_room_needed,
                                                next_checkpoint_room)

    one = 100 << 20  # a save asks for the next beside the latest with 1 % + 64 KiB to spare
    assert next_checkpoint_room(one) == one + (1 << 20) + (64 << 10)
    assert KEEP_CHECKPOINTS == 2 and checkpoints_on_disk(tmp_path, "run") == 0
    assert disk_room_needed(one, 0) == one + next_checkpoint_room(one)
    run = RunDir(tmp_path, "run")
    run.save_checkpoint(_checkpoint(3))
    (run.path / "checkpoints" / ".step_00000009.hrtmp-1-abc").mkdir()
    (run.path / "checkpoints" / "notes.txt").write_text("x")
    assert checkpoints_on_disk(tmp_path, "run") == 1 and disk_room_needed(one, 1) == next_checkpoint_room(one)
    for step in (6, 9):
        run.save_checkpoint(_checkpoint(step))
    # the older folder's room counts: what the save asks for beyond it
    assert checkpoints_on_disk(tmp_path, "run") == 2 and disk_room_needed(one, 2) == (1 << 20) + (64 << 10)
    assert disk_room_needed(one, 3) == 0
    # a run folder leading outside the root (an uploaded symlink) is not listed: the outside folder's steps count none
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "linked").symlink_to(run.path, target_is_directory=True)
    assert checkpoints_on_disk(tmp_path / "root", "linked") == 0


def _folders(run: RunDir) -> list[str]:
    return sorted(p.name for p in (run.path / "checkpoints").iterdir())


def test_a_save_removes_the_older_checkpoint_first_where_that_makes_the_room_it_needs(tmp_path, monkeypatch):
    """A disk that holds two checkpoints but not a third: before a save, the older goes (the save's prune would
    remove it after it anyway) and the latest stays until the next is whole; the run says so. Where removing would
    not make the room, nothing is removed and the save says disk full as before. The free space is what is faked
    (a real full tmpfs: the next test)."""
    import errno

    from headroom.training.core import run_dir as R
    from headroom.training.data.files import DiskFullError

    def checkpoint(step: int) -> Checkpoint:
        made = _checkpoint(step)
        made.adapter["a.lora_A.default.weight"] = torch.randn(1 << 18)  # 1 MiB: the files' own bytes a small part
        return made

    run = RunDir(tmp_path, "run")
    for step in (3, 6):
        run.save_checkpoint(checkpoint(step))
    one = R._folder_bytes(run.path / "checkpoints" / "step_00000006")
    assert one > 1 << 20 and run.room_note == ""
    monkeypatch.setattr(R, "free_bytes", lambda path: one // 2)  # not one more, but one more once step 3 is gone
    run.save_checkpoint(checkpoint(9))
    assert _folders(run) == ["step_00000006", "step_00000009"] and run.latest_step() == 9
    assert run.room_note.startswith("disk: the older checkpoint (step 3) was removed before step 9 was saved, to "
                                    "make room ("), run.room_note
    assert run.room_note.endswith("); the run keeps its latest checkpoint while it writes the next"), run.room_note
    # room enough: nothing removed before the save (its prune keeps two, as always)
    run.room_note = ""
    monkeypatch.setattr(R, "free_bytes", lambda path: 1 << 40)
    removed, remove = [], R._remove_folder
    monkeypatch.setattr(R, "_remove_folder", lambda path: (removed.append(path.name), remove(path)))
    run.save_checkpoint(checkpoint(12))
    assert removed == ["step_00000006"] and run.room_note == ""  # by the prune, after the save
    monkeypatch.undo()
    # no room even with the older gone: it stays, and the save fails as it would have
    monkeypatch.setattr(R, "free_bytes", lambda path: 0)
    monkeypatch.setattr(R, "_folder_bytes", lambda path: 1000 if path.name == "step_00000009" else one)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(R, "write_safetensors", full)
    with pytest.raises(DiskFullError, match="checkpoint of run 'run' at step 15"):
        run.save_checkpoint(checkpoint(15))
    assert _folders(run) == ["step_00000009", "step_00000012"] and run.latest_step() == 12 and run.room_note == ""
    # a damaged pointer is no reason to remove anything (the save replaces it, as before)
    monkeypatch.undo()
    (run.path / "latest.json").write_text("{")
    monkeypatch.setattr(R, "free_bytes", lambda path: 0)
    assert run.save_checkpoint(checkpoint(18)).name == "step_00000018" and run.latest_step() == 18
    assert _folders(run) == ["step_00000012", "step_00000018"] and run.room_note == ""
    # an older folder that cannot be moved (Windows: a file in it held open): no note claims it went
    monkeypatch.setattr(R, "free_bytes", lambda path: one // 2)
    monkeypatch.setattr(R, "_remove_folder", lambda path: False)
    run.save_checkpoint(checkpoint(21))
    assert run.latest_step() == 21 and run.room_note == ""


def test_a_large_write_the_disk_cannot_hold_fails_before_it_starts(tmp_path, monkeypatch):
    """A write of at least files.ROOM_CHECKED_BYTES (a full fine-tune's checkpoint, a large LoRA / ControlNet file)
    that the free space cannot hold says "disk full" at once, as a write that met the full disk says it, before any
    byte is written (not after minutes of writing, the disk full meanwhile); smaller ones just write, and a file
    system that reports no size (some network and FUSE mounts: 0 total, 0 free) is not asked."""
    import collections
    import shutil

    from headroom.training.data import files
    from headroom.training.data.files import DiskFullError, format_bytes

    big = {"w": torch.zeros(files.ROOM_CHECKED_BYTES // 4)}
    monkeypatch.setattr(files, "free_bytes", lambda path: files.ROOM_CHECKED_BYTES - 1)
    with pytest.raises(DiskFullError, match=rf"^disk full: big file could not be written to .*big\.safetensors \(it "
                       rf"needs about {format_bytes(files.ROOM_CHECKED_BYTES + 4096)}, "
                       rf"{format_bytes(files.ROOM_CHECKED_BYTES - 1)} is free there\)"):
        files.save_safetensors(tmp_path / "big.safetensors", big, "big file")
    assert list(tmp_path.iterdir()) == []  # not even a temp was made
    files.save_safetensors(tmp_path / "small.safetensors", {"w": torch.zeros(4)}, "small file")  # not asked
    # a checkpoint: after the older one made what room it could, before its temp folder
    run = RunDir(tmp_path, "run")
    run.save_checkpoint(_checkpoint(3))
    large = _checkpoint(6)
    large.optimizer["state"][0]["exp_avg"] = torch.zeros(files.ROOM_CHECKED_BYTES // 4)
    with pytest.raises(DiskFullError, match="^disk full: checkpoint of run 'run' at step 6 could not be written"):
        run.save_checkpoint(large)
    assert _folders(run) == ["step_00000003"] and run.latest_step() == 3
    # a file system that says nothing of its size
    Usage = collections.namedtuple("Usage", "total used free")
    monkeypatch.undo()
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(0, 0, 0))
    assert files.free_bytes(tmp_path) is None
    files.save_safetensors(tmp_path / "big.safetensors", big, "big file")
    assert (tmp_path / "big.safetensors").stat().st_size > files.ROOM_CHECKED_BYTES


_ON_TMPFS = r"""
import ctypes, json, os, pathlib, subprocess, sys
sys.path.insert(0, sys.argv[2])
import conftest  # noqa: F401  (registers the repo as the package `headroom`)
import torch
from headroom.training.core.run_dir import RunDir
from headroom.training.data import files
from test_run_dir import _checkpoint

disk = sys.argv[1]
if ctypes.CDLL(None, use_errno=True).unshare(0x00020000) != 0:  # CLONE_NEWNS: the mount stays in this process
    print(json.dumps({"skip": "unshare(CLONE_NEWNS): " + os.strerror(ctypes.get_errno())}))
    sys.exit()
for command in (["mount", "--make-rprivate", "/"],
                ["mount", "-t", "tmpfs", "-o", "size=" + sys.argv[3], "tmpfs", disk]):
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        print(json.dumps({"skip": " ".join(command) + ": " + done.stderr.strip()}))
        sys.exit()
"""


def _on_tmpfs(tmp_path, size: str, script: str) -> dict:
    """Run `script` in a child process on a real tmpfs of `size` mounted at `disk`, in a mount namespace of its own
    (RunDir, files, torch and _checkpoint imported); the JSON of its last line. Skips where that cannot be mounted
    (not root)."""
    import os
    import pathlib
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (run as root, e.g. in CI's container)")
    tests = pathlib.Path(__file__).resolve().parents[1]
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run([sys.executable, "-c", _ON_TMPFS + script, str(disk), str(tests), size],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(tests / "unit")})
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(f"no tmpfs could be mounted here: {result['skip']}")
    return result


_TWO_FIT = r"""
run = RunDir(disk, "run")
saved, notes, error = [], [], None


def checkpoint(step):
    made = _checkpoint(step)
    made.adapter["a.lora_A.default.weight"] = torch.randn(1 << 17)  # 512 KiB
    made.optimizer["state"][0]["exp_avg"] = torch.randn(1 << 18)  # 1 MiB: 1.5 MiB a checkpoint, two fit in 4 MiB
    return made


try:
    for step in range(1, 6):
        run.save_checkpoint(checkpoint(step))
        saved.append(step)
        notes.append(getattr(run, "room_note", ""))  # (getattr: the test says what fails without it)
        run.room_note = ""
except Exception as failed:
    error = f"{type(failed).__name__}: {failed}"
print(json.dumps({"saved": saved, "notes": notes, "error": error, "latest": run.latest_step(),
                  "loaded": run.load_checkpoint().step,
                  "folders": sorted(os.listdir(os.path.join(disk, "run", "checkpoints")))}))
"""


def test_a_disk_with_room_for_two_checkpoints_keeps_saving(tmp_path):
    """A real tmpfs of 4 MiB and checkpoints of about 1.5 MiB: two fit, three do not. Each save from the third on
    removes the older checkpoint first and goes through (before, the third save failed with disk full and every
    later one too); the latest two are on disk and the latest loads."""
    result = _on_tmpfs(tmp_path, "4m", _TWO_FIT)
    assert result["error"] is None and result["saved"] == [1, 2, 3, 4, 5], result
    assert result["notes"][:2] == ["", ""], result
    for step, note in zip((3, 4, 5), result["notes"][2:]):
        assert note.startswith(f"disk: the older checkpoint (step {step - 2}) was removed before step {step} was "
                               "saved"), result
    assert result["latest"] == 5 and result["loaded"] == 5, result
    assert result["folders"] == ["step_00000004", "step_00000005"], result


_FILLED_PART_WAY = r"""
run = RunDir(disk, "run")
run.save_checkpoint(_checkpoint(3))
big = _checkpoint(6)
big.optimizer["state"][0]["exp_avg"] = torch.randn(1 << 20)  # 4 MiB: the adapter fits, the optimizer state does not
errors = {}
try:
    run.save_checkpoint(big)
except Exception as error:
    errors["checkpoint"] = f"{type(error).__name__}: {error}"
for drop_cached in (False, True):  # both ways a file is opened (os_compat.open_to_write)
    try:
        files.write_atomic(os.path.join(disk, "state.pt"), lambda target: files.write_torch(
            target, {"exp_avg": torch.randn(1 << 20)}, drop_cached), "the test's state", 4 << 20)
    except Exception as error:
        errors[f"drop_cached={drop_cached}"] = f"{type(error).__name__}: {error}"
print(json.dumps({"errors": errors, "latest": run.latest_step(), "loaded": run.load_checkpoint().step,
                  "left": sorted(str(p.relative_to(disk)) for p in pathlib.Path(disk).rglob(".*"))}))
"""


def test_a_disk_that_fills_part_way_through_the_optimizer_state_says_disk_full(tmp_path):
    """A real full disk (a 1 MiB tmpfs) met after part of optimizer.pt is written: torch.save's zip writer raises
    "unexpected pos ..." on its way out, over the file's OSError; the user sees the full disk (DiskFullError naming
    the checkpoint), the earlier checkpoint stays the latest and loads, and no temp file is left."""
    result = _on_tmpfs(tmp_path, "1m", _FILLED_PART_WAY)
    assert sorted(result["errors"]) == ["checkpoint", "drop_cached=False", "drop_cached=True"], result
    assert result["errors"]["checkpoint"].startswith("DiskFullError: disk full: checkpoint of run 'run' at step 6"), \
        result
    for way in ("drop_cached=False", "drop_cached=True"):
        assert result["errors"][way].startswith("DiskFullError: disk full: the test's state"), result
    assert result["latest"] == 3 and result["loaded"] == 3 and result["left"] == [], result
