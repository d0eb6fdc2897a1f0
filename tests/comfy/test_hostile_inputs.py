"""Hostile input (issue 13): names, paths, pointer files, symlinks, decompression bombs, NaN / infinity and bad files,
each given to the real nodes (in-process ComfyUI on the CPU, tiny SD1.5).

Every case ends in a clear error (the exception type, a message naming the input or file, no absolute server path)
or a listed skip (the item left out and named in the warnings, or a damaged cache / report ignored with a warning).
While a case runs, nothing outside ComfyUI's folders is read or written: a Linux inotify watch on the folder the
hostile pointers and symlinks lead to sees every open, read and write there from any code (Python, C, Rust), and a
Python audit hook sees opens of system files and writes anywhere outside the ComfyUI base folder.
"""
from __future__ import annotations

import ctypes
import io
import json
import math
import os
import pathlib
import shutil
import struct
import sys
import zlib

import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.comfyui

SECRET = "TOP-SECRET-NOT-A-CAPTION"
SYSTEM_FILES = ("/etc/passwd", "/etc/hostname", "/etc/shadow")


# --- watching what is touched ---------------------------------------------------------------------------------------
class _Audit:
    """Opens of files outside (the watched folder, system files) and writes outside the ComfyUI base (the kernel's
    /proc and /dev aside: the memory records reset the peak RSS through /proc/self/clear_refs), while on."""

    on = False
    base = outside = ""
    found: list[str] = []
    busy = False
    READS = ("open", "os.listdir", "os.scandir")
    WRITES = ("os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.symlink", "os.truncate", "os.chmod",
              "shutil.rmtree", "shutil.copyfile")

    @classmethod
    def hook(cls, event: str, args) -> None:
        # Only events whose first argument is a path: other events' may be bytes that are no path (marshal.loads'
        # bytecode, when a node imports a module inside execute: realpath of its NUL bytes failed that import).
        if not cls.on or cls.busy or not args or event not in cls.READS + cls.WRITES:
            return
        cls.busy = True
        try:
            path = args[0]
            if isinstance(path, (str, bytes, os.PathLike)) and "\0" not in os.fsdecode(path):  # a NUL path: open fails
                flags = args[2] if event == "open" and len(args) >= 3 and isinstance(args[2], int) else 0
                # An O_NOFOLLOW open of a symlink fails without touching its target, and removing or renaming one
                # acts on the link itself: judge the link's own path there.
                nofollow = bool(flags & getattr(os, "O_NOFOLLOW", 0)) or event in (
                    "os.remove", "os.rename", "os.replace", "os.rmdir", "shutil.rmtree")
                real = os.path.abspath(os.fsdecode(path)) if nofollow else os.path.realpath(os.fsdecode(path))
                writing = event in cls.WRITES
                if event == "open" and len(args) >= 3:
                    mode, flags = args[1], args[2]
                    writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                        isinstance(flags, int) and bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)))
                outside = real == cls.outside or real.startswith(cls.outside + os.sep)
                if event in cls.READS and (outside or real in SYSTEM_FILES):
                    cls.found.append(f"{event} {real}")
                elif writing and not (real == cls.base or real.startswith((cls.base + os.sep, "/proc/", "/dev/"))):
                    cls.found.append(f"write {event} {real}")
        finally:
            cls.busy = False


sys.addaudithook(_Audit.hook)

IN_ACCESS, IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE, IN_OPEN = 0x1, 0x2, 0x4, 0x8, 0x20
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200


class Watch:
    """inotify on the outside folder and its subfolders: any process's (any library's) open, read or write."""

    def __init__(self, folder: pathlib.Path, base: pathlib.Path):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        assert self.fd >= 0, "inotify is not available"
        mask = IN_ACCESS | IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_OPEN | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE \
            | IN_DELETE
        for path in [folder, *(p for p in folder.rglob("*") if p.is_dir() and not p.is_symlink())]:
            assert self.libc.inotify_add_watch(self.fd, os.fsencode(path), mask) >= 0
        self.folder, self.base = folder, base

    def events(self) -> list[int]:
        masks = []
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return masks
            offset = 0
            while offset < len(data):
                _, mask, _, length = struct.unpack_from("iIII", data, offset)
                masks.append(mask)
                offset += 16 + length

    def __enter__(self):
        self.events()  # drop what the set-up did
        _Audit.base, _Audit.outside = os.path.realpath(self.base), os.path.realpath(self.folder)
        _Audit.found = []
        _Audit.on = True
        return self

    def __exit__(self, *exc):
        _Audit.on = False
        touched = self.events()
        os.close(self.fd)
        assert not touched, f"something outside ComfyUI's folders was opened, read or written: {touched}"
        assert not _Audit.found, f"outside ComfyUI's folders: {_Audit.found}"


def clear_error(error: BaseException, *must_name: str, echo: str = "") -> str:
    """A clear error: our message names what it is about, and never an absolute path of the server (other than
    `echo`, the value the user gave, quoted back)."""
    message = str(error)
    for name in must_name:
        assert name in message, f"{name!r} not named in: {message}"
    own = message.replace(repr(echo), "") if echo else message
    assert World.base not in own and World.outside not in own, f"absolute path in: {message}"
    assert "Traceback" not in message
    return message


# --- the world: a ComfyUI base, an outside folder, tiny models and a trained run to copy ---------------------------
class World:
    base = outside = ""


@pytest.fixture(scope="module")
def world(comfyui, tmp_path_factory):
    from test_train_lora_nodes import _data, _init

    import folder_paths

    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.model_files import runs_root

    outside = tmp_path_factory.mktemp("outside")
    World.base, World.outside = str(comfyui), str(outside)
    (outside / "secret.txt").write_text(SECRET)
    Image.new("RGB", (32, 32), (200, 10, 10)).save(outside / "outside.png")
    (outside / "outside.safetensors").write_bytes(b"\0" * 64)

    cache_root = pathlib.Path(folder_paths.get_output_directory()).parent / "hostile_cache"
    with pytest.MonkeyPatch.context() as patch:  # a cache folder of this module's own (its manifests get edited)
        patch.setitem(folder_paths.folder_names_and_paths, "headroom_cache", ([str(cache_root)], set()))
        patch.delenv("HEADROOM_DATASET_ROOTS", raising=False)  # ComfyUI's input folder is the only dataset root
        model, clip, vae, latents, texts = _data("sd15")
        run = _init(model, latents, texts, "hostile_template", rank=4, batch_size=2)
        with torch.inference_mode():
            T.HeadroomTrainSteps.execute(run, 1, checkpoint_minutes=0.0)
        template = runs_root() / "hostile_template"
        shutil.copytree(template / "checkpoints" / "step_00000001", outside / "checkpoint")
        shutil.copytree(template, outside / "run")
        (outside / "latest.json").write_text(json.dumps({"step": 1, "checkpoint": "checkpoints/step_00000001"}))
        input_dir = pathlib.Path(folder_paths.get_input_directory())
        yield dict(model=model, clip=clip, vae=vae, latents=latents, texts=texts, run=run, template=template,
                   outside=outside, input=input_dir, cache_root=cache_root, base=comfyui, patch=patch)


