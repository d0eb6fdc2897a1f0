"""Low-bit storage of the frozen base (policy base_storage = "fp8" | "int8" | "nf4").

The frozen linear layers of the blocks are swapped, for the duration of a run, for `LowBitLinear`
modules that hold the weight in 8 or 4 bits and dequantise it on the fly for each product:
- fp8:  torch.float8_e4m3fn with one fp32 scale per tensor (absmax / 448), pure torch;
- int8: bitsandbytes row-wise absmax int8 (`int8_vectorwise_quant` / `_dequant`);
- nf4:  bitsandbytes NF4, 64-value blocks (`quantize_4bit` / `dequantize_4bit`).
Only weights are quantised (activations stay in the compute dtype), so the adapter learns against
exactly the dequantised base. Convolutions stay as loaded.

The product runs through `_DequantLinear`, a small autograd function that keeps only the packed weight
for backward and dequantises it again there: F.linear on a dequantised copy would make autograd keep a
full-precision copy of every weight until backward. bitsandbytes' own Linear4bit is not used because its
CPU dequantisation of 2-D weights is wrong in bitsandbytes 0.50 whenever the row width is not a multiple
of the block size (checked: 0.40 relative error on a 64x32 weight, 0.09 when quantised flat), so NF4
weights are quantised flattened here; Linear8bitLt would quantise the activations too.

    base = LowBitBase(diffusion_model, "nf4", device, prefixes=block_names)   # builds and attaches
    adapters = AdapterSet(diffusion_model, paths, config)                     # wraps the LowBitLinears
    ...
    adapters.detach(); base.detach()      # the original modules are back; base.attach() re-attaches
"""
from __future__ import annotations

import importlib.util
import math
from typing import Iterable

import torch

from ..checks import require_package

STORAGES = ("fp8", "int8", "nf4")
BITSANDBYTES_STORAGES = ("int8", "nf4")  # bitsandbytes is an optional package: see check_available
FP8_MAX = 448.0  # largest finite float8_e4m3fn
NF4_BLOCK = 64


def check_available(storage: str) -> None:
    """Raise MissingPackageError when `storage` needs bitsandbytes and it does not import: before a run, not mid-run."""
    if storage in BITSANDBYTES_STORAGES:
        require_package("bitsandbytes.functional", "bitsandbytes", f"offload policy base_storage {storage!r}",
                        "choose base_storage 'fp8' (pure torch) or 'as_loaded'")


def storage_installed(storage: str) -> bool:
    """Whether `storage`'s package is installed (found, not imported: the planner asks for every candidate)."""
    return storage not in BITSANDBYTES_STORAGES or importlib.util.find_spec("bitsandbytes") is not None


def _bitsandbytes(storage: str):
    check_available(storage)
    import bitsandbytes.functional as bnb_functional

    return bnb_functional


