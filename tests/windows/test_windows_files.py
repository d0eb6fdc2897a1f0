"""The engine's files, memory figures and names on Windows (imitated: tests/windows_imitation.py). Each test here
failed before training/os_compat.py: the first write of every run, every read of a binary file, temp-file pruning,
datasets made in Explorer, run names Windows cannot create, and files another program holds open."""
from __future__ import annotations

import builtins
import gc
import os
import stat
import sys
import threading
import time

import pytest
import torch

import windows_imitation
from headroom.training import os_compat
from headroom.training.core.run_dir import Checkpoint, RunDir, check_name
from headroom.training.data import files
from headroom.training.memory import memory_stats

# Bytes text mode would change: CR-LF (read as LF) and 0x1A (read as the end of the file).
AWKWARD = torch.tensor([0x0D, 0x0A, 0x1A, 0x0A, 0x0D, 0x0D, 0x0A, 0x00] * 64, dtype=torch.uint8)


def test_memory_figures_without_resource_or_proc(windows):
    with pytest.raises(ImportError):  # the imitation: the pack's `import resource` fails as on Windows
        # what `import resource` runs in that module (not exec: comfy node validate's ruff check warns on it, S102)
        builtins.__import__("resource", {"__name__": "headroom.training.memory.memory_stats"})
    snapshot = memory_stats.device_memory_snapshot("cpu")
    assert snapshot["process_rss_bytes"] > 0 and snapshot["process_peak_rss_bytes"] >= snapshot["process_rss_bytes"] // 2
    assert memory_stats.reset_peak("cpu") is False  # Windows cannot reset the peak: peaks count from the start
    recorder = memory_stats.PhaseRecorder("cpu")
    with recorder.phase("training"):
        pass
    assert recorder.as_dict()["phases"][0]["peak_rss_bytes"] > 0
    # Windows' heap gives large freed blocks back itself: no glibc, no malloc_trim looked up or called
    assert os_compat.release_freed_host_memory() is False


def test_atomic_writes_do_not_open_folders(windows, tmp_path):
    files.write_json(tmp_path / "sub" / "a.json", {"é": 1}, "test file")
    assert files.read_json(tmp_path / "sub" / "a.json", "test file") == {"é": 1}
    with pytest.raises(PermissionError):  # the imitation: Windows cannot open a folder
        os_compat.fsync_file(tmp_path)


def test_binary_files_survive_text_mode_bytes(windows, tmp_path):
    tensors = {"weight": AWKWARD.clone(), "scale": torch.arange(300, dtype=torch.float32)}
    files.save_safetensors(tmp_path / "lora.safetensors", tensors, "LoRA")
    with files.open_regular(tmp_path / "lora.safetensors", "LoRA") as handle:
        data = handle.read()
    assert len(data) == os.path.getsize(tmp_path / "lora.safetensors")
    from safetensors.torch import load

    loaded = load(data)
    assert torch.equal(loaded["weight"], AWKWARD) and torch.equal(loaded["scale"], tensors["scale"])


def test_checkpoint_round_trip_keeps_every_byte(windows, tmp_path):
    run = RunDir(tmp_path, "my_run")
    run.write_config({"kind": "lora"})
    checkpoint = Checkpoint(step=3, micro_step=3, adapter={"a": AWKWARD.float()}, optimizer={"state": {0: {"m": AWKWARD}}},
                            scheduler={"last_epoch": 3}, scaler=None, rng={"torch": torch.get_rng_state()},
                            loss_history=[[1, 0.5]], validation_history=[])
    run.save_checkpoint(checkpoint)
    loaded = run.load_checkpoint()
    assert loaded.step == 3 and torch.equal(loaded.adapter["a"], AWKWARD.float())
    assert torch.equal(loaded.optimizer["state"][0]["m"], AWKWARD)
    assert torch.equal(loaded.rng["torch"], checkpoint.rng["torch"])


