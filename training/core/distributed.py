"""Data parallelism for the Trainer over an initialised torch.distributed process group.

What is shared and what is not:
  - every rank holds the whole frozen base (never wrapped: streaming / low-bit storage work per rank unchanged)
    and an identical copy of the trainable weights and optimizer;
  - each micro-step's global batch (what a 1-rank run draws) is split into contiguous, disjoint shares, one per
    rank; a batch never mixes buckets, so neither do the shares;
  - the noise levels and noise are drawn for the whole global batch from the (seed, micro-step) generator and each
    rank keeps its rows, so N ranks train on exactly the values one rank would;
  - each rank's loss is its share's mean weighted by share / global batch; the scalar losses are summed (the
    global mean, reported and checked for NaN by every rank alike) and, once per optimizer step, the trainable
    gradients are flattened into one buffer and summed: the gradient of the global mean, on every rank;
  - only rank 0 writes the run directory.

Backend and device come from the device: NCCL for CUDA (each rank on cuda:LOCAL_RANK), gloo on the CPU. The same
code runs for both; only `init` picks. A collective that fails (a rank was killed, ran out of memory, hung past
the group's timeout) raises RankLostError naming the rank(s) that stopped answering.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import time

import torch
import torch.distributed as dist

from .. import public_module

_ALIVE_GRACE_S = 3.0  # how long survivors wait for each other before naming the ranks that did not answer


class RankLostError(RuntimeError):
    """A rank of a data-parallel run stopped answering; the message names it."""

    __module__ = public_module(__name__)


class RanksStopped(RuntimeError):
    """Another rank stopped the run at the end of a step (rank 0's cancel, or its error): this rank stops too."""

    __module__ = public_module(__name__)


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


_shard_weights = False  # set by init: a full fine-tune's weights sharded with FSDP2 (memory/sharded_weights.py)


def init(rank: int, world_size: int, device: torch.device | str = "cpu", init_method: str | None = None,
         timeout_s: float = 600.0, shard_weights: bool = False) -> None:
    """Join (or create) the process group: NCCL for CUDA, gloo otherwise. `init_method` None: from the environment
    (torchrun / accelerate set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE). A short `timeout_s` bounds how long a
    rank waits for one that hangs. `shard_weights`: the runs of this process shard a full fine-tune's weights,
    gradients and optimizer state with FSDP2 (headless launchers only: see memory/sharded_weights.py)."""
    global _shard_weights
    _shard_weights = shard_weights
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method=init_method or "env://", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))