def quantize(weight: torch.Tensor, storage: str) -> dict[str, torch.Tensor]:
    """The packed tensors of `weight` in `storage` (computed on the weight's device)."""
    weight = weight.detach()
    if storage == "fp8":
        scale = (weight.abs().amax().float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        return {"q": (weight.float() / scale).to(torch.float8_e4m3fn), "scale": scale}
    if storage == "int8":
        # bitsandbytes takes float16 here (its CUDA kernel accepts nothing else): same input on every device.
        q, row_absmax, _ = _bitsandbytes(storage).int8_vectorwise_quant(weight.half().contiguous())
        return {"q": q, "scale": row_absmax}
    if storage == "nf4":
        q, state = _bitsandbytes(storage).quantize_4bit(weight.float().flatten(), blocksize=NF4_BLOCK,
                                                        quant_type="nf4", compress_statistics=False)
        return {"q": q, "absmax": state.absmax, "code": state.code}
    raise ValueError(f"low-bit storage {storage!r} is not one of {', '.join(STORAGES)}")


def dequantize(packed: dict[str, torch.Tensor], storage: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    if storage == "fp8":
        return (packed["q"].to(dtype) * packed["scale"].to(dtype)).reshape(shape)
    if storage == "int8":
        return _bitsandbytes(storage).int8_vectorwise_dequant(packed["q"], packed["scale"]).to(dtype).reshape(shape)
    bnb_functional = _bitsandbytes(storage)
    state = bnb_functional.QuantState(absmax=packed["absmax"], shape=torch.Size([shape.numel()]), code=packed["code"],
                                      blocksize=NF4_BLOCK, quant_type="nf4", dtype=torch.float32)
    return bnb_functional.dequantize_4bit(packed["q"], state).reshape(shape).to(dtype)


class _DequantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, storage, shape, names, *tensors):
        *packed, bias = tensors
        ctx.storage, ctx.shape, ctx.names, ctx.x_dtype = storage, shape, names, x.dtype
        ctx.save_for_backward(*packed)  # saved tensors, so checkpointing and streaming manage them
        device_type = x.device.type
        # Under autocast the product runs in the autocast dtype: dequantise straight into it.
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        weight = dequantize(dict(zip(names, packed)), storage, shape, dtype)
        return torch.nn.functional.linear(x.to(dtype), weight, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[0]:
            return (None,) * (4 + len(ctx.names) + 1)
        weight = dequantize(dict(zip(ctx.names, ctx.saved_tensors)), ctx.storage, ctx.shape, grad_out.dtype)
        grad_x = (grad_out @ weight).to(ctx.x_dtype)
        return (grad_x, None, None, None) + (None,) * (len(ctx.names) + 1)


class LowBitLinear(torch.nn.Linear):
    """A frozen nn.Linear with its weight stored in `storage` (buffers `weight_<name>`), dequantised per call.

    Subclasses nn.Linear so adapter target selection and peft's LoRA layers treat it as a linear layer;
    `weight` is a property returning the dequantised weight (peft reads its device and dtype; DoRA its norm).
    """

    def __init__(self, source: torch.nn.Linear, storage: str, device: torch.device | str | None = None):
        torch.nn.Module.__init__(self)  # no full-precision weight Parameter is ever allocated
        if source.weight.requires_grad:
            raise ValueError("low-bit storage is for frozen weights; this Linear's weight requires grad")
        device = torch.device(device) if device is not None else source.weight.device
        self.in_features, self.out_features = source.in_features, source.out_features
        self.storage = storage
        self.weight_shape = source.weight.shape
        floating = (torch.float32, torch.float16, torch.bfloat16)
        self.compute_dtype = source.weight.dtype if source.weight.dtype in floating else torch.bfloat16
        packed = quantize(source.weight.to(device), storage)
        self._packed_names = tuple(packed)
        for name, tensor in packed.items():
            self.register_buffer(f"weight_{name}", tensor)
        bias = None
        if source.bias is not None:
            bias = torch.nn.Parameter(source.bias.detach().to(device, copy=True), requires_grad=False)
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        return dequantize(self._packed(), self.storage, self.weight_shape, self.compute_dtype)

    def _packed(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, f"weight_{name}") for name in self._packed_names}

    def packed_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._packed().values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = [getattr(self, f"weight_{name}") for name in self._packed_names]
        return _DequantLinear.apply(x, self.storage, self.weight_shape, self._packed_names, *packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, storage={self.storage}"


def _split(path: str) -> tuple[str, str]:
    parent, _, child = path.rpartition(".")
    return parent, child


def is_quantized_tensor(tensor) -> bool:
    """ComfyUI's QuantizedTensor (comfy_kitchen: fp8 / int8 / nvfp4 data and its scales, what the stock loaders build
    for a scaled fp8 file; a Parameter made of one keeps its type). By name: the engine imports without ComfyUI."""
    return type(tensor).__name__ == "QuantizedTensor"


def is_quantized_layer(module: torch.nn.Module) -> bool:
    """A layer whose weight is ComfyUI's QuantizedTensor: stored low-bit already, trained as it is."""
    return is_quantized_tensor(getattr(module, "weight", None))


class LowBitBase:
    """Low-bit copies of the frozen Linear layers under `prefixes` of `root`, swapped in and out.

    Built once per run (quantising costs one pass over the weights); `attach()` / `detach()` swap the very
    same module objects in and out, so adapters built on the LowBitLinears stay valid across re-attaches.
    `device`: where the packed weights live (the compute device, or the host for streamed blocks).
    """

    def __init__(self, root: torch.nn.Module, storage: str, device: torch.device | str,
                 prefixes: Iterable[str] | None = None):
        if storage not in STORAGES:
            raise ValueError(f"low-bit storage {storage!r} is not one of {', '.join(STORAGES)}")
        prefixes = tuple(prefixes) if prefixes is not None else None
        self.root = root
        self.storage = storage
        self.originals: dict[str, torch.nn.Linear] = {}
        self.replacements: dict[str, LowBitLinear] = {}
        already = []  # ComfyUI's quantized layers (a scaled fp8 file): stored low-bit already, never re-stored
        with torch.no_grad():
            for path, module in root.named_modules():
                if is_quantized_layer(module):
                    already.append(path)
                if type(module) is LowBitLinear or not isinstance(module, torch.nn.Linear):
                    continue
                if prefixes is not None and not any(path == p or path.startswith(p + ".") for p in prefixes):
                    continue
                if module.weight.requires_grad:
                    continue
                if getattr(module, "weight_function", None) or getattr(module, "bias_function", None):
                    raise ValueError(
                        f"low-bit storage: {path} carries weight patches (a LoRA applied to the MODEL by ComfyUI); "
                        "a low-bit copy would drop them: train on the model without that LoRA, or use 'as_loaded'"
                    )
                self.originals[path] = module
                self.replacements[path] = LowBitLinear(module, storage, device)
        if not self.replacements:
            if already:
                raise ValueError(f"low-bit storage {storage!r}: this MODEL's layers are stored quantized already "
                                 f"({len(already)} layers, e.g. {already[0]}: a scaled fp8 / int8 / nvfp4 file, "
                                 "trained as they are): set the Offload Policy (Headroom)'s base_storage to as_loaded")
            raise ValueError(f"low-bit storage {storage!r}: no frozen Linear layers found to store in low bits")
        self.attached = False
        self.attach()

    def attach(self) -> None:
        if self.attached:
            return
        self._swap(self.originals, self.replacements)
        self.attached = True

    def detach(self) -> None:
        if not self.attached:
            return
        self._swap(self.replacements, self.originals)
        self.attached = False

    def _swap(self, expected: dict, new: dict) -> None:
        for path, module in new.items():
            parent_path, child = _split(path)
            parent = self.root.get_submodule(parent_path)
            current = getattr(parent, child)
            if current is not expected[path]:
                raise RuntimeError(f"low-bit storage: {path} was replaced by someone else "
                                   f"({type(current).__name__}); detach adapters before the low-bit base")
            setattr(parent, child, module)

    def packed_bytes(self) -> int:
        return sum(m.packed_bytes() for m in self.replacements.values())

    def original_bytes(self) -> int:
        return sum(m.weight.numel() * m.weight.element_size() for m in self.originals.values())


# --- what it costs (the planner adds it up: planner.estimate) ---------------------------------------------------
def stored_bytes(storage: str, param_bytes: int, linear_weight_bytes: int, linear_numel: int, linear_count: int,
                 linear_rows: int) -> int:
    """Device bytes of a block's frozen weights (`param_bytes` as loaded, of which `linear_weight_bytes` in
    `linear_count` Linear weights of `linear_numel` values and `linear_rows` output rows) with its Linear weights
    stored as `storage`: fp8 one byte a value + one fp32 scale per tensor; int8 one byte + one fp32 scale per row;
    nf4 half a byte + one fp32 absmax per 64 values + bitsandbytes' quant state per tensor."""
    if storage == "as_loaded" or linear_count == 0:
        return param_bytes
    packed = {
        "fp8": linear_numel + 4 * linear_count,
        "int8": linear_numel + 4 * linear_rows,
        "nf4": linear_numel // 2 + 4 * math.ceil(linear_numel / 64) + 64 * linear_count,
    }[storage]
    return param_bytes - linear_weight_bytes + packed


def copies_kept(storage: str, weight_copy_bytes: int, linear_copy_bytes: int) -> int:
    """Bytes of weight copies a block's forward keeps for backward (ComfyUI's manual cast): low-bit Linear layers keep
    only the packed weight (_DequantLinear), so their part (`linear_copy_bytes`) goes."""
    return weight_copy_bytes if storage == "as_loaded" else max(0, weight_copy_bytes - linear_copy_bytes)


def weight_in_flight(storage: str, copy_in_flight_bytes: int, largest_linear_numel: int, element_size: int) -> int:
    """One layer's weight made for its product and freed after it: the cast copy as loaded (`copy_in_flight_bytes`),
    or, stored low-bit, at least the largest Linear weight dequantised to the compute dtype."""
    if storage == "as_loaded":
        return copy_in_flight_bytes
    return max(copy_in_flight_bytes, largest_linear_numel * element_size)
