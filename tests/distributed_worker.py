"""One rank of a data-parallel toy run (tests/unit/test_distributed.py), started by the test as a subprocess, or forked
from this script's zygote (Zygote, `--zygote`: the imports done once).

    python distributed_worker.py RANK WORLD_SIZE PORT JOB_JSON

JOB_JSON: {"run_root", "run_name", "steps", "checkpoint_every", "batch_size", "grad_accum", "rank_batch",
"timeout_s", "step_log", "step_seconds", "corrupt_rank", "corrupt_after", "out", "kind", "optimizer", "lr",
"shard_weights", "checkpointing", "width"}: kind "full" trains the toy's linear layers whole (with several ranks: its
optimizer state sharded), `optimizer` one of OPTIMIZERS, `shard_weights` true: its weights too, with FSDP2;
`checkpointing` true: per-block gradient checkpointing; `width`: the toy's width (default 32). The rank joins a gloo
group on 127.0.0.1:PORT (world size 1: no group, the
plain path), builds the toy denoiser + LoRA of tests/unit/test_trainer.py on two buckets of toy latents, resumes
the run folder when it holds a checkpoint, trains to `steps` and saves (rank 0 writes). It appends "step N" lines
to `step_log` (flushed) and writes its adapter weights to `out` (a .pt per rank, written by torch.save).
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import time

TESTS = pathlib.Path(__file__).resolve().parent
sys.path += [str(TESTS), str(TESTS / "unit")]


def start_ranks(job: dict, world: int = 2, forked: bool = False) -> list:
    """This script as `world` subprocesses (rank 0..world-1) on a free port, one torch thread each. `forked`: each rank
    forked from this test process's zygote (ForkedRank), which imported torch, peft and the toy's modules once."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if forked:
        return [Zygote.shared().start(rank, world, port, job) for rank in range(world)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, __file__, str(rank), str(world), str(port), json.dumps(job)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(world)]


def run_ranks(job: dict, world: int = 2, forked: bool = False) -> list[dict]:
    """start_ranks, wait for every rank (each must succeed), and what each wrote to `job["out"]`."""
    import torch

    ranks = start_ranks(job, world, forked)
    for rank, process in enumerate(ranks):
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, f"rank {rank} failed:\n{err[-3000:]}"
    return [torch.load(f"{job['out']}.rank{rank}.pt") for rank in range(world)]


