"""Exponential moving average of the trainable weights, kept in host RAM.

    ema_0 = w_0,   ema_t = decay * ema_(t-1) + (1 - decay) * w_t     (after every optimizer step t)

The update is torch's own (`torch.optim.swa_utils.get_ema_multi_avg_fn`: one foreach lerp over all tensors);
torch's `AveragedModel` around it would deep-copy the module the adapters sit in — the whole frozen base — so the
averaged tensors are kept here as a flat list beside the adapter instead. On a GPU each update copies the adapter
(a few MB to a few hundred MB) to the host; the device never holds a second copy.

Used for validation and saving by choice (`weights` on the Validate / Save nodes): `swapped_in` puts the averaged
values into the live parameters for the duration of a block and puts the trained ones back after.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn


class WeightEMA:
    def __init__(self, params: Sequence[torch.nn.Parameter], decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema_decay={decay} must be in (0, 1) (0 turns EMA off)")
        self.decay = decay
        self.names = [f"{index:06d}" for index in range(len(params))]  # the trainer's parameter order
        self.averaged = [p.detach().to("cpu", torch.float32, copy=True) for p in params]
        self._update = get_ema_multi_avg_fn(decay)

    def update(self, params: Sequence[torch.nn.Parameter]) -> None:
        self._update(self.averaged, [p.detach().to("cpu", torch.float32) for p in params], None)

    def state_dict(self, copy: bool = True) -> dict[str, torch.Tensor]:
        return {name: tensor.clone() if copy else tensor for name, tensor in zip(self.names, self.averaged)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self.names):
            raise ValueError(f"EMA state has {len(state)} tensors, this adapter {len(self.names)}")
        for name, tensor in zip(self.names, self.averaged):
            if state[name].shape != tensor.shape:
                raise ValueError(f"EMA tensor {name} is {list(state[name].shape)}, expected {list(tensor.shape)}")
            tensor.copy_(state[name])

    @contextlib.contextmanager
    def swapped_in(self, params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
        """The averaged values in the live parameters inside the block; the trained ones back after."""
        # Kept in host RAM, beside the averaged copy: on the device a full fine-tune's copy is the trained weights' size.
        trained = [p.detach().to("cpu", copy=True) for p in params]
        with torch.no_grad():
            for param, averaged in zip(params, self.averaged):
                param.copy_(averaged.to(param.device, param.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for param, value in zip(params, trained):
                    param.copy_(value)
