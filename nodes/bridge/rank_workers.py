"""The other ranks of a data-parallel run inside ComfyUI (the training nodes' `devices` input: LoRA and ControlNet,
Init and all-in-one; `open_on_devices`).

Rank 0 is the ComfyUI process. Each other rank is a Python process started here (nodes/bridge/rank_worker_process.py)
that imports ComfyUI as a library, receives the frozen base weights through shared memory (the tensors moved into
shared memory once and passed as file descriptors by torch.multiprocessing's pickler: no second read from disk, no
second copy on a CPU), builds the same ComfyUI model class from the MODEL's own model config, opens the same caches
and run folder with the same function and inputs as rank 0 (plus what the run's strategy hands the other ranks:
a ControlNet run, rank 0's ControlNet weights), and then trains whenever rank 0 trains: rank 0 sends it the target
step before each training call (Train Steps, the all-in-one nodes' stretches between validations).
Validation, saving and sampling run on rank 0 alone while the workers wait.

Cancel: rank 0's interrupt reaches the other ranks at the end of the step (Trainer.train_to agrees on stopping
every step), so every rank stops at the same completed step and rank 0 saves it. A worker that dies makes rank 0's
next collective raise RankLostError naming it; the run fails with its last checkpoint kept. One multi-device run
at a time per ComfyUI process (one process group); opening another run closes the previous run's workers.
"""
from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.connection
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import comfy.model_management as mm
import torch
import torch.multiprocessing  # (registers the shared-memory pickling of tensors)

from ...training.core import distributed
from ...training import os_compat

WORKER_SCRIPT = pathlib.Path(__file__).resolve().parent / "rank_worker_process.py"
DEVICES = ("1", "2", "3", "4", "5", "6", "7", "8")
START_TIMEOUT_S = 300.0  # a worker imports ComfyUI and torch: tens of seconds on a busy machine
COLLECTIVE_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0  # after rank 0 stopped (cancel, error): a worker that has not stopped by then is ended