class DataParallel:
    """The Trainer's view of the process group: its rank's share of a batch, and the few collectives a step needs."""

    def __init__(self):
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # Collectives run on the backend's device: NCCL reduces CUDA tensors, gloo CPU ones.
        self.device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")
        self._step = 0
        self._done = self._losses = 0  # collectives of the current step (abort_step)
        self.others_know = False  # the other ranks know this rank stops (leave: nothing more to tell them)
        # FSDP2 reduce-scatters the trained gradients inside backward: the step's gradient all-reduce then carries
        # the abort flag alone.
        self.shards_weights = _shard_weights

    @classmethod
    def current(cls) -> "DataParallel | None":
        """The running group's helper; None without one (or with one rank): the 1-rank path, with no extra work."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return cls()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, count: int) -> slice:
        """This rank's rows of a global batch of `count` items (contiguous; sizes differ by at most one)."""
        return slice(count * self.rank // self.world_size, count * (self.rank + 1) // self.world_size)

    def begin_step(self, step: int, loss_collectives: int) -> None:
        """A step starts: `loss_collectives` loss all-reduces, then one gradient all-reduce (what abort_step joins)."""
        self._step, self._done, self._losses = step, 0, loss_collectives

    def global_loss(self, weighted_local: torch.Tensor, step: int) -> float:
        """The sum over ranks of (share mean * share / global batch): the global batch's mean loss. The second
        element is the abort flag (abort_step): any rank's 1 stops every rank's step here."""
        self._step = step
        value = torch.cat([weighted_local.detach().float().reshape(1).to(self.device),
                           torch.zeros(1, device=self.device)])
        with self.collective("loss all-reduce"):
            dist.all_reduce(value)
        self._check_abort(value[1])
        return value[0].item()

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the trainable gradients over the ranks in one flat buffer (a parameter without a gradient counts 0),
        with the abort flag as its last element."""
        if self.shards_weights:
            params = []
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads] + [torch.zeros(1)]).to(self.device)
        with self.collective("gradient all-reduce"):
            dist.all_reduce(flat)
        self._check_abort(flat[-1])
        offset = 0
        for param, grad in zip(params, grads):
            count = grad.numel()
            param.grad = flat[offset:offset + count].view_as(grad).to(grad)
            offset += count

    def sum_over_ranks(self, tensor: torch.Tensor) -> None:
        """Sum a tensor over the ranks, in place (FSDP2's gradient norm: each rank's share of the squares)."""
        with self.collective("gradient norm all-reduce"):
            dist.all_reduce(tensor)

    def abort_step(self, params: list[torch.nn.Parameter]) -> None:
        """This rank left its step midway (ComfyUI's interrupt raised inside rank 0's forward, an error): join the
        collective the other ranks wait in, with the abort flag set, so they discard the step and stop too
        (RanksStopped) instead of waiting out the group's timeout. After the gradient all-reduce the others are
        in the step-end stop check: join that one."""
        self.others_know = True
        if self._done < self._losses:
            flag = torch.tensor([0.0, 1.0], device=self.device)
        elif self._done == self._losses:
            flag = torch.zeros((0 if self.shards_weights else sum(p.numel() for p in params)) + 1, device=self.device)
            flag[-1] = 1.0
        else:
            self.any_stops(True)
            return
        with self.collective("abort"):
            dist.all_reduce(flag)

    def leave(self) -> None:
        """This rank stops BETWEEN steps (an error before a step's first collective, in a checkpoint save after a
        step, while loading the model): the other ranks train on into the next step's first loss all-reduce, so
        join it with the abort flag set; they stop at the last finished step instead of waiting out the group's
        timeout. Nothing to do when they already know (abort_step, any_stops, or they stopped this rank)."""
        if self.others_know:
            return
        self.others_know = True
        flag = torch.tensor([0.0, 1.0], device=self.device)
        with self.collective("abort"):
            dist.all_reduce(flag)

    def _check_abort(self, flag: torch.Tensor) -> None:
        self._done += 1
        if flag.item() > 0:
            self.others_know = True
            raise RanksStopped(f"rank {self.rank}: another rank left step {self._step + 1} midway (cancel or its "
                               f"error); this rank discards the step and stops at step {self._step}")

    def any_stops(self, stops: bool, save_due: bool = False) -> bool:
        """Whether any rank stops after this step (cancel, an error in its step callback): all ranks agree. In the
        same all-reduce they agree whether a checkpoint is due (`save_due`: any rank's clock says so), kept in
        `self.save_due` (a sharded optimizer's state is gathered by every rank for it)."""
        flag = torch.tensor([1.0 if stops else 0.0, 1.0 if save_due else 0.0], device=self.device)
        with self.collective("stop check"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop, self.save_due = bool(flag[0].item()), bool(flag[1].item())
        self.others_know = self.others_know or stop
        return stop

    save_due = False

    def barrier(self, what: str) -> None:
        with self.collective(what):
            dist.barrier()

    @contextlib.contextmanager
    def collective(self, what: str):
        try:
            yield
        except (RuntimeError, dist.DistError) as error:  # gloo: connection closed / timed out; NCCL: watchdog
            self.others_know = True  # the group is lost: nothing more can be told
            if isinstance(error, RankLostError):
                raise
            lost = self._lost_ranks()
            who = (f"rank {', '.join(map(str, lost))}" if lost else "another rank") + " stopped answering"
            raise RankLostError(
                f"data-parallel training, rank {self.rank} of {self.world_size}: the {what} of step {self._step + 1} "
                f"failed: {who} (killed, crashed or short of memory: see its own log). This rank stops too; the run's "
                f"last checkpoint is kept and the run resumes from it at any number of ranks. ({str(error)[:300]})"
            ) from None

    def _lost_ranks(self) -> list[int]:
        """The ranks that do not check in on the rendezvous store within a grace period. A store that cannot be
        reached is hosted by rank 0 (our own launchers' TCPStore), so rank 0 is the one lost."""
        try:
            store = dist.distributed_c10d._get_default_store()
            prefix = f"headroom/alive/{self._step}/"
            store.set(prefix + str(self.rank), "1")
            deadline = time.monotonic() + _ALIVE_GRACE_S
            others = [r for r in range(self.world_size) if r != self.rank]
            while True:
                missing = [r for r in others if not store.check([prefix + str(r)])]
                if not missing or time.monotonic() > deadline:
                    return missing
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - the store went down with its host
            return [0] if self.rank != 0 else []


def is_main_process() -> bool:
    """False on the ranks > 0 of a running process group: they never write the run directory."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def env_rank() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun / accelerate launch set them; (0, 1, 0) outside a launcher."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))