def _watch(world) -> Watch:
    return Watch(world["outside"], world["base"])


def test_a_module_imported_from_its_bytecode_while_watched_imports(tmp_path):
    """A node that imports a module inside `execute`, whose bytecode another process already cached: the audit sees
    marshal.loads with the bytecode, which is no path (judged as one, its NUL bytes failed the import: "embedded null
    byte", in whichever worker imported second)."""
    import importlib.util
    import py_compile

    source = tmp_path / "imported_inside_execute.py"
    source.write_text("VALUE = 7\n")
    compiled = py_compile.compile(str(source), cfile=str(tmp_path / "imported_inside_execute.pyc"), doraise=True)
    spec = importlib.util.spec_from_file_location("imported_inside_execute", compiled)  # a sourceless loader
    module = importlib.util.module_from_spec(spec)
    _Audit.base, _Audit.outside, _Audit.found, _Audit.on = str(tmp_path), str(tmp_path / "outside"), [], True
    try:
        spec.loader.exec_module(module)
    finally:
        _Audit.on = False
    assert module.VALUE == 7 and not _Audit.found


# --- 1. names -----------------------------------------------------------------------------------------------------
BAD_NAMES = ["", " ", ".", "..", "../x", "x/../y", "/etc/passwd", "a/b", "a\\b", "x\n", "x\r", "\nx", "x\t",
             "x\x00y", "x" * 101, ".hidden", "-dash", "ü", "a b", "C:x", "~", "x\u2028", "run\u202e", "%2e%2e", "x..y"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=[repr(n)[:24] for n in BAD_NAMES])
def test_bad_run_names_are_refused(world, name):
    from test_train_lora_nodes import _init

    from headroom.nodes.bridge.model_files import runs_root

    before = sorted(os.listdir(runs_root()))
    with _watch(world), pytest.raises(ValueError) as error:
        _init(world["model"], world["latents"], world["texts"], name)
    clear_error(error.value, "Train LoRA: Init (Headroom): ", "run name")
    assert sorted(os.listdir(runs_root())) == before, "a folder was created for a refused name"


# A file name may be as long as a 100-character run name plus "_step000123_extracted" (model_files.models_file).
BAD_FILE_NAMES = ["../x", "/tmp/x", "x\n", "a/b", "..", ".x", "x\x00", "x" * (100 + len("_step000000_extracted") + 1),
                  "ü.safetensors", "x y"]


@pytest.mark.parametrize("name", BAD_FILE_NAMES, ids=[repr(n)[:24] for n in BAD_FILE_NAMES])
def test_bad_lora_file_names_are_refused(world, name):
    from headroom.nodes.train_lora import HeadroomSaveLora

    with _watch(world), pytest.raises(ValueError) as error:
        HeadroomSaveLora.execute(world["run"], "hostile", name, "fp32")
    clear_error(error.value, "Save LoRA (Headroom): ", "LoRA file name")


BAD_SUBFOLDERS = ["../x", "/abs", "a/../b", "a//b", "c:/x", "x\n/y", "..", "a/./b", "\\\\srv\\share", "x\x00"]


@pytest.mark.parametrize("subfolder", BAD_SUBFOLDERS, ids=[repr(n)[:24] for n in BAD_SUBFOLDERS])
def test_bad_subfolders_are_refused(world, subfolder):
    from headroom.nodes.train_lora import HeadroomSaveLora

    with _watch(world), pytest.raises(ValueError) as error:
        HeadroomSaveLora.execute(world["run"], subfolder, "", "fp32")
    clear_error(error.value, "Save LoRA (Headroom): ", "subfolder")


# --- 2. dataset folder paths -------------------------------------------------------------------------------------------
def _folder_cases(world) -> dict:
    """name -> (folder, control_folder[, mask_folder]) given to Dataset From Folder."""
    input_dir, outside = world["input"], world["outside"]
    good = input_dir / "hostile_good"
    if not good.exists():
        good.mkdir()
        Image.new("RGB", (32, 32), (10, 200, 10)).save(good / "good.png")
        (good / "good.txt").write_text("a green square")
        (input_dir / "hostile_link_out").symlink_to(outside, target_is_directory=True)
        (input_dir / "hostile_nested").mkdir()
        (input_dir / "hostile_nested" / "deeper").symlink_to("../../" + os.path.relpath(outside, input_dir.parent))
        (input_dir / "hostile_a_file").write_text("not a folder")
        (input_dir / "hostile_control_out").symlink_to(outside, target_is_directory=True)
    return {
        "dotdot": ("..", ""), "dotdot2": ("../..", ""), "root": ("/", ""), "etc": ("/etc", ""), "tmp": ("/tmp", ""),
        "output": ("../output", ""), "tilde": ("~", ""), "tilde_root": ("~root", ""), "unc": ("\\\\server\\share", ""),
        "windows": ("C:\\Windows", ""), "url": ("file:///etc", ""), "nul": ("x\x00y", ""), "newline": ("x\ny", ""),
        "missing": ("hostile_missing_folder", ""), "a_file": ("hostile_a_file", ""),
        "symlink_out": ("hostile_link_out", ""), "nested_symlink_out": ("hostile_nested/deeper", ""),
        "control_dotdot": ("hostile_good", "../../x"), "control_symlink_out": ("hostile_good", "hostile_control_out"),
        "control_absolute": ("hostile_good", str(outside)),
        "mask_dotdot": ("hostile_good", "", "../../x"), "mask_symlink_out": ("hostile_good", "", "hostile_control_out"),
        "mask_absolute": ("hostile_good", "", str(outside)),
    }


