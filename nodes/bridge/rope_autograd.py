"""Backward formulas for comfy_kitchen's RoPE ops, which ComfyUI 0.33's models call in their forward.

comfy_kitchen defines `apply_rope*` / `rms_rope*` as torch custom ops without an autograd formula, so a backward
through them fails ("Trying to backward through comfy_kitchen.rms_rope.default but no autograd formula was
registered"). Most ComfyUI models take a plain-torch path while `comfy.model_management.in_training` is set (Flux,
Lumina 2, LTX), but some call the ops either way: ErnieImage (apply_rope_split_half), JoyImage (rms_rope), Cosmos
Predict2 and Anima (rms_rope_split_half). Without a formula no LoRA below their attention could train.

The formula registered here recomputes the op with comfy_kitchen's own eager (plain torch) reference under autograd
and differentiates that: the same function the kernels compute (a per-head RMSNorm and a 2x2 rotation per pair), so
the gradient is exact. It is registered only for ops that have none (a comfy_kitchen that ships its own keeps it)."""
from __future__ import annotations

import logging

import torch

# op name -> the name of its reference in comfy_kitchen.backends.eager.rope (the same signature)
_OPS = ("apply_rope", "apply_rope1", "apply_rope_split_half", "apply_rope_split_half1", "rms_rope", "rms_rope1",
        "rms_rope_split_half", "rms_rope_split_half1")
_registered = False


def _needs_formula(qualified_name: str) -> bool:
    """Whether the custom op has no backward. A torch.library.custom_op always has an Autograd kernel (the one that
    raises), so its definition is asked whether a formula was registered."""
    from torch._library import custom_ops

    definition = custom_ops.OPDEFS.get(qualified_name)
    return definition is not None and getattr(definition, "_backward_fn", False) is None


def _formula(reference):
    def setup_context(ctx, inputs, output):
        tensors = [i for i, value in enumerate(inputs) if isinstance(value, torch.Tensor)]
        ctx.tensor_positions = tensors
        ctx.others = {i: value for i, value in enumerate(inputs) if i not in tensors}
        ctx.count = len(inputs)
        ctx.save_for_backward(*(inputs[i] for i in tensors))

    def backward(ctx, *grads):
        saved = dict(zip(ctx.tensor_positions, ctx.saved_tensors))
        wanted = [i for i in ctx.tensor_positions if ctx.needs_input_grad[i]]
        with torch.enable_grad():
            args = [saved[i].detach().requires_grad_(i in wanted) if i in saved else ctx.others[i]
                    for i in range(ctx.count)]
            outputs = reference(*args)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            pairs = [(out, grad) for out, grad in zip(outputs, grads) if grad is not None and out.requires_grad]
            found = torch.autograd.grad([o for o, _ in pairs], [args[i] for i in wanted], [g for _, g in pairs],
                                        allow_unused=True) if pairs and wanted else [None] * len(wanted)
        result = [None] * ctx.count
        for i, grad in zip(wanted, found):
            result[i] = grad
        return tuple(result)

    return setup_context, backward


def register_rope_autograd() -> None:
    """Give comfy_kitchen's RoPE ops a backward where they have none (once; nothing without comfy_kitchen)."""
    global _registered
    if _registered:
        return
    _registered = True
    try:  # importing comfy_kitchen defines its ops (torch.ops.comfy_kitchen)
        from comfy_kitchen.backends.eager import rope as eager
    except ImportError:
        return
    for name in _OPS:
        qualified, reference = f"comfy_kitchen::{name}", getattr(eager, name, None)
        try:
            if reference is None or not _needs_formula(qualified):
                continue
            setup_context, backward = _formula(reference)
            torch.library.register_autograd(qualified, backward, setup_context=setup_context)
        except Exception as error:  # an unexpected comfy_kitchen: its ops stay as they are (training may then fail)
            logging.warning("Headroom: no backward registered for comfy_kitchen::%s (%s)", name, error)
