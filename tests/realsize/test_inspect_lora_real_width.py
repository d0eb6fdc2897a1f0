"""Inspect LoRA at real width: the whole Flux.1-dev model (19 double and 38 single blocks, 3072 wide, on the meta
device: the node reads only names and shapes) and two rank-16 bf16 files of every block's linear layers: one in
kohya's names, and one in diffusers' whose q / k / v / MLP layers are rows of ComfyUI's fused qkv and linear1 (its
21504 x 3072 weight: past 2^24 elements), four of its layers made for SDXL's width. The counts in the report are what
the stock loader does: the weights ComfyUI's LoraLoader patches, its "lora key not loaded" warnings, and the layers
whose update it cannot compute (its per-layer error), found by computing each patched weight on the meta device. The
same for LoHa, LoKr, OFT, BOFT and GLoRA files of every block's linear layers, three of each made for another width."""
from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.comfyui, pytest.mark.realsize]

RANK = 16
SDXL_WIDTH = 2048


def _file(key_map: dict, shapes: dict, prefix: str, misfits: int = 0) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(A rank-16 LoRA (zeros: the report reads shapes) on every block layer the key map names with `prefix`, the
    first `misfits` layers' down weights SDXL's width; the model weights its fitting layers patch)."""
    state, fitting, seen = {}, set(), set()
    for name, target in sorted(key_map.items()):
        weight = target if isinstance(target, str) else target[0]
        if not name.startswith(prefix) or not weight.endswith(".weight") or len(shapes.get(weight, ())) != 2 or \
                not weight.startswith(("diffusion_model.double_blocks.", "diffusion_model.single_blocks.")) or \
                target in seen:  # ComfyUI's map has aliases (diffusers' proj_out and attn.to_out of linear2)
            continue
        seen.add(target)
        rows = shapes[weight][0] if isinstance(target, str) or target[1] is None else target[1][2]
        columns = SDXL_WIDTH if misfits > 0 else shapes[weight][1]
        if misfits <= 0:
            fitting.add(weight)
        misfits -= 1
        up, down = (f"{name}.lora_B.weight", f"{name}.lora_A.weight") if prefix == "transformer." else \
            (f"{name}.lora_up.weight", f"{name}.lora_down.weight")
        state |= {up: torch.zeros(rows, RANK, dtype=torch.bfloat16),
                  down: torch.zeros(RANK, columns, dtype=torch.bfloat16)}
        if prefix != "transformer.":
            state[f"{name}.alpha"] = torch.tensor(float(RANK))
    return state, fitting


def _stock(model, name: str, caplog) -> tuple[int, int, int]:
    """(weights the stock LoraLoader patches whose update it computes, keys it logs as not loaded, layers it logs
    an error for), each patched weight computed on the meta device as ComfyUI computes it when loading."""
    import comfy.lora
    import nodes

    def errors() -> int:
        return sum(record.getMessage().startswith(("ERROR lora ", "ERROR loha ", "ERROR lokr ", "ERROR oft ",
                                                   "ERROR boft ", "ERROR glora ")) for record in caplog.records)

    caplog.clear()
    applied = 0
    with torch.inference_mode():
        patched = nodes.LoraLoaderModelOnly().load_lora_model_only(model, name, 1.0)[0]
        not_loaded = caplog.text.count("lora key not loaded")
        caplog.clear()
        base = patched.model.state_dict()
        for key, patches in patched.patches.items():  # a weight is patched when one of its patches computes
            before = errors()
            comfy.lora.calculate_weight(patches, base[key], key, intermediate_dtype=torch.float32)
            applied += errors() - before < len(patches)
    return applied, not_loaded, errors()


def test_a_whole_flux_dev_lora_is_reported_as_the_stock_loader_applies_it(comfyui, caplog):
    import comfy.lora
    import realsize_models
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.inspect_lora import applied_by_load_lora
    from test_lora_formats import _write_lora

    model = realsize_models.build_model("flux_dev", device="meta")
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    shapes = {k: tuple(v.shape) for k, v in model.model.state_dict().items()}
    assert shapes["diffusion_model.single_blocks.0.linear1.weight"] == (21504, 3072) and 21504 * 3072 > 2 ** 24
    for prefix, misfits in (("lora_unet_", 0), ("transformer.", 4)):
        state, fitting = _file(key_map, shapes, prefix, misfits)
        name = _write_lora(f"flux_width_inspect_{prefix.strip('._')}", state, {})
        started = time.perf_counter()
        with torch.inference_mode():
            report = T.HeadroomInspectLora.execute(name, model).args[0]
        seconds = time.perf_counter() - started
        check = applied_by_load_lora(state, model, None)
        assert (check.model_weights, len(check.skipped), len(check.misfits)) == _stock(model, name, caplog)
        layers = sum(k.endswith(("lora_down.weight", "lora_A.weight")) for k in state)
        assert len(check.misfits) == misfits and not check.skipped and check.unchecked == 0
        # kohya's names: every linear weight of the 57 blocks, one layer each; diffusers' split the fused ones (q / k
        # / v of qkv, and the MLP's input of linear1) into more layers
        blocks = {w for w, s in shapes.items() if len(s) == 2 and w.endswith(".weight") and "_blocks." in w}
        assert check.model_weights == len(fitting) and fitting <= blocks
        assert layers == len(fitting) == len(blocks) if prefix == "lora_unet_" else layers > len(fitting) > 250
        first = report.splitlines()[0]
        assert first.startswith("PARTLY APPLIES" if misfits else "OK"), report
        assert (f"! {misfits} layers do not fit the shape" in report) == bool(misfits), report
        print(f"{prefix}: {layers} layers, {seconds:.2f} s; {first}")


def _lycoris_file(kind: str, shapes: dict, misfits: int) -> tuple[dict[str, torch.Tensor], int]:
    """(A LoHa / LoKr / OFT / BOFT / GLoRA file (zeros, bf16, kohya's names) on every linear weight of Flux's blocks,
    the first `misfits` layers made for another width: LoHa's products one column wider, LoKr's w1 one row taller,
    OFT and BOFT one block more, GLoRA's b2 one column wider; the number of its layers)."""
    state, layers = {}, 0
    for weight, shape in sorted(shapes.items()):
        if len(shape) != 2 or not weight.endswith(".weight") or \
                not weight.startswith(("diffusion_model.double_blocks.", "diffusion_model.single_blocks.")):
            continue
        name = "lora_unet_" + weight[len("diffusion_model."):-len(".weight")].replace(".", "_")
        (rows, columns), wrong = shape, int(layers < misfits)
        if kind == "loha":
            for factor in ("1", "2"):
                state |= {f"{name}.hada_w{factor}_a": torch.zeros(rows, RANK),
                          f"{name}.hada_w{factor}_b": torch.zeros(RANK, columns + wrong)}
        elif kind == "lokr":  # w1 4 x 4, w2 the rest as a rank-16 product (Flux's widths are multiples of 4)
            state |= {f"{name}.lokr_w1": torch.zeros(4 + wrong, 4), f"{name}.lokr_w2_a": torch.zeros(rows // 4, RANK),
                      f"{name}.lokr_w2_b": torch.zeros(RANK, columns // 4)}
        elif kind == "oft":  # blocks of 16 rows
            state[f"{name}.oft_blocks"] = torch.zeros(rows // 16 + wrong, 16, 16)
        elif kind == "boft":  # two butterfly stages of 16-row blocks (Flux's rows are multiples of 32)
            state[f"{name}.oft_blocks"] = torch.zeros(2, rows // 16 + wrong, 16, 16)
        else:  # GLoRA: (W a1) a2 + b1 b2, b2 one column wider
            state |= {f"{name}.a1.weight": torch.zeros(columns, RANK), f"{name}.a2.weight": torch.zeros(RANK, columns),
                      f"{name}.b1.weight": torch.zeros(rows, RANK),
                      f"{name}.b2.weight": torch.zeros(RANK, columns + wrong)}
        state[f"{name}.alpha"] = torch.tensor(float(RANK))
        layers += 1
    return {k: v.to(torch.bfloat16) if v.dim() else v for k, v in state.items()}, layers


@pytest.mark.parametrize("kind", ["loha", "lokr", "oft", "boft", "glora"])
def test_lycoris_files_of_a_whole_flux_dev_are_checked_as_the_stock_loader_computes_them(comfyui, caplog, kind):
    """Every linear layer of Flux.1-dev's 57 blocks (its 21504 x 3072 linear1: past 2^24 elements), three made for
    another width: the report says those three do not fit and every other weight is patched. For LoHa, LoKr and
    GLoRA that is the stock loader's count, each patched weight computed on the meta device as ComfyUI computes it;
    OFT's and BOFT's rotations need values (an inverse), so their count is the file's design here and the stock
    loader's at tiny width (tests/comfy/test_inspect_lora.py)."""
    import realsize_models
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.inspect_lora import applied_by_load_lora
    from test_lora_formats import _write_lora

    model = realsize_models.build_model("flux_dev", device="meta")
    shapes = {k: tuple(v.shape) for k, v in model.model.state_dict().items()}
    state, layers = _lycoris_file(kind, shapes, 3)
    assert layers > 300 and shapes["diffusion_model.single_blocks.0.linear1.weight"] == (21504, 3072)
    name = _write_lora(f"flux_width_inspect_{kind}", state, {})
    with torch.inference_mode():
        report = T.HeadroomInspectLora.execute(name, model).args[0]
    check = applied_by_load_lora(state, model, None)
    assert (check.model_weights, len(check.misfits), len(check.skipped), check.unchecked) == (layers - 3, 3, 0, 0)
    if kind not in ("oft", "boft"):
        assert (check.model_weights, 0, 3) == _stock(model, name, caplog)
    assert report.startswith(f"PARTLY APPLIES: Load LoRA patches {layers - 3} weights of the diffusion model"), report
    assert "! 3 layers do not fit the shape of the weight it patches" in report, report