def test_leftover_temps_are_pruned_without_signalling(windows, tmp_path):
    import psutil

    gone = max(psutil.pids()) + 1000
    while psutil.pid_exists(gone):
        gone += 1
    dead = tmp_path / f".x.json{files.TEMP_MARK}{gone}-0123abcd.tmp"
    live = tmp_path / f".y.json{files.TEMP_MARK}{os.getppid()}-0123abcd.tmp"
    dead.write_bytes(b"")
    live.write_bytes(b"")
    assert files.prune_temp(tmp_path) == [dead.name]  # os.kill(pid, 0) would have been Ctrl+C to the console
    assert live.exists()


def test_dataset_ignores_explorer_files_and_caption_bom(windows, tmp_path):
    from PIL import Image

    from headroom.training.data.dataset import dataset_from_folder

    Image.new("RGB", (64, 64), (10, 200, 30)).save(tmp_path / "dog01.png")
    (tmp_path / "dog01.txt").write_bytes("\ufeffa photo of sks dog".encode("utf-8"))  # Notepad's UTF-8 with BOM
    (tmp_path / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")
    (tmp_path / "desktop.ini").write_bytes(b"[.ShellClassInfo]\r\n")
    dataset = dataset_from_folder(tmp_path, resolution=64, step=64)
    assert [item.caption for item in dataset.items] == ["a photo of sks dog"]
    assert dataset.warnings == ()


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32-le"])
def test_captions_windows_tools_write_in_utf16_are_read_by_their_byte_order_mark(windows, tmp_path, encoding):
    """Windows PowerShell 5's `"..." > dog01.txt` and Notepad's "Unicode" write UTF-16 LE with a byte order mark:
    read as the same caption (the same cache entry as the UTF-8 file). Without the mark such a file would read as
    text with a NUL after every letter: refused, naming the file and the fix."""
    from PIL import Image

    from headroom.training.data.dataset import DatasetError, dataset_from_folder

    Image.new("RGB", (64, 64), (10, 200, 30)).save(tmp_path / "dog01.png")
    (tmp_path / "dog01.txt").write_bytes("\ufeffa photo of sks dog, café\r\n".encode(encoding))
    dataset = dataset_from_folder(tmp_path, resolution=64, step=64)
    assert [item.caption for item in dataset.items] == ["a photo of sks dog, café"]
    (tmp_path / "dog01.txt").write_bytes("a photo of sks dog".encode("utf-16-le"))  # no mark
    with pytest.raises(DatasetError, match=r"dog01\.txt: the caption holds NUL characters \(UTF-16 text without its "
                       r"byte order mark\?\); re-save it as UTF-8"):
        dataset_from_folder(tmp_path, resolution=64, step=64)


@pytest.mark.parametrize("name", ["con", "NUL", "aux", "com1", "Lpt9", "con.backup", "run.", "nul.txt"])
def test_names_windows_cannot_create_are_refused(name):
    # Refused on every OS (no imitation needed): a workflow made on Linux is queued on Windows too.
    with pytest.raises(ValueError, match="run name .* is not allowed: .*(device name|trailing dot)"):
        check_name(name, "run name")
    assert check_name("my_dog_v2.1", "run name") == "my_dog_v2.1"


def test_paths_past_260_characters_say_what_to_do(windows, tmp_path):
    deep = tmp_path / ("ComfyUI_windows_portable " + "x" * 80) / "ComfyUI" / "output" / "headroom_runs"
    with pytest.raises(ValueError, match=r"run name 'a{60}' in .*paths of \d+ characters, and Windows allows 259 here: "
                       r"use a shorter name .*LongPathsEnabled"):
        RunDir(deep, "a" * 60)
    with pytest.raises(files.WriteError, match=r"LoRA cannot be written to .*Windows allows 259"):
        files.write_bytes(deep / "loras" / ("b" * 200 + ".safetensors"), b"x", "LoRA")
    from headroom.training.data.cache_store import CacheStoreError, ShardStore

    with pytest.raises(CacheStoreError, match=r"cache folder .* cannot hold its shards: .*Windows allows 259"):
        ShardStore(deep / ("c" * 40)).check_writable()
    RunDir(tmp_path, "short")  # within the limit: fine
    os_compat.WINDOWS = False  # (the fixture restores it) Linux and macOS have no such limit
    RunDir(deep, "a" * 60)


def test_a_file_held_by_another_program_is_retried_then_named(windows, tmp_path, monkeypatch):
    target = tmp_path / "my_lora.safetensors"
    files.write_bytes(target, b"old", "LoRA")
    with windows.hold_open(target):  # released by the "antivirus" after 0.3 s: the save waits for it
        threading.Timer(0.3, windows.held.clear).start()
        files.write_bytes(target, b"new", "LoRA")
    assert target.read_bytes() == b"new"

    monkeypatch.setattr(os_compat, "REPLACE_WAIT_S", 0.3)
    with windows.hold_open(target), pytest.raises(files.WriteError) as raised:
        files.write_bytes(target, b"newer", "LoRA")
    message = str(raised.value)
    assert "LoRA could not be written to" in message and "my_lora.safetensors" in message
    assert "in use by another program" in message and "Load LoRA" in message and "antivirus" in message
    assert "make that folder writable" not in message
    assert target.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["my_lora.safetensors"]


def test_a_read_only_file_is_named_at_once_and_kept(windows, tmp_path, monkeypatch):
    """A LoRA a user marked read-only (to keep it) and saved over with the same name: Windows refuses the replace
    (WinError 5, as for a file in use), which waited and then blamed another program; now it says read-only at once."""
    target = tmp_path / "keeper.safetensors"
    files.write_bytes(target, b"kept", "LoRA")
    target.chmod(stat.S_IREAD)  # Windows' Read-only attribute, as os.chmod sets it there
    monkeypatch.setattr(os_compat, "REPLACE_WAIT_S", 30.0)
    started = time.monotonic()
    with pytest.raises(files.WriteError) as raised:
        files.write_bytes(target, b"new", "LoRA")
    assert time.monotonic() - started < 5
    message = str(raised.value)
    assert "LoRA could not be written to" in message and "keeper.safetensors" in message
    assert "read-only" in message and "Properties" in message and "another program" not in message
    assert target.read_bytes() == b"kept" and [p.name for p in tmp_path.iterdir()] == ["keeper.safetensors"]


def test_a_checkpoint_folder_another_program_reads_is_waited_for_then_named(windows, tmp_path, monkeypatch):
    """A checkpoint is written into a temp folder renamed into place; Windows refuses that rename while another
    program has a file in it open, which is when antivirus and sync programs read what was just written: the save
    waits for them (longer than for a file), then names them, not a Load LoRA node; nothing already saved is lost."""
    from headroom.training.core import run_dir as run_dir_module

    run = RunDir(tmp_path, "my_run")
    run.write_config({"kind": "lora"})

    def checkpoint(step):
        return Checkpoint(step=step, micro_step=step, adapter={"a": torch.full((4,), float(step))},
                          optimizer={"state": {}}, scheduler={"last_epoch": step}, scaler=None,
                          rng={"torch": torch.get_rng_state()}, loss_history=[[step, 0.5]], validation_history=[])

    real_temp = run_dir_module.make_temp_dir
    scanned = []

    def scanned_temp(parent, name):  # the "antivirus" opens the optimizer state as soon as it is there
        folder = real_temp(parent, name)
        scanned.append(folder)
        windows.held.add(os.path.abspath(folder / "optimizer.pt"))
        return folder

    monkeypatch.setattr(run_dir_module, "make_temp_dir", scanned_temp)
    threading.Timer(0.4, windows.held.clear).start()
    run.save_checkpoint(checkpoint(1))  # waited for the scan
    assert run.load_checkpoint().step == 1 and scanned

    monkeypatch.setattr(os_compat, "FOLDER_REPLACE_WAIT_S", 0.3)
    with pytest.raises(files.WriteError) as raised:
        run.save_checkpoint(checkpoint(2))
    windows.held.clear()
    message = str(raised.value)
    assert "checkpoint of run 'my_run' at step 2" in message and "could not be moved into place" in message
    assert "antivirus" in message and "OneDrive" in message and "Load LoRA" not in message
    assert run.load_checkpoint().step == 1  # the last good one kept
    monkeypatch.setattr(run_dir_module, "make_temp_dir", real_temp)  # the scan is over: queued again
    run.save_checkpoint(checkpoint(2))
    assert run.load_checkpoint().step == 2


def test_several_devices_are_refused_with_the_reason(windows, comfyui):
    from headroom.nodes.bridge.rank_workers import parse_devices

    assert parse_devices("1") == 1
    with pytest.raises(ValueError, match=r"devices=2: training on several devices runs on Linux only: Windows has "
                       r"neither NCCL nor the AF_UNIX sockets .* Set devices to 1"):
        parse_devices("2")


def test_the_distributed_script_says_why_several_processes_cannot_train_on_windows(windows, comfyui, monkeypatch,
                                                                                   tmp_path, capsys):
    """torchrun on Windows would stop in torch's NCCL error: the script says the reason and what to do instead,
    before it opens a run."""
    import importlib.util

    from comfy_harness import COMFYUI_PATH, REPO_ROOT

    spec = importlib.util.spec_from_file_location("headroom_train_distributed_windows",
                                                  REPO_ROOT / "workflows" / "headroom_train_distributed.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    # The script lets its own process read the dataset's folder (os.environ, as its command line's owner); set here so
    # the change is undone: left behind, it let later tests' datasets under the same temp folder be listed.
    monkeypatch.setenv("HEADROOM_DATASET_ROOTS", "")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts ComfyUI first, as its own process would
    assert script.main(["--tiny-model", "sd15", "--dataset", str(tmp_path), "--run-name", "two_ranks", "--steps", "1",
                        "--comfyui", str(COMFYUI_PATH)]) == 2
    said = capsys.readouterr().err
    assert "runs on Linux only" in said and "Run one process, or train in ComfyUI on one GPU" in said
    assert not (tmp_path / "two_ranks").exists()


def test_a_saved_files_name_is_the_one_comfyui_lists_on_windows(comfyui, monkeypatch):
    """ComfyUI lists a file in a subfolder with the OS's separator (folder_paths.recursive_search: os.path.relpath):
    "headroom\\x.safetensors" on Windows. The name a save returns (the nodes' lora_name / model name outputs) is that
    one, or a combo fed with it says "Value not in list". Windows' path rules stood in by ntpath."""
    import ntpath
    import types

    import folder_paths
    from headroom.nodes.bridge import model_files

    monkeypatch.setattr(model_files, "os", types.SimpleNamespace(path=ntpath, sep="\\"))
    root = "C:\\ComfyUI_windows_portable\\ComfyUI\\models\\loras"
    name = model_files.listed_name("loras", root, root + "\\headroom\\my run_step000010.safetensors")
    assert name == "headroom\\my run_step000010.safetensors"
    assert name == ntpath.relpath(ntpath.join(root, "headroom", "my run_step000010.safetensors"), root)  # ComfyUI's
    assert "loras" not in folder_paths.filename_list_cache  # listed again at once


@pytest.mark.parametrize("tag, refused", [(0x80000017, False),  # WOF: compressed by compact.exe / CompactGUI
                                          (0x80000013, False),  # deduplicated (Windows Server)
                                          (0x9000001A, False),  # a cloud placeholder (OneDrive)
                                          (0xA0000003, True),  # a junction (mount point)
                                          (0xA000000C, True)])  # a symlink's tag
def test_a_file_windows_compressed_is_read_and_a_junction_is_not(windows, tmp_path, monkeypatch, tag, refused):
    """Reading untrusted files refuses what names another file (a symlink, a junction), not every reparse point:
    Windows' own file compression (a ComfyUI folder compressed with CompactGUI) is one too, and such a dataset was
    refused as a symlink. Windows' lstat fields stood in (st_file_attributes, st_reparse_tag)."""
    import types

    path = tmp_path / "photo.png"
    path.write_bytes(b"\x89PNG")
    real_lstat = os.lstat

    def windows_lstat(target, *args, **kwargs):
        status = real_lstat(target, *args, **kwargs)
        if os.fspath(target) != os.fspath(path):
            return status
        fields = {name: getattr(status, name) for name in dir(status) if name.startswith("st_")}
        return types.SimpleNamespace(**fields, st_file_attributes=0x400 | 0x20, st_reparse_tag=tag)

    monkeypatch.setattr(os_compat.os, "lstat", windows_lstat)
    if refused:
        with pytest.raises(OSError, match="is a symlink"):
            os_compat.open_no_follow(path)
    else:
        fd = os_compat.open_no_follow(path)
        try:
            assert os.read(fd, 4) == b"\x89PNG"
        finally:
            os.close(fd)


def test_a_cache_shard_still_mapped_is_not_written_over(windows, tmp_path, monkeypatch):
    """A latent cache's shard goes bad (a bit flipped on disk) while the last caching run's LatentCache still has it
    memory-mapped (ComfyUI keeps the previous prompt's outputs). The next caching run re-encodes exactly that
    shard's entries: their shard name came from their keys, so it was written over the mapped file, which Windows
    refuses (WinError 1224): the run waited and then failed blaming another program. Now a shard takes a name no
    file has, and the mapped one is removed by a later caching run once it is unmapped and old."""
    from headroom.training.data.cache_store import ShardStore, cache_latents
    from headroom.training.data.dataset import dataset_from_tensors
    from headroom.training.data.synthetic import generate_shapes

    def vae(pixels):
        return torch.nn.functional.avg_pool2d(torch.cat([pixels.movedim(-1, 1)] * 2, dim=1)[:, :4], 8)

    monkeypatch.setattr(os_compat, "REPLACE_WAIT_S", 0.3)
    data = generate_shapes(3, 32, seed=3)
    dataset = dataset_from_tensors(data.images, data.captions, resolution=32, step=16)
    root = tmp_path / "cache"
    earlier, _ = cache_latents(dataset, ShardStore(root), vae, "fp-vae", {})
    expected = [earlier.latent(i).clone() for i in range(3)]  # `earlier` keeps its shard mapped from here on
    (shard,) = (root / "shards").iterdir()
    assert str(shard.resolve()) in windows_imitation.mapped_files()
    with open(shard, "r+b") as handle:  # every entry's bytes flipped in place (after the header): still mapped
        handle.seek(8 + int.from_bytes(handle.read(8), "little"))
        start = handle.tell()
        tensors = handle.read()
        handle.seek(start)
        handle.write(bytes(b ^ 0xFF for b in tensors))

    again, report = cache_latents(dataset, ShardStore(root), vae, "fp-vae", {})
    assert report.misses == 3 and report.hits == 0
    assert all(torch.equal(again.latent(i), expected[i]) for i in range(3))
    assert shard.exists()  # mapped by `earlier`: Windows keeps it (unlisted, harmless)
    manifest_shards = {path.name for path in (root / "shards").iterdir()} - {shard.name}
    assert len(manifest_shards) == 1

    del earlier
    gc.collect()
    old = time.time() - 2 * 3600
    os.utime(shard, (old, old))
    cache_latents(dataset, ShardStore(root), vae, "fp-vae", {})
    assert {path.name for path in (root / "shards").iterdir()} == manifest_shards


def test_the_imitation_refuses_a_mapped_file_however_it_is_removed_or_replaced(windows, tmp_path):
    """The imitation itself: Windows refuses to remove, rename or replace a mapped file whether the code calls os.* or
    pathlib (Python 3.10's pathlib took os.unlink when it was imported: Path.unlink went past the imitation there)."""
    import mmap
    import pathlib

    mapped, other = tmp_path / "mapped.bin", tmp_path / "other.bin"
    mapped.write_bytes(b"\x00" * 4096)
    other.write_bytes(b"\x01" * 4096)
    with open(mapped, "rb") as handle:
        view = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        for remove in (os.unlink, os.remove, pathlib.Path.unlink, lambda path: path.rename(tmp_path / "moved.bin"),
                       lambda path: other.replace(path)):
            with pytest.raises(PermissionError, match="user-mapped section"):
                remove(mapped)
        assert mapped.read_bytes() == b"\x00" * 4096
    finally:
        view.close()
    mapped.unlink()  # unmapped: allowed
    assert not mapped.exists()
