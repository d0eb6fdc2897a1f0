"""Every write path of Headroom meeting a full disk, as scenarios shared by two tests:

- tests/comfy/test_reliability_faults.py::test_injected_enospc_in_every_write_path: in-process, each scenario's target
  file alone sits on a full disk (tests/faults.py: a real ENOSPC from /dev/full);
- tests/comfy/test_reliability_faults.py::test_disk_full_on_a_real_tmpfs: in a child process (tests/fault_worker.py)
  with its own mount namespace, ComfyUI's output / loras / cache folders on a small tmpfs that is filled up.

Each scenario writes its earlier files with room (`prepare`), then does the one write that meets the full disk
(`act`). Checked every time: one DiskFullError that names what was written, where (relative to ComfyUI's folders,
no absolute path) and how much it needs; every earlier file byte-identical; no temp file or folder left; and,
with room again, queueing again works (`again`), a re-queued training run saving the step it could not save.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import pathlib
from typing import Callable

import torch

from faults import leftovers, snapshot


@dataclasses.dataclass
class Context:
    """The models and caches (tiny SD1.5, from tests/comfy/test_train_lora_nodes.py _data) and the folders written."""

    model: object
    clip: object
    vae: object
    latents: object
    texts: object
    images: torch.Tensor  # images that are not cached yet: a cache scenario encodes them
    base: pathlib.Path  # absolute paths must never show in a message; everything is under it
    state: dict = dataclasses.field(default_factory=dict)

    def folders(self) -> list[pathlib.Path]:
        """What a scenario may touch: its run folder, the LoRA subfolder it saves to, the cache."""
        import folder_paths

        from headroom.nodes.bridge.cache_folders import cache_root
        from headroom.nodes.bridge.model_files import runs_root

        loras = pathlib.Path(folder_paths.get_folder_paths("loras")[0]) / "disk_full"
        return [runs_root() / self.state["tag"], loras, cache_root()]


@dataclasses.dataclass
class Case:
    name: str
    pattern: str  # injected: new files whose name contains this meet the full disk
    prepare: Callable[[Context], None]
    act: Callable[[Context], None]
    again: Callable[[Context], None] | None
    what: str  # the message names this
    raises: bool = True  # False: a report whose write may fail with a warning only (the memory record)
    # Files `act` may rewrite before the failing write: the memory record after each phase, and (validation)
    # the checkpoint of the validation loss, whose rotation removes the older copy of the step.
    volatile: tuple[str, ...] = ("memory_record.json",)
    injected: bool = True  # False: a real full disk only (what the scenario meets is the free space, not a write)
    node: str = ""  # the node whose error it is, where its message starts with the node's name


def _run(ctx: Context, name: str, steps: int = 0):
    from test_train_lora_nodes import _init

    from headroom.nodes import train_lora as T

    run = _init(ctx.model, ctx.latents, ctx.texts, name, rank=4, batch_size=2)
    if steps:
        with torch.inference_mode():
            T.HeadroomTrainSteps.execute(run, steps, checkpoint_minutes=0.0)
    ctx.state["run"] = run
    return run


def _train(ctx: Context, steps: int, **cadence):
    from headroom.nodes import train_lora as T

    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(ctx.state["run"], steps, **{"checkpoint_minutes": 0.0, **cadence})


def _requeue_saves(steps: int):
    def again(ctx: Context) -> None:
        from headroom.training.core.run_dir import RunDir

        run = ctx.state["run"]
        _train(ctx, steps)  # the same "train to N" again: nothing to train, but step N is not on disk yet
        assert run.step == steps and RunDir(run.run_dir.root, run.run_dir.name).latest_step() == steps
    return again


def _validate(ctx: Context) -> None:
    from headroom.nodes import train_lora as T

    with torch.inference_mode():
        T.HeadroomValidate.execute(ctx.state["run"], clip=ctx.clip, vae=ctx.vae, prompts="a red circle",
                                   negative="", sample_seed=0, sample_steps=1, cfg=1.0, sampler_name="euler",
                                   scheduler="normal", width=32, height=32, loss_timesteps=1)


def _save_lora(ctx: Context) -> None:
    from headroom.nodes import train_lora as T

    T.HeadroomSaveLora.execute(ctx.state["run"], "disk_full", ctx.state["lora_name"], "fp32")


def _cache(ctx: Context, kind: str) -> None:
    from headroom.nodes import cache as C

    count = ctx.images.shape[0]
    captions = "\n".join(f"disk full caption {i} {ctx.state['tag']}" for i in range(count))
    with torch.inference_mode():
        dataset = C.HeadroomDatasetFromImages.execute(ctx.images, captions, 32, 32, "center", False, 0).args[0]
        if kind == "latents":
            C.HeadroomCacheLatents.execute(dataset, ctx.vae)
        else:
            C.HeadroomCacheText.execute(dataset, ctx.clip)


def _tag(ctx: Context, name: str) -> str:
    """A fresh name per scenario run (the in-process test shares one ComfyUI base across scenarios)."""
    ctx.state["tag"] = f"{name}_{os.getpid()}_{len(ctx.state.get('tags', []))}"
    ctx.state.setdefault("tags", []).append(ctx.state["tag"])
    return ctx.state["tag"]


def _fresh_images(ctx: Context) -> None:
    ctx.images = ctx.images.clone()
    ctx.images[:, 1, 1, 1] = torch.rand(ctx.images.shape[0])  # not cached yet: this scenario must encode them


_VALIDATION_REWRITES = ("memory_record.json", "latest.json", "/checkpoints/")
CASES = [
    Case("run config", "config.json", lambda c: _tag(c, "config"), lambda c: _run(c, c.state["tag"]),
         lambda c: _run(c, c.state["tag"]), "configuration of run"),
    # On a full disk Init refuses before writing anything: not even one checkpoint of the run fits
    # (nodes/bridge/model_files.check_disk_room).
    Case("room for checkpoints", "", lambda c: _tag(c, "room"), lambda c: _run(c, c.state["tag"]),
         lambda c: _run(c, c.state["tag"]), "the checkpoints of run", injected=False),
    Case("checkpoint weights", "adapter.safetensors", lambda c: _run(c, _tag(c, "weights"), 2),
         lambda c: _train(c, 3), _requeue_saves(3), "checkpoint of run"),
    Case("checkpoint optimizer state", "optimizer.pt", lambda c: _run(c, _tag(c, "optimizer"), 2),
         lambda c: _train(c, 3), _requeue_saves(3), "checkpoint of run"),
    Case("checkpoint RNG state", "rng.pt", lambda c: _run(c, _tag(c, "rng"), 2),
         lambda c: _train(c, 3), _requeue_saves(3), "checkpoint of run"),
    Case("checkpoint trainer state", "trainer.json", lambda c: _run(c, _tag(c, "trainer"), 2),
         lambda c: _train(c, 3), _requeue_saves(3), "checkpoint of run"),
    Case("checkpoint pointer", "latest.json", lambda c: _run(c, _tag(c, "pointer"), 2),
         lambda c: _train(c, 3), _requeue_saves(3), "checkpoint pointer of run"),
    Case("periodic checkpoint", "adapter.safetensors", lambda c: _run(c, _tag(c, "periodic"), 1),
         lambda c: _train(c, 6, checkpoint_every=2), lambda c: _train(c, 6), "checkpoint of run"),
    Case("memory record", "memory_record.json", lambda c: _run(c, _tag(c, "record"), 1),
         lambda c: _train(c, 2), None, "memory record", raises=False),
    Case("validation grid", ".png", lambda c: _run(c, _tag(c, "grid"), 1), _validate, _validate,
         "validation grid of run", volatile=_VALIDATION_REWRITES),
    Case("validation latents", "_latents.safetensors", lambda c: _run(c, _tag(c, "latents"), 1), _validate,
         _validate, "validation latents of run", volatile=_VALIDATION_REWRITES),
    Case("LoRA file", "lora_out", lambda c: (_run(c, _tag(c, "lora"), 1), c.state.update(lora_name=f"lora_out_{c.state['tag']}")),
         _save_lora, _save_lora, "LoRA lora_out", node="Save LoRA (Headroom)"),
    Case("latent cache shard", ".safetensors", lambda c: (_tag(c, "shard"), _fresh_images(c)),
         lambda c: _cache(c, "latents"), lambda c: _cache(c, "latents"), "a cache shard"),
    Case("latent cache manifest", "manifest.json", lambda c: (_tag(c, "manifest"), _fresh_images(c)),
         lambda c: _cache(c, "latents"), lambda c: _cache(c, "latents"), "the cache manifest"),
    Case("text cache shard", ".safetensors", lambda c: _tag(c, "text"), lambda c: _cache(c, "text"),
         lambda c: _cache(c, "text"), "a cache shard"),
]
# On a real full disk every write fails, so only scenarios whose target is the first write of `act` apply (Init's
# first is the run config, but on a full disk it refuses before it: "room for checkpoints").
TMPFS_CASES = ["room for checkpoints", "checkpoint weights", "periodic checkpoint", "LoRA file",
               "latent cache shard", "text cache shard"]


# The run's TensorBoard log (training/core/scalar_log.py) grows by a record per step: what it held must stay as it was.
_APPENDED_TO = "/tensorboard/events.out.tfevents."


def run_case(case: Case, ctx: Context, full_disk: Callable[[Case], contextlib.AbstractContextManager]) -> str:
    """Run one scenario with `full_disk(case)` around its `act`; returns the error message (assertions inside)."""
    from headroom.training.data.files import DiskFullError

    case.prepare(ctx)
    folders = ctx.folders()
    before = snapshot(*folders)
    message = ""
    with full_disk(case):
        if case.raises:
            try:
                case.act(ctx)
            except DiskFullError as error:
                message = str(error)
            else:
                raise AssertionError(f"{case.name}: no DiskFullError")
        else:
            case.act(ctx)
    if case.raises:
        said_by = f"{case.node}: " if case.node else ""
        assert message.startswith(f"{said_by}disk full: ") and case.what in message, message
        assert "needs about" in message and "queue again" in message, message
        assert str(ctx.base) not in message and "/tmp/" not in message, f"absolute path in: {message}"
    after = snapshot(*folders)
    changed = [path for path, data in before.items()
               if after.get(path) != data and not any(part in path for part in case.volatile)
               and not (_APPENDED_TO in path and after.get(path, b"").startswith(data))]
    if case.raises:
        assert not changed, f"{case.name}: earlier files changed or lost: {changed}"
    else:  # the report was not rewritten, but the checkpoint files of the step trained meanwhile are new
        assert not [p for p in changed if p.endswith("memory_record.json")], changed
    assert not leftovers(*folders), f"{case.name}: temp files left: {leftovers(*folders)}"
    if "run" in ctx.state and ctx.state["run"].run_dir.name == ctx.state["tag"]:
        from headroom.training.core.run_dir import RunDir

        run = ctx.state["run"]
        RunDir(run.run_dir.root, run.run_dir.name).load_checkpoint()  # what latest.json names still loads
    if case.again is not None:
        case.again(ctx)
    return message


# --- a real tmpfs (tests/fault_worker.py job "disk_full") ---------------------------------------------------------
def run_on_tmpfs(state: dict, args: dict, log) -> None:
    """In a forked child: a mount namespace of its own, a tmpfs of `args["size"]`, ComfyUI's output / loras / cache
    folders moved onto it, then each TMPFS_CASES scenario with the tmpfs filled up around its write."""
    import ctypes
    import subprocess

    import folder_paths

    from headroom.nodes.bridge.cache_folders import CACHE_FOLDER_NAME

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS: mounts made here stay in this process
        log(e="skip", reason=f"unshare(CLONE_NEWNS) failed: {os.strerror(ctypes.get_errno())}")
        return
    mount_point = pathlib.Path(args["mount"])
    mount_point.mkdir(parents=True, exist_ok=True)
    for command in (["mount", "--make-rprivate", "/"],
                    ["mount", "-t", "tmpfs", "-o", f"size={args['size']}", "tmpfs", str(mount_point)]):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            log(e="skip", reason=f"{' '.join(command)}: {done.stderr.strip()}")
            return
    folder_paths.set_output_directory(str(mount_point / "output"))
    folder_paths.folder_names_and_paths["loras"] = ([str(mount_point / "loras")], {".safetensors"})
    folder_paths.folder_names_and_paths[CACHE_FOLDER_NAME] = ([str(mount_point / "cache")], set())
    ctx = Context(state["model"], state["clip"], state["vae"], state["latents"], state["texts"],
                  state["images"][:3], base=pathlib.Path(args["base"]))
    filler = mount_point / "filler"

    @contextlib.contextmanager
    def full(case):
        with open(filler, "wb", buffering=0) as handle:  # fill the tmpfs to the last page
            try:
                while True:
                    handle.write(b"\0" * (1 << 16))
                    handle.flush()
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
        try:
            yield
        finally:
            filler.unlink()

    cases = {case.name: case for case in CASES}
    for name in TMPFS_CASES:
        try:
            message = run_case(cases[name], ctx, full)
            log(e="case", name=name, ok=True, message=message)
        except BaseException as error:  # reported to the test, which fails with it
            log(e="case", name=name, ok=False, message=f"{type(error).__name__}: {error}")