class Zygote:
    """This script as `--zygote`: torch, peft (the pack imports it at a run's first LoRA layer) and the toy's modules
    imported once, then one rank forked per request. A fresh interpreter spent ~10 s of a toy rank's life importing
    them (peft ~6 s), the toy run itself a second or two. JSON lines on its stdin / stdout: {"op": "start", "rank",
    "world", "port", "job", "stdout", "stderr"} -> {"pid"}; {"op": "poll", "pid"} -> {"code": None while it runs, else
    its exit code, or minus the signal that ended it}. One per test process, started on first use."""
    _shared = None

    def __init__(self):
        import subprocess
        import tempfile

        self.folder = pathlib.Path(tempfile.mkdtemp(prefix="headroom-ranks-"))
        self.process = subprocess.Popen([sys.executable, __file__, "--zygote"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=open(self.folder / "zygote.err", "w"),
                                        env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True)
        self.count = 0
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the ranks' zygote did not start: {(self.folder / 'zygote.err').read_text()[-3000:]}")

    @classmethod
    def shared(cls) -> "Zygote":
        if cls._shared is None or cls._shared.process.poll() is not None:
            import atexit

            cls._shared = cls()
            atexit.register(cls._shared.close)
        return cls._shared

    def close(self) -> None:
        import shutil

        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def ask(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the ranks' zygote ended: {(self.folder / 'zygote.err').read_text()[-3000:]}")
        return json.loads(line)

    def start(self, rank: int, world: int, port: int, job: dict) -> "ForkedRank":
        self.count += 1
        out, err = (self.folder / f"{self.count}.rank{rank}.{name}" for name in ("out", "err"))
        pid = self.ask(op="start", rank=rank, world=world, port=port, job=job, stdout=str(out), stderr=str(err))["pid"]
        return ForkedRank(self, pid, out, err)


class ForkedRank:
    """A rank the zygote forked, with as much of subprocess.Popen as the tests use: pid, poll(), communicate(),
    kill(), returncode (negative: the signal that ended it). Its output goes to files, read by communicate()."""

    def __init__(self, zygote: Zygote, pid: int, out: pathlib.Path, err: pathlib.Path):
        self.zygote, self.pid, self.out, self.err = zygote, pid, out, err
        self.returncode = None

    def poll(self) -> int | None:
        if self.returncode is None:  # the zygote reaps it: until then its pid is its own (safe to signal)
            self.returncode = self.zygote.ask(op="poll", pid=self.pid)["code"]
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        import subprocess

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.out.read_text(errors="replace"), self.err.read_text(errors="replace")

    def kill(self) -> None:
        import signal

        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def zygote() -> None:
    """The zygote's loop (Zygote): imports once, then forks a rank per request and reaps them when asked."""
    import traceback

    import conftest  # noqa: F401  (registers the repo as the package `headroom`)
    import peft  # noqa: F401
    import torch
    import torch.distributed  # noqa: F401
    from headroom.training.core import distributed  # noqa: F401
    from headroom.training.memory import sharded_optimizer, sharded_weights  # noqa: F401
    import memory_caches  # noqa: F401
    import test_trainer  # noqa: F401

    torch.set_num_threads(1)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "poll":
            pid, status = os.waitpid(request["pid"], os.WNOHANG)
            code = None if pid == 0 else (os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status))
            print(json.dumps({"code": code}), flush=True)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            print(json.dumps({"pid": pid}), flush=True)
            continue
        code = 1
        try:  # the rank: its own output files, never the protocol pipes
            for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            try:
                main(request["rank"], request["world"], request["port"], request["job"])
                code = 0
            except BaseException:
                traceback.print_exc()  # as an interpreter prints what ended it
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def toy_run(job: dict):
    import torch
    from headroom.training.core.adapters import (
        AdapterConfig,
        AdapterSet,
        select_targets,
    )
    from headroom.training.core.objective import ObjectiveConfig
    from headroom.training.core.optimizers import OptimizerConfig
    from headroom.training.core.run_dir import RunDir
    from headroom.training.core.trainer import TrainConfig, Trainer
    from headroom.training.memory.policy import run_policy
    from memory_caches import MemoryLatentCache, MemoryTextCache
    from test_trainer import ToyDenoiser, ToyNet

    # Two buckets (5 and 6 items): with a global batch of 4 a bucket's last batch has 1 or 2 items, so shares
    # are uneven and one rank's share is sometimes empty.
    g = torch.Generator().manual_seed(0)
    latents = [torch.randn(4, 4, 4 if i < 5 else 6, generator=g) for i in range(11)]
    conds = {f"k{i}": {"cross_attn": torch.randn(3, 8, generator=g)} for i in range(11)}
    cache = MemoryLatentCache(latents, [f"k{i}" for i in range(11)],
                              {(32, 32): list(range(5)), (32, 48): list(range(5, 11))})
    texts = MemoryTextCache(conds, {"cross_attn": torch.zeros(3, 8)})
    denoiser = ToyDenoiser(ToyNet(width=job.get("width", 32)))
    adapter = AdapterConfig(rank=4, alpha=4, targets="all_linear", kind=job.get("kind", "lora"))
    adapters = AdapterSet(denoiser.net, select_targets(denoiser.net, None, adapter, [n for n, _ in denoiser.blocks()]),
                          adapter)
    adapters.attach(denoiser.net)
    config = TrainConfig(batch_size=job["batch_size"], grad_accum=job.get("grad_accum", 1), seed=7,
                         caption_dropout=0.3, objective=ObjectiveConfig(timestep_sampling="logit_normal",
                                                                         noise_offset=0.05))
    run_dir = RunDir(job["run_root"], job["run_name"]) if job.get("run_root") else None
    optimizer = OptimizerConfig(name=job.get("optimizer", "AdamW"), lr=job.get("lr", 1e-2), schedule="cosine",
                                warmup_steps=2, total_steps=20)
    policy = run_policy(None, gradient_checkpointing=True) if job.get("checkpointing") else None
    return Trainer(denoiser, adapters, cache, texts, config, optimizer, run_dir=run_dir, policy=policy)


def _resident_bytes() -> int:
    import gc

    gc.collect()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(rank: int, world: int, port: int, job: dict) -> None:
    import gc

    import conftest  # noqa: F401  (registers the repo as the package `headroom`)
    import torch
    from headroom.training.core import distributed

    torch.set_num_threads(1)
    if world > 1:
        distributed.init(rank, world, "cpu", init_method=f"tcp://127.0.0.1:{port}", timeout_s=job.get("timeout_s", 60),
                         shard_weights=job.get("shard_weights", False))
    run(rank, world, job)
    if world > 1:
        # As workflows/headroom_train_distributed.py: the run's FSDP2 state, in reference cycles, collected while the
        # group is whole; gloo's threads stopped here, not torn down by the interpreter's exit.
        gc.collect()
        torch.distributed.destroy_process_group()


def run(rank: int, world: int, job: dict) -> None:
    """Build, resume, train and save the toy run; write what the test reads to `job["out"]`."""
    import torch

    rss = []  # resident bytes before the run is built, then after each step (its gradients and state resident)
    rss.append(_resident_bytes())
    trainer = toy_run(job)
    trainer.rank_batch = job.get("rank_batch")
    if trainer.run_dir is not None:
        trainer.resume()
    log = open(job["step_log"], "a", buffering=1) if job.get("step_log") else None

    def after_step(report):
        if log is not None:
            log.write(f"rank {rank} step {report.step} loss {report.loss!r}\n")
            log.flush()
        time.sleep(job.get("step_seconds", 0))
        rss.append(_resident_bytes())
        if job.get("corrupt_rank") == rank and report.step == job.get("corrupt_after"):
            trainer.denoiser.net.proj_out.bias.data[:] = float("nan")  # this rank's model only

    trainer.train_to(job["steps"], after_step, checkpoint_every=job.get("checkpoint_every", 0))
    if trainer.run_dir is not None:
        trainer.save()
    from headroom.training.memory.sharded_optimizer import local_optimizer

    # The optimizer state this rank holds (sharded: its share), per tensor (0-d counters left out).
    state = [sum(v.nbytes for v in entries.values() if isinstance(v, torch.Tensor) and v.ndim > 0)
             for entries in local_optimizer(trainer.optimizer).state.values()]
    adapter = trainer.trainable.state_dict()
    if trainer.shards_weights:  # FSDP2: this rank's shard sizes, then the whole weights (every rank gathers them)
        from headroom.training.memory.sharded_weights import full

        state = [sum(v.to_local().nbytes for v in entries.values() if isinstance(v, torch.Tensor) and v.ndim > 0)
                 for entries in trainer.optimizer.state.values()]
        local_bytes = sum(p.to_local().nbytes for p in trainer.params)
        adapter = {key: full(value) for key, value in adapter.items()}
    torch.save({"adapter": adapter, "losses": trainer.loss_history, "state_bytes": sum(state),
                "weight_bytes": local_bytes if trainer.shards_weights else None, "rss": rss,
                "sharded": trainer.sharded, "shapes": [tuple(p.shape) for p in trainer.params],
                "wrapper_state": len(trainer.optimizer.state) if trainer.sharded else None},
               f"{job['out']}.rank{rank}.pt")


if __name__ == "__main__" and sys.argv[1:] == ["--zygote"]:
    zygote()
elif __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
    # Everything the test reads is written and closed: the rank ends without the interpreter's teardown, where a rank
    # that had finished could still abort now and then ("terminate called without an active exception", C++ threads
    # destroyed at exit; once in a 2-rank FSDP2 run of the whole suite on a loaded machine) and fail a passing test.
    # A rank whose run raised exits through the traceback as before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