FOLDER_CASES = ["dotdot", "dotdot2", "root", "etc", "tmp", "output", "tilde", "tilde_root", "unc", "windows", "url",
                "nul", "newline", "missing", "a_file", "symlink_out", "nested_symlink_out", "control_dotdot",
                "control_symlink_out", "control_absolute", "mask_dotdot", "mask_symlink_out", "mask_absolute"]


@pytest.mark.parametrize("case", FOLDER_CASES)
def test_dataset_folders_outside_input_are_refused(world, case):
    from headroom.nodes.cache import HeadroomDatasetFromFolder
    from headroom.training.data.dataset import DatasetError

    folder, control, mask = (*_folder_cases(world)[case], "")[:3]
    with _watch(world), pytest.raises((ValueError, DatasetError)) as error:
        HeadroomDatasetFromFolder.execute(folder=folder, control_folder=control, resolution=32, step=32, crop="center",
                                          flip=False, seed=0, skip_bad=True, mask_folder=mask)
    message = clear_error(error.value, echo=mask or control or folder)
    assert "folder" in message


# --- 3. files inside a dataset folder: symlinks, bombs, bad files ----------------------------------------------------------
def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with almost no pixel data: a decompression bomb's header."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 64)) + _chunk(b"IEND", b"")


def _jpeg_claiming(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, "JPEG")
    data = bytearray(buffer.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def _bmp_claiming(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, "BMP")
    data = bytearray(buffer.getvalue())
    data[18:26] = struct.pack("<ii", width, height)
    return bytes(data)


def _png(size=(32, 32), color=(0, 0, 200)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


def _make(folder: pathlib.Path, name: str, data: bytes | str | None = None, link: str | None = None) -> None:
    path = folder / name
    if link is not None:
        path.symlink_to(link)
    elif isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)


def _file_case(world, case: str, folder: pathlib.Path) -> str:
    """Lay out `folder` (a good item plus one hostile entry); returns the hostile file's name."""
    outside = world["outside"]
    folder.mkdir()
    (folder / "good.png").write_bytes(_png(color=(10, 200, 10)))
    (folder / "good.txt").write_text("a green square")
    caption = lambda name: _make(folder, name, "a caption")  # noqa: E731
    if case == "image_symlink_out":
        _make(folder, "bad.png", link=str(outside / "outside.png"))
        caption("bad.txt")
    elif case == "caption_symlink_out":
        _make(folder, "bad.png", _png())
        _make(folder, "bad.txt", link=str(outside / "secret.txt"))
    elif case == "image_symlink_passwd":
        _make(folder, "bad.png", link="/etc/passwd")
        caption("bad.txt")
    elif case == "caption_symlink_hostname":
        _make(folder, "bad.png", _png())
        _make(folder, "bad.txt", link="/etc/hostname")
    elif case == "caption_relative_symlink_out":
        _make(folder, "bad.png", _png())
        _make(folder, "bad.txt", link=os.path.relpath(outside / "secret.txt", folder))
    elif case == "dangling_image_symlink":
        _make(folder, "bad.png", link=str(folder / "nowhere.png"))
        caption("bad.txt")
    elif case == "symlink_loop":
        _make(folder, "bad.png", link=str(folder / "loop.png"))
        _make(folder, "loop.png", link=str(folder / "bad.png"))
        caption("bad.txt")
        caption("loop.txt")
    elif case == "image_fifo":
        os.mkfifo(folder / "bad.png")
        caption("bad.txt")
    elif case == "caption_fifo":
        _make(folder, "bad.png", _png())
        os.mkfifo(folder / "bad.txt")
    elif case == "caption_is_folder":
        _make(folder, "bad.png", _png())
        (folder / "bad.txt").mkdir()
    elif case == "png_bomb_header":
        _make(folder, "bad.png", png_header_only(100_000, 100_000))
        caption("bad.txt")
    elif case == "png_oversize_header":
        _make(folder, "bad.png", png_header_only(13_000, 13_000))
        caption("bad.txt")
    elif case == "jpeg_bomb_header":
        _make(folder, "bad.jpg", _jpeg_claiming(65_000, 65_000))
        caption("bad.txt")
    elif case == "bmp_bomb_header":
        _make(folder, "bad.bmp", _bmp_claiming(40_000, 40_000))
        caption("bad.txt")
    elif case == "truncated_png":
        _make(folder, "bad.png", _png((64, 64))[:60])
        caption("bad.txt")
    elif case == "empty_png":
        _make(folder, "bad.png", b"")
        caption("bad.txt")
    elif case == "text_as_png":
        _make(folder, "bad.png", "this is not an image")
        caption("bad.txt")
    elif case == "random_bytes_jpg":
        _make(folder, "bad.jpg", os.urandom(4096))
        caption("bad.txt")
    elif case == "unsupported_gif":
        Image.new("RGB", (8, 8)).save(folder / "bad.gif")
    elif case == "caption_not_utf8":
        _make(folder, "bad.png", _png())
        _make(folder, "bad.txt", b"\xff\xfe\xfa caption")
    elif case == "caption_huge":
        _make(folder, "bad.png", _png())
        _make(folder, "bad.txt", "x" * (2 << 20))
    elif case == "caption_missing":
        _make(folder, "bad.png", _png())
    if case.startswith("caption_") and case != "caption_missing":
        return "bad.txt"
    return next(p.name for p in folder.iterdir() if p.name.startswith("bad") and not p.name.endswith(".txt"))


FILE_CASES = ["image_symlink_out", "caption_symlink_out", "image_symlink_passwd", "caption_symlink_hostname",
              "caption_relative_symlink_out", "dangling_image_symlink", "symlink_loop", "image_fifo", "caption_fifo",
              "caption_is_folder", "png_bomb_header", "png_oversize_header", "jpeg_bomb_header", "bmp_bomb_header",
              "truncated_png", "empty_png", "text_as_png", "random_bytes_jpg", "unsupported_gif", "caption_not_utf8",
              "caption_huge", "caption_missing"]


@pytest.mark.parametrize("case", FILE_CASES)
def test_hostile_dataset_files_are_refused_or_skipped(world, case):
    """Without skip_bad: a DatasetError naming the file. With it: only the good item is cached, the bad one is named
    among the warnings. A secret behind a symlink never becomes a caption."""
    from headroom.nodes.cache import HeadroomCacheLatents, HeadroomDatasetFromFolder
    from headroom.training.data.dataset import DatasetError

    folder = world["input"] / f"hostile_files_{case}"
    bad = _file_case(world, case, folder)
    inputs = dict(folder=folder.name, resolution=32, step=32, crop="center", flip=False, seed=0)
    with _watch(world):
        with pytest.raises(DatasetError) as error, torch.inference_mode():
            dataset = HeadroomDatasetFromFolder.execute(**inputs, skip_bad=False).args[0]
            HeadroomCacheLatents.execute(dataset, world["vae"])  # what only decoding finds fails here
        clear_error(error.value, bad)
        with torch.inference_mode():
            dataset = HeadroomDatasetFromFolder.execute(**inputs, skip_bad=True).args[0]
            cache, summary = HeadroomCacheLatents.execute(dataset, world["vae"]).args
    assert len(cache) == 1 and cache.name(0) == "good.png"
    assert bad in summary or any(bad in warning for warning in dataset.warnings), (summary, dataset.warnings)
    assert all(SECRET not in item.caption for item in dataset.items)


# --- 4. pointer and state files in a run folder ----------------------------------------------------------------------
class Payload:
    """Runs a command when unpickled: torch.load(weights_only=True) must refuse it."""

    marker = ""

    def __reduce__(self):
        return os.system, (f"touch {Payload.marker}",)


def _state(run_dir: pathlib.Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "step_00000001" / "optimizer.pt", weights_only=True)


def _tamper(world, case: str, run_dir: pathlib.Path) -> None:
    outside, ckpt = world["outside"], run_dir / "checkpoints" / "step_00000001"
    latest = run_dir / "latest.json"
    pointer = lambda value: latest.write_text(json.dumps(value) if not isinstance(value, str) else value)  # noqa: E731
    from safetensors.torch import load_file, save_file

    adapter = load_file(str(ckpt / "adapter.safetensors"))
    if case == "pointer_absolute":
        pointer({"step": 1, "checkpoint": str(outside / "checkpoint")})
    elif case == "pointer_dotdot":
        pointer({"step": 1, "checkpoint": "../../../" + os.path.relpath(outside / "checkpoint", run_dir.parents[2])})
    elif case == "pointer_through_checkpoints":
        pointer({"step": 1, "checkpoint": "checkpoints/../../" + os.path.relpath(outside / "checkpoint", run_dir.parent)})
    elif case == "pointer_other_run":
        pointer({"step": 1, "checkpoint": "../hostile_template/checkpoints/step_00000001"})
    elif case == "checkpoint_folder_symlink_out":
        shutil.rmtree(ckpt)
        ckpt.symlink_to(outside / "checkpoint", target_is_directory=True)
    elif case == "checkpoints_folder_symlink_out":
        shutil.rmtree(run_dir / "checkpoints")
        (run_dir / "checkpoints").symlink_to(outside, target_is_directory=True)
    elif case in ("adapter_symlink_out", "optimizer_symlink_out", "trainer_symlink_out", "rng_symlink_out"):
        name = {"adapter": "adapter.safetensors", "optimizer": "optimizer.pt", "trainer": "trainer.json",
                "rng": "rng.pt"}[case.split("_")[0]]
        (ckpt / name).unlink()
        (ckpt / name).symlink_to(outside / "checkpoint" / name)
    elif case == "pointer_symlink_out":
        latest.unlink()
        latest.symlink_to(outside / "latest.json")
    elif case == "config_symlink_out":
        (run_dir / "config.json").unlink()
        (run_dir / "config.json").symlink_to(outside / "run" / "config.json")
    elif case == "pointer_not_json":
        pointer("{not json")
    elif case == "pointer_nan_step":
        pointer('{"step": NaN, "checkpoint": "checkpoints/step_00000001"}')
    elif case == "pointer_string_step":
        pointer({"step": "1", "checkpoint": "checkpoints/step_00000001"})
    elif case == "pointer_negative_step":
        pointer({"step": -1, "checkpoint": "checkpoints/step_00000001"})
    elif case == "pointer_step_mismatch":
        pointer({"step": 5, "checkpoint": "checkpoints/step_00000001"})
    elif case == "pointer_is_folder":
        latest.unlink()
        latest.mkdir()
    elif case == "pointer_huge":
        pointer(json.dumps({"step": 1, "checkpoint": "checkpoints/step_00000001", "pad": "x" * (1 << 17)}))
    elif case == "pointer_array":
        pointer([1, "checkpoints/step_00000001"])
    elif case == "pointer_missing_folder":
        pointer({"step": 7, "checkpoint": "checkpoints/step_00000007"})
    elif case == "pointer_nul":
        pointer({"step": 1, "checkpoint": "checkpoints/step_00000001\u0000x"})
    elif case == "trainer_not_json":
        (ckpt / "trainer.json").write_text("[[[")
    elif case == "trainer_step_mismatch":
        (ckpt / "trainer.json").write_text(json.dumps({"step": 9, "micro_step": 9, "loss_history": [],
                                                       "validation_history": []}))
    elif case == "trainer_history_junk":
        (ckpt / "trainer.json").write_text(json.dumps({"step": 1, "micro_step": 1, "loss_history": "junk",
                                                       "validation_history": []}))
    elif case == "adapter_truncated":
        data = (ckpt / "adapter.safetensors").read_bytes()
        (ckpt / "adapter.safetensors").write_bytes(data[:len(data) // 2])
    elif case == "adapter_wrong_shape":
        key = sorted(adapter)[0]
        adapter[key] = torch.zeros(adapter[key].shape[0] + 1, *adapter[key].shape[1:])
        save_file(adapter, str(ckpt / "adapter.safetensors"))
    elif case == "adapter_extra_key":
        adapter["evil.weight"] = torch.zeros(2)
        save_file(adapter, str(ckpt / "adapter.safetensors"))
    elif case == "adapter_missing_key":
        adapter.pop(sorted(adapter)[0])
        save_file(adapter, str(ckpt / "adapter.safetensors"))
    elif case == "adapter_wrong_dtype":
        save_file({k: v.half() for k, v in adapter.items()}, str(ckpt / "adapter.safetensors"))
    elif case == "optimizer_pickle_payload":
        torch.save({"optimizer": Payload(), "scheduler": {}, "scaler": None}, ckpt / "optimizer.pt")
    elif case == "optimizer_wrong_shapes":
        states = _state(run_dir)
        for entry in states["optimizer"]["state"].values():
            entry["exp_avg"] = torch.zeros(3)
        torch.save(states, ckpt / "optimizer.pt")
    elif case == "optimizer_empty":
        (ckpt / "optimizer.pt").write_bytes(b"")
    elif case == "scheduler_unknown_field":
        states = _state(run_dir)
        states["scheduler"]["optimizer"] = "hijack"
        torch.save(states, ckpt / "optimizer.pt")
    elif case == "rng_wrong_shape":
        torch.save({"torch": torch.zeros(7, dtype=torch.uint8)}, ckpt / "rng.pt")
    elif case == "rng_pickle_payload":
        torch.save({"torch": Payload()}, ckpt / "rng.pt")
    elif case == "config_not_json":
        (run_dir / "config.json").write_text("{{")
    elif case == "config_nan":
        text = (run_dir / "config.json").read_text().replace('"max_grad_norm": 1.0', '"max_grad_norm": NaN')
        (run_dir / "config.json").write_text(text)
    elif case == "config_missing_with_checkpoints":
        (run_dir / "config.json").unlink()
    elif case == "config_other_settings":
        config = json.loads((run_dir / "config.json").read_text())
        config["session"]["adapter"]["rank"] = 64
        (run_dir / "config.json").write_text(json.dumps(config))
    elif case == "memory_record_symlink_out":
        (run_dir / "memory_record.json").unlink()
        (run_dir / "memory_record.json").symlink_to(outside / "secret.txt")
    elif case == "memory_record_junk":
        (run_dir / "memory_record.json").write_text('{"format": "headroom-memory-record", "phases": 5}')
    elif case == "run_folder_symlink_out":
        shutil.rmtree(run_dir)
        run_dir.symlink_to(outside / "run", target_is_directory=True)
    else:
        raise AssertionError(case)


# case -> what the refusal names (None: a report ignored with a warning, the run resumes)
POINTER_CASES = {
    "pointer_absolute": "latest.json", "pointer_dotdot": "latest.json", "pointer_through_checkpoints": "latest.json",
    "pointer_other_run": "latest.json", "checkpoint_folder_symlink_out": "latest.json",
    "checkpoints_folder_symlink_out": "latest.json", "adapter_symlink_out": "adapter.safetensors",
    "optimizer_symlink_out": "optimizer.pt", "trainer_symlink_out": "trainer.json", "rng_symlink_out": "rng.pt",
    "pointer_symlink_out": "latest.json", "config_symlink_out": "config.json", "pointer_not_json": "latest.json",
    "pointer_nan_step": "latest.json", "pointer_string_step": "latest.json", "pointer_negative_step": "latest.json",
    "pointer_step_mismatch": "latest.json", "pointer_is_folder": "latest.json", "pointer_huge": "latest.json",
    "pointer_array": "latest.json", "pointer_missing_folder": "trainer.json", "pointer_nul": "latest.json",
    "trainer_not_json": "trainer.json", "trainer_step_mismatch": "trainer.json", "trainer_history_junk": "trainer.json",
    "adapter_truncated": "adapter.safetensors", "adapter_wrong_shape": "does not fit",
    "adapter_extra_key": "does not fit", "adapter_missing_key": "does not fit", "adapter_wrong_dtype": "does not fit",
    "optimizer_pickle_payload": "optimizer.pt", "optimizer_wrong_shapes": "does not fit",
    "optimizer_empty": "optimizer.pt", "scheduler_unknown_field": "does not fit", "rng_wrong_shape": "rng.pt",
    "rng_pickle_payload": "rng.pt", "config_not_json": "config.json", "config_nan": "config.json",
    "config_missing_with_checkpoints": "no config.json", "config_other_settings": "different configuration",
    "run_folder_symlink_out": "outside", "memory_record_symlink_out": None, "memory_record_junk": None,
}


@pytest.mark.parametrize("case", list(POINTER_CASES))
def test_hostile_run_folder_files_are_refused(world, case, tmp_path, caplog):
    """A run folder copied from a good one, one file edited as any HTTP client could (uploads land in output/):
    resuming it is a clear error naming the file, or (a report) a warning; nothing outside is read, no code runs."""
    from test_train_lora_nodes import _init

    from headroom.nodes.bridge.model_files import runs_root

    name = f"hostile_{case}"
    run_dir = runs_root() / name
    shutil.copytree(world["template"], run_dir, symlinks=True)
    Payload.marker = str(tmp_path / "payload_ran")
    _tamper(world, case, run_dir)
    expected = POINTER_CASES[case]
    with _watch(world):
        if expected is None:
            run = _init(world["model"], world["latents"], world["texts"], name, rank=4, batch_size=2)
            assert run.step == 1 and "ignoring the unreadable memory record" in caplog.text
        else:
            with pytest.raises((ValueError, RuntimeError)) as error:
                _init(world["model"], world["latents"], world["texts"], name, rank=4, batch_size=2)
            message = clear_error(error.value, "Train LoRA: Init (Headroom): ", expected)
            assert "run folder" in message or "new run name" in message or "run name" in message, message
    assert not os.path.exists(Payload.marker), "an unpickled payload ran"


# A run folder's memory_record.json as anyone could upload it (POST /upload/image, type=output), or pasted into
# HeadroomMemoryReport's record_json: each is ignored with a warning naming the file (a run), or refused (a paste).
_GOOD_PHASE = {"phase": "training", "seconds": 1.5, "completed": True, "device": "cuda:0", "cuda": True,
               "peak_rss_bytes": 2**30, "peak_rss_scope": "phase", "peak_allocated_bytes": 2**20,
               "peak_reserved_bytes": 2**21}


def _record(**phase_fields) -> str:
    phase = {k: v for k, v in {**_GOOD_PHASE, **phase_fields}.items() if v is not _MISSING}
    return json.dumps({"format": "headroom.memory_record", "version": 1, "device": "cpu", "phases": [phase]})


_MISSING = object()
HOSTILE_MEMORY_RECORDS = {
    "nested_brackets": "[" * 100_000,
    "nested_objects": '{"a":' * 100_000,
    "nan_seconds": _record(seconds=math.nan),  # json.dumps writes NaN
    "huge_seconds": _record(seconds=1.0).replace('"seconds": 1.0', '"seconds": 1e999'),
    "infinity_peak": _record().replace(str(2**30), "Infinity"),
    "huge_int": _record(peak_reserved_bytes=10**40),
    "negative_peak": _record(peak_allocated_bytes=-5),
    "string_seconds": _record(seconds="1.5"),
    "string_peak": _record(peak_reserved_bytes="lots"),
    "bool_as_count": _record(peak_rss_bytes=True),
    "missing_seconds": _record(seconds=_MISSING),
    "missing_cuda_peak": _record(peak_allocated_bytes=_MISSING),
    "phase_not_string": _record(phase=5),
    "phase_list": _record(phase=["x"] * 3),
    "junk_device": _record(device="warp drive"),
    "unknown_field": _record(evil="x" * 1000),
    "record_device_junk": _record().replace('"device": "cpu"', '"device": 7'),
    # the run's warnings (the driver's memory fallback, training/memory/fallback.py) are read back too
    "warnings_not_list": _record().replace('"phases"', '"warnings": "spilled", "phases"'),
    "warning_nan": _record().replace('"phases"', '"warnings": [{"kind": "slowdown", "message": "m", '
                                     '"recent_s_per_step": NaN}], "phases"'),
    "warning_unknown_kind": _record().replace('"phases"', '"warnings": [{"kind": "evil", "message": "m"}], "phases"'),
    "warning_huge_message": _record().replace('"phases"', '"warnings": [{"kind": "spill", "message": "'
                                              + "x" * 5000 + '"}], "phases"'),
    # the plan's predicted s/step beside the measured one (PhaseRecorder.step_time)
    "step_time_nan": _record().replace('"phases"', '"step_time": {"predicted_s_per_step": NaN, '
                                       '"measured_s_per_step": 1.0, "steps": 2}, "phases"'),
    "step_time_negative": _record().replace('"phases"', '"step_time": {"predicted_s_per_step": 1.0, '
                                            '"measured_s_per_step": -1.0, "steps": 2}, "phases"'),
    "step_time_unknown_field": _record().replace('"phases"', '"step_time": {"predicted_s_per_step": 1.0, '
                                                 '"measured_s_per_step": 1.0, "steps": 2, "evil": 1}, "phases"'),
    "step_time_not_object": _record().replace('"phases"', '"step_time": "fast", "phases"'),
}


@pytest.mark.parametrize("case", list(HOSTILE_MEMORY_RECORDS))
def test_hostile_memory_record_is_ignored_on_resume_and_later_records_write(world, case, caplog):
    """Resuming a run whose memory_record.json is hostile: a warning naming the file, a new record, and every later
    phase record is written again (a NaN kept in the record made each write fail)."""
    from test_train_lora_nodes import _init

    from headroom.nodes.bridge.model_files import runs_root
    from headroom.training.memory.memory_stats import PhaseRecorder

    name = f"hostile_memory_{case}"
    run_dir = runs_root() / name
    shutil.copytree(world["template"], run_dir, symlinks=True)
    (run_dir / "memory_record.json").write_text(HOSTILE_MEMORY_RECORDS[case])
    run = _init(world["model"], world["latents"], world["texts"], name, rank=4, batch_size=2)
    assert run.step == 1
    warning = next(r.getMessage() for r in caplog.records if "memory record" in r.getMessage())
    assert "ignoring the unreadable memory record memory_record.json" in warning and name in warning, warning
    with run.phase("validation"):
        pass
    assert "could not" not in caplog.text and "not JSON compliant" not in caplog.text
    written = PhaseRecorder.from_json((run_dir / "memory_record.json").read_text())
    assert [p["phase"] for p in written.phases] == [p["phase"] for p in run.memory.phases]
    assert written.phases[-1]["phase"] == "validation"


@pytest.mark.parametrize("case", list(HOSTILE_MEMORY_RECORDS))
def test_hostile_memory_record_json_is_refused_by_the_memory_report(comfyui, case):
    from headroom.nodes.monitor import HeadroomMemoryReport

    with pytest.raises(ValueError) as error:
        HeadroomMemoryReport.execute(record_json=HOSTILE_MEMORY_RECORDS[case])
    message = clear_error(error.value, "Memory Report (Headroom)", "memory record")
    assert len(message) < 600, message


def test_a_good_memory_record_still_renders(comfyui):
    from headroom.nodes.monitor import HeadroomMemoryReport

    text = HeadroomMemoryReport.execute(record_json=_record()).result[0]
    assert "training [blue]" in text and "peak allocated 1.0 MiB" in text


# --- 5. cache manifests ---------------------------------------------------------------------------------------------
def _cache_dataset(world):
    from headroom.nodes.cache import HeadroomDatasetFromImages

    images = torch.stack([torch.full((32, 32, 3), 0.1 * (i + 1)) for i in range(2)])
    with torch.inference_mode():
        return HeadroomDatasetFromImages.execute(images, "one\ntwo", 32, 32, "center", False, 0).args[0]


MANIFEST_CASES = ["shard_dotdot", "shard_absolute", "shard_symlink_out", "manifest_not_json", "manifest_nan",
                  "entries_not_dict", "bytes_string", "digest_not_hex", "manifest_symlink_out", "key_not_hex"]


@pytest.mark.parametrize("case", MANIFEST_CASES)
def test_hostile_cache_manifests_are_ignored_and_rebuilt(world, case, tmp_path):
    """An edited manifest or shard is never followed out of the cache folder: its entries are encoded again,
    and the caching summary says so."""
    import folder_paths

    from headroom.nodes.cache import HeadroomCacheLatents

    root = world["base"] / "models" / f"hostile_cache_{case}"
    world["patch"].setitem(folder_paths.folder_names_and_paths, "headroom_cache", ([str(root)], set()))
    dataset = _cache_dataset(world)
    with torch.inference_mode():
        HeadroomCacheLatents.execute(dataset, world["vae"])
    manifest_path = root / "latents" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    key, entry = next(iter(manifest["entries"].items()))
    if case == "shard_dotdot":
        entry["shard"] = "../../../" + os.path.relpath(world["outside"] / "outside.safetensors", root.parent)
    elif case == "shard_absolute":
        entry["shard"] = str(world["outside"] / "outside.safetensors")
    elif case == "shard_symlink_out":
        shard = root / "latents" / "shards" / entry["shard"]
        shard.unlink()
        shard.symlink_to(world["outside"] / "outside.safetensors")
    elif case == "manifest_not_json":
        manifest = "{{{"
    elif case == "manifest_nan":
        manifest = json.dumps(manifest).replace(f'"bytes": {entry["bytes"]}', '"bytes": NaN', 1)
    elif case == "entries_not_dict":
        manifest["entries"] = ["x"]
    elif case == "bytes_string":
        entry["bytes"] = "12"
    elif case == "digest_not_hex":
        entry["tensors"] = {"latent": "../../etc/passwd"}
    elif case == "manifest_symlink_out":
        (world["outside"] / "manifest.json").write_text(json.dumps(manifest))
        manifest = None
        manifest_path.unlink()
        manifest_path.symlink_to(world["outside"] / "manifest.json")
    elif case == "key_not_hex":
        manifest["entries"]["../" + key] = manifest["entries"].pop(key)
    if manifest is not None:
        manifest_path.write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    with _watch(world), torch.inference_mode():
        cache, summary = HeadroomCacheLatents.execute(dataset, world["vae"]).args
    assert len(cache) == 2 and ("1 encoded" in summary or "2 encoded" in summary), summary
    assert "warning" in summary, summary  # listed: what was wrong, and that it is encoded again
    clear_error(RuntimeError(summary))


@pytest.mark.parametrize("cache, case", [("text", "deleted"), ("text", "replaced"), ("latents", "replaced")])
def test_a_shard_changed_after_caching_stops_training_naming_it_and_the_node_to_run(world, cache, case):
    """A shard deleted, or replaced by a file without the entries its cache lists, after the caching node checked it
    (the run's caches are ComfyUI's outputs of an earlier prompt): the next training step stops with an error naming
    the shard and the caching node that rebuilds it, not safetensors' own, and the run keeps its last step."""
    import folder_paths
    from safetensors.torch import save_file

    from test_train_lora_nodes import _data, _init

    from headroom.nodes import train_lora as T
    from headroom.training.data.cache_store import CacheStoreError

    root = world["base"] / "models" / f"changed_shard_{cache}_{case}"
    world["patch"].setitem(folder_paths.folder_names_and_paths, "headroom_cache", ([str(root)], set()))
    model, _, _, latents, texts = _data("sd15")
    run = _init(model, latents, texts, f"changed_shard_{cache}_{case}", rank=4, batch_size=2)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 1, checkpoint_minutes=0.0)
    shards = sorted((root / cache / "shards").glob("*.safetensors"))
    assert shards
    for shard in shards:
        if case == "deleted":
            shard.unlink()
        else:
            save_file({"x": torch.zeros(1)}, str(shard))
    with pytest.raises(CacheStoreError) as raised, torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 3, checkpoint_minutes=0.0)
    said = str(raised.value)
    node = {"text": "Cache Text (Headroom)", "latents": "Cache Latents (Headroom)"}[cache]
    assert said.startswith(f"cache shard models/changed_shard_{cache}_{case}/{cache}/shards/") and \
        said.endswith(f"; run {node} again to rebuild it"), said
    assert ("cannot be read (No such file or directory)" if case == "deleted" else
            "the file changed after it was cached") in said, said
    assert "File does not contain tensor" not in said  # safetensors' own words, with the entry's 64-digit key
    assert run.step == run.trainer.saved_step == 1  # the last completed step on disk
    clear_error(raised.value)


# --- 6. NaN and infinity in every float input ---------------------------------------------------------------------------
def _as_run(node_cls):
    """The class as ComfyUI's executor calls it: a copy (execution.py: PREPARE_CLASS_CLONE), named '...Clone'."""
    return node_cls.PREPARE_CLASS_CLONE(None)


def _float_call(world, node: str, name: str, value: float):
    from test_train_lora_nodes import _init
    from test_controlnet_training import _init_inputs

    from headroom.nodes import cache as C
    from headroom.nodes import memory as M
    from headroom.nodes import train_controlnet as CN
    from headroom.nodes import train_lora as T

    run = world["run"]
    if node == "HeadroomLoraConfig":
        inputs = dict(kind="lora", rank=4, alpha=4.0, targets="preset", include_conv=False, dropout=0.0, init_seed=0)
        return _as_run(T.HeadroomLoraConfig).execute(**{**inputs, name: value})
    if node == "HeadroomOptimizerConfig":
        inputs = dict(optimizer="AdamW", learning_rate=1e-3, weight_decay=0.0, schedule="constant", warmup_steps=0,
                      schedule_steps=10)
        return _as_run(T.HeadroomOptimizerConfig).execute(**{**inputs, name: value})
    if node == "HeadroomTrainLoraInit":
        return _init(world["model"], world["latents"], world["texts"], f"nan_{name}", **{name: value})
    if node == "HeadroomTrainControlNetInit":
        inputs = _init_inputs(world["model"], world["latents"], world["texts"], f"nan_cn_{name}")
        return _as_run(CN.HeadroomTrainControlNetInit).execute(**{**inputs, name: value})
    if node == "HeadroomTrainSteps":
        return _as_run(T.HeadroomTrainSteps).execute(run, 2, **{name: value})
    if node == "HeadroomValidate":
        return _as_run(T.HeadroomValidate).execute(run, clip=world["clip"], vae=world["vae"], prompts="", negative="",
                                          sample_seed=0, sample_steps=1, sampler_name="euler", scheduler="normal",
                                          width=32, height=32, loss_timesteps=1, **{"cfg": 1.0, name: value})
    if node == "HeadroomApplyTrainedLora":
        return _as_run(T.HeadroomApplyTrainedLora).execute(world["model"], run, value)
    if node == "HeadroomExtractLora":
        return _as_run(T.HeadroomExtractLora).execute(run, 8, value, "headroom", "", "fp32")
    if node == "HeadroomResizeLora":  # checked before the file is looked for
        return _as_run(T.HeadroomResizeLora).execute("none.safetensors", 8, value, "headroom", "", "auto")
    if node == "HeadroomMergeLoras":  # checked before the files are looked for
        strengths = {f"strength_{index}": 1.0 for index in range(1, 5)}
        inputs = {"rank": 0, "energy": 0.0, **strengths, name: value}
        return _as_run(T.HeadroomMergeLoras).execute(world["model"], subfolder="headroom", filename="", dtype="auto",
                                                     lora_1="none.safetensors", **inputs)
    if node == "HeadroomOffloadPolicy":
        inputs = dict(vram_budget_gb=0.0, reserve_gb=1.0, base_placement="resident", base_storage="as_loaded",
                      checkpointing="off", checkpoint_depth=1, optimizer_state="gpu",
                      park_optimizer_during_validation=True, vae_tiled_decode="auto", encoders="unload_after_use")
        return _as_run(M.HeadroomOffloadPolicy).execute(**{**inputs, name: value})
    if node == "HeadroomTrainLora":  # checked first, before the run is built from the other inputs
        return _as_run(T.HeadroomTrainLora).execute(steps=2, validate_every=0, save_every=0, lora_subfolder="x",
                                           **{"checkpoint_minutes": 1.0, name: value})
    if node == "HeadroomCacheText":  # checked before anything is encoded
        dataset = C.HeadroomDatasetFromImages.execute(torch.rand(1, 32, 32, 3), "a, b, c", 32, 32, "center", False,
                                                      0).args[0]
        return _as_run(C.HeadroomCacheText).execute(dataset, world["clip"], tag_shuffles=4, tag_dropout=value)
    if node == "HeadroomDatasetFromVideos":  # checked before the folder is looked at
        return _as_run(C.HeadroomDatasetFromVideos).execute(folder="", resolution=64, step=16, crop="center", flip=False,
                                                   seed=0, skip_bad=False, frame_rate=value)
    raise AssertionError(node)


FLOAT_INPUTS = [("HeadroomLoraConfig", "alpha"), ("HeadroomLoraConfig", "dropout"),
                ("HeadroomOptimizerConfig", "learning_rate"), ("HeadroomOptimizerConfig", "weight_decay"),
                ("HeadroomOptimizerConfig", "loraplus_lr_ratio"), ("HeadroomOptimizerConfig", "scale_weight_norms"),
                ("HeadroomTrainLoraInit", "max_grad_norm"), ("HeadroomTrainLoraInit", "caption_dropout"),
                ("HeadroomTrainLoraInit", "min_snr_gamma"), ("HeadroomTrainLoraInit", "noise_offset"),
                ("HeadroomTrainLoraInit", "noise_min"), ("HeadroomTrainLoraInit", "noise_max"),
                ("HeadroomTrainLoraInit", "huber_delta"), ("HeadroomTrainControlNetInit", "huber_delta"),
                ("HeadroomTrainLoraInit", "ema_decay"), ("HeadroomTrainControlNetInit", "ema_decay"),
                ("HeadroomTrainLoraInit", "prior_ratio"),
                ("HeadroomTrainControlNetInit", "max_grad_norm"), ("HeadroomTrainControlNetInit", "caption_dropout"),
                ("HeadroomTrainControlNetInit", "min_snr_gamma"), ("HeadroomTrainControlNetInit", "noise_offset"),
                ("HeadroomTrainControlNetInit", "validation_strength"), ("HeadroomTrainSteps", "checkpoint_minutes"),
                ("HeadroomValidate", "cfg"), ("HeadroomApplyTrainedLora", "strength"), ("HeadroomExtractLora", "energy"),
                ("HeadroomResizeLora", "energy"), ("HeadroomMergeLoras", "energy"),
                *(("HeadroomMergeLoras", f"strength_{index}") for index in range(1, 5)),
                ("HeadroomOffloadPolicy", "vram_budget_gb"), ("HeadroomOffloadPolicy", "reserve_gb"),
                ("HeadroomOffloadPolicy", "host_ram_budget_gb"),
                ("HeadroomTrainLora", "checkpoint_minutes"), ("HeadroomValidate", "frame_rate"),
                ("HeadroomTrainLora", "frame_rate"), ("HeadroomDatasetFromVideos", "frame_rate"),
                ("HeadroomCacheText", "tag_dropout"), ("HeadroomTrainLoraInit", "masked_out_weight"),
                ("HeadroomTrainControlNetInit", "masked_out_weight"), ("HeadroomTrainLoraInit", "ip_noise_gamma"),
                ("HeadroomTrainControlNetInit", "ip_noise_gamma"), ("HeadroomTrainLoraInit", "multires_noise_discount"),
                ("HeadroomTrainControlNetInit", "multires_noise_discount"),
                ("HeadroomTrainLoraInit", "text_encoder_lr")]


def display_name(node_id: str) -> str:
    """The name the editor shows for node `node_id`."""
    from headroom.nodes import _NODE_MODULES

    return next(schema.display_name for module in _NODE_MODULES for schema in map(lambda n: n.define_schema(), module.NODES)
                if schema.node_id == node_id)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("node,name", FLOAT_INPUTS, ids=[f"{n}.{i}" for n, i in FLOAT_INPUTS])
def test_nan_and_infinity_are_refused_naming_the_input(world, node, name, value):
    from headroom.nodes.bridge.model_files import runs_root

    before = sorted(os.listdir(runs_root()))
    with _watch(world), pytest.raises(ValueError) as error:
        _float_call(world, node, name, value)
    # Named as users see it, by the display name (never the class id, nor its running copy's 'HeadroomValidateClone').
    message = clear_error(error.value, f"{display_name(node)}: {name}=", "not a finite number")
    assert "Clone" not in message, message
    assert sorted(os.listdir(runs_root())) == before, "a run folder (config.json with NaN) was written"


def test_the_float_inputs_listed_here_are_all_there_are(comfyui):
    """Every FLOAT input of every Headroom node is among FLOAT_INPUTS (a new one must be checked too)."""
    from comfy_api.latest import io

    from headroom.nodes import _NODE_MODULES

    declared = set()
    for module in _NODE_MODULES:
        for node in module.NODES:
            schema = node.define_schema()
            declared |= {(schema.node_id, item.id) for item in schema.inputs if isinstance(item, io.Float.Input)}
    # The all-in-one nodes take their Init's / Validate's inputs: the same checks.
    listed = set(FLOAT_INPUTS) | {(all_in_one, n) for _, n in FLOAT_INPUTS
                                  for all_in_one in ("HeadroomTrainLora", "HeadroomTrainControlNet")}
    assert declared <= listed, f"FLOAT inputs not checked here: {sorted(declared - listed)}"
    assert declared, "no FLOAT inputs found: the schema walk is wrong"