class RankWorkers:
    """Worker processes for ranks 1..N-1 of one run, and rank 0's side of the process group."""

    active: RankWorkers | None = None

    def __init__(self, world_size: int, model, open_run, run_args: tuple, run_kwargs: dict):
        RankWorkers.close_active()
        device = torch.device(model.load_device)
        if device.type == "cuda" and world_size > torch.cuda.device_count():
            raise ValueError(f"devices={world_size}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        self.world_size = world_size
        self.closed = False
        folder = tempfile.mkdtemp(prefix="headroom-ranks-")
        authkey = multiprocessing.current_process().authkey
        listener = multiprocessing.connection.Listener(os.path.join(folder, "socket"), authkey=authkey)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        package = __name__.rsplit(".nodes.", 1)[0]
        bootstrap = {"comfyui": str(pathlib.Path(sys.modules["comfy"].__path__[0]).parent),
                     "args": vars(sys.modules["comfy.cli_args"].args), "package": package,
                     "package_root": str(pathlib.Path(sys.modules[package].__file__).parent)}
        self.processes, self.connections = [], {}
        try:
            for rank in range(1, world_size):  # the authkey through stdin: a command line is every local user's (ps)
                process = subprocess.Popen([sys.executable, str(WORKER_SCRIPT), listener.address, str(rank),
                                            str(world_size), bootstrap["comfyui"]], stdin=subprocess.PIPE)
                self.processes.append(process)
                process.stdin.write(authkey.hex().encode() + b"\n")
                process.stdin.close()
            listener._listener._socket.settimeout(START_TIMEOUT_S)  # accept() must not wait for a dead worker forever
            for _ in range(1, world_size):
                try:
                    connection = listener.accept()
                except TimeoutError:
                    raise RuntimeError(f"devices={world_size}: the worker ranks did not connect within "
                                       f"{START_TIMEOUT_S:.0f} s; their errors are in the ComfyUI log") from None
                rank = connection.recv()
                self.connections[rank] = connection
                connection.send(bootstrap)
            base = {key: _shared(tensor) for key, tensor in model.model.state_dict().items()}
            # open_run (open_lora_run / open_controlnet_run) travels by its name: the workers import this package
            # under the same name.
            payload = {"init": f"tcp://127.0.0.1:{port}", "timeout": COLLECTIVE_TIMEOUT_S,
                       "model_config": _config_state(model.model.model_config), "base": base, "open_run": open_run,
                       "args": run_args, "kwargs": run_kwargs}
            for connection in self.connections.values():
                connection.send(payload)
            for rank, reply in self._replies("start"):  # a worker that failed to start is seen here, not as a hang
                if reply != ("ready",):
                    raise RuntimeError(f"devices: rank {rank} did not start: {reply}")
            distributed.init(0, world_size, device, init_method=payload["init"], timeout_s=COLLECTIVE_TIMEOUT_S)
        except BaseException:
            self._stop_processes()
            raise
        finally:
            listener.close()  # removes its socket; the folder only held it
            shutil.rmtree(folder, ignore_errors=True)
        RankWorkers.active = self

    def open(self, run) -> None:
        """After rank 0 opened the run (its folder exists): the workers open it too, with what the run's strategy
        hands them (tensors through shared memory), and report its step."""
        extra = {key: {name: _shared(t) for name, t in value.items()} if isinstance(value, dict) else value
                 for key, value in run.trained.for_other_ranks().items()}
        for rank, connection in self.connections.items():
            connection.send(("open", extra))
        for rank, reply in self._replies("open the run"):
            if reply[0] != "opened" or reply[1] != run.step:
                raise RuntimeError(f"devices: rank {rank} opened run '{run.run_dir.name}' at {reply}, rank 0 at step "
                                   f"{run.step}")

    def train(self, target_step: int, checkpoint_every: int, checkpoint_minutes: float) -> None:
        """Before rank 0 trains: every worker trains to the same step (a reply from the last command first)."""
        if self.closed:
            raise ValueError("devices: this run's worker ranks were closed (another run opened in this ComfyUI: one "
                             "multi-device run at a time; or a worker died, or did not stop with a cancel); queue "
                             "its all-in-one node again, or change an input of its Init node (or restart ComfyUI), to "
                             "start them again, and keep other Init nodes out of that workflow")
        if self.awaiting:
            self.replies()  # the previous command's "trained" (the all-in-one nodes train in stretches)
        for connection in self.connections.values():
            connection.send(("train", target_step, checkpoint_every, checkpoint_minutes))
        self.awaiting = True

    def replies(self) -> dict[int, tuple]:
        """Each worker's reply to the last command (waits for it; settle's when it took them)."""
        replies = self.settled if self.settled is not None else dict(self._replies("train"))
        self.settled, self.awaiting = None, False
        return replies

    settled = None  # the replies settle read
    awaiting = False  # a train command's replies are not read yet

    def settle(self, step: int) -> str | None:
        """Rank 0 stopped training at `step` (cancel, error): each worker must stop at the same step within
        STOP_TIMEOUT_S; one that does not is ended (with the others: the group is lost), so cancel never hangs.
        Returns a worker's own error when one failed (rank 0 then raises it: the cause, not "rank 1 stopped")."""
        try:
            self.settled = dict(self._replies("stop", STOP_TIMEOUT_S))
        except distributed.RankLostError as error:
            self.close(grace_s=0)
            return str(error)
        if any(reply[1] != step for reply in self.settled.values()):
            self.close(grace_s=0)
            return f"devices: the worker ranks stopped at {self.settled}, rank 0 at step {step}; they were ended"
        failed = [f"rank {rank} failed in step {step + 1}: {reply[2]}" for rank, reply in self.settled.items()
                  if reply[0] == "failed"]
        return (f"devices: {'; '.join(failed)}. Every rank stopped at step {step}; the run keeps its checkpoint of "
                "that step") if failed else None

    def _replies(self, what: str, timeout_s: float = START_TIMEOUT_S):
        for rank, connection in self.connections.items():
            deadline = time.monotonic() + timeout_s
            process = self.processes[rank - 1]
            while not connection.poll(0.1):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise distributed.RankLostError(f"devices: rank {rank} stopped answering ({what}; exit code "
                                                    f"{process.poll()}); see the ComfyUI log for its error")
            try:
                reply = connection.recv()
            except (EOFError, OSError):  # the worker's end closed: it died
                raise distributed.RankLostError(f"devices: rank {rank} stopped answering ({what}; exit code "
                                                f"{process.poll()}); see the ComfyUI log for its error") from None
            yield rank, reply

    def close(self, grace_s: float = 30.0) -> None:
        if self.closed:
            return
        self.closed = True
        for connection in self.connections.values():
            try:
                connection.send(("quit",))
            except OSError:
                pass
        self._stop_processes(grace_s=grace_s)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if RankWorkers.active is self:
            RankWorkers.active = None

    def _stop_processes(self, grace_s: float = 0.0) -> None:
        for process in self.processes:
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            if process.poll() is None:
                process.kill()
                process.wait()

    @classmethod
    def close_active(cls) -> None:
        if cls.active is not None:
            cls.active.close()


def _shared(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in shared memory (moved there once, in place: the MODEL keeps using it); a CUDA tensor as a CPU
    copy (each worker puts it on its own device)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.share_memory_()


def _config_state(config) -> tuple:
    """A ComfyUI model config (comfy.supported_models) as (module, class name, attributes): its class answers every
    unknown attribute, pickle's __setstate__ lookup included, with None, so it cannot be unpickled as is."""
    return type(config).__module__, type(config).__qualname__, dict(vars(config))


def _config_from_state(state: tuple):
    module, name, attributes = state
    cls = getattr(importlib.import_module(module), name)
    config = cls.__new__(cls)
    config.__dict__.update(attributes)
    return config


def parse_devices(devices: str) -> int:
    if devices not in DEVICES:
        raise ValueError(f"devices={devices!r}: choose one of {', '.join(DEVICES)}")
    problem = os_compat.several_devices_problem() if devices != "1" else None
    if problem:
        raise ValueError(f"devices={devices}: {problem}.")
    return int(devices)


def open_on_devices(devices: str, model, open_run, run_args: tuple, run_kwargs: dict, rank0_kwargs: dict | None = None):
    """`open_run(model, *run_args, **run_kwargs)` (open_lora_run, open_controlnet_run) on `devices` ranks: "1" in this
    process exactly as without a process group; N > 1: worker ranks started first (the group must run before the
    Trainer is built), then rank 0's run, then theirs. `rank0_kwargs`: what only rank 0 uses (validation)."""
    world_size = parse_devices(devices)
    # One process group per ComfyUI process: a run opened now never joins the group of an earlier one.
    RankWorkers.close_active()
    if world_size == 1:
        return open_run(model, *run_args, **run_kwargs, **(rank0_kwargs or {}))
    workers = RankWorkers(world_size, model, open_run, run_args, run_kwargs)
    try:
        run = open_run(model, *run_args, **run_kwargs, **(rank0_kwargs or {}))
        workers.open(run)
    except BaseException:
        workers.close()
        raise
    run.ranks = workers
    return run


def worker_main(connection, rank: int, world_size: int) -> None:
    """A worker rank (in its own process, ComfyUI imported): join the group, build the model, open the run, train
    on command."""
    import comfy.model_patcher

    payload = connection.recv()
    connection.send(("ready",))
    device = torch.device("cuda", rank) if torch.cuda.is_available() and mm.get_torch_device().type == "cuda" \
        else torch.device("cpu")
    distributed.init(rank, world_size, device, init_method=payload["init"], timeout_s=payload["timeout"])
    # The same ComfyUI model class, its weights the shared tensors themselves (assign: no copy).
    model = _config_from_state(payload["model_config"]).get_model({}, "", device=mm.unet_offload_device())
    model.load_state_dict(payload["base"], strict=True, assign=True)
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                               offload_device=mm.unet_offload_device())
    command, extra = connection.recv()
    assert command == "open", command
    with torch.inference_mode():  # as ComfyUI runs nodes
        run = payload["open_run"](patcher, *payload["args"], **payload["kwargs"], **extra)
    del extra  # rank 0's shared tensors (a ControlNet's initial weights) were copied into this rank's own
    _error_hook_for_tests(run)
    connection.send(("opened", run.step))
    while True:
        command = connection.recv()
        if command[0] == "quit":
            break
        _, target, every, minutes = command
        try:
            with torch.inference_mode():
                run.train_to(target, checkpoint_every=every, checkpoint_minutes=minutes)
            connection.send(("trained", run.step))
        except distributed.RanksStopped:
            connection.send(("stopped", run.step))
        except Exception as error:  # noqa: BLE001 - reported to rank 0, which fails the run with it
            connection.send(("failed", run.step, f"{type(error).__name__}: {error}"[:1000]))
    torch.distributed.destroy_process_group()


TEST_ERROR_AT_STEP = "HEADROOM_TEST_WORKER_ERROR_AT_STEP"
TEST_ERROR_BEFORE_STEP = "HEADROOM_TEST_WORKER_ERROR_BEFORE_STEP"


def _error_hook_for_tests(run) -> None:
    """Tests only (tests/comfy/test_train_devices.py): with HEADROOM_TEST_WORKER_ERROR_AT_STEP=N in the environment
    ComfyUI runs in, each worker raises an ordinary RuntimeError inside its forward pass of step N; with
    HEADROOM_TEST_WORKER_ERROR_BEFORE_STEP=N, as step N starts, before its first collective (reading its batch).
    Unset (outside those tests) nothing is hooked."""
    before = os.environ.get(TEST_ERROR_BEFORE_STEP)
    if before:
        batch_items = run.trainer.batch_items

        def failing_batch_items(index):
            if run.step + 1 == int(before):
                raise RuntimeError(f"{TEST_ERROR_BEFORE_STEP}={before}: a test error before this rank's step")
            return batch_items(index)

        run.trainer.batch_items = failing_batch_items
    step = os.environ.get(TEST_ERROR_AT_STEP)
    if not step:
        return

    def fail(module, args):
        if run.step + 1 == int(step):
            raise RuntimeError(f"{TEST_ERROR_AT_STEP}={step}: a test error inside this rank's forward pass")

    run.patcher.model.diffusion_model.register_forward_pre_hook(fail)
