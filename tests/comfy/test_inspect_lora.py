"""Inspect LoRA (Headroom): its report of what the stock Load LoRA applies of a file is what the stock LoraLoader does
(the weights it patches, the keys it logs as not loaded, the layers whose shapes make it log an error), for files
that fit, files for another family, text-encoder layers with and without the CLIP, misfit shapes; its metadata and
trigger words read from untrusted fields (tiny models, in-process, CPU)."""
from __future__ import annotations

import json

import pytest
import torch

from test_lora_formats import _patched_weights, _save_both, _write_lora
from test_lora_merge import _read_state, _text_encoder_lora

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]


def _inspect(name: str, model=None, clip=None):
    from headroom.nodes import train_lora as T

    with torch.inference_mode():
        return T.HeadroomInspectLora.execute(name, model, clip)


def _check(name: str, model, clip):
    from headroom.nodes.bridge.inspect_lora import applied_by_load_lora

    return applied_by_load_lora(_read_state(name), model, clip)


def _stock(name: str, model, clip, caplog) -> tuple[int, int, int, int]:
    """What the stock LoraLoader does with `name` (on the model, and the CLIP where given): (model weights it
    patches with a change, CLIP weights alike, "lora key not loaded" warnings, layers it logs an error for)."""
    import comfy.lora
    import nodes

    caplog.clear()
    with torch.inference_mode():
        if clip is None:
            lora_model = nodes.LoraLoaderModelOnly().load_lora_model_only(model, name, 1.0)[0]
            lora_clip = None
        else:
            lora_model, lora_clip = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 1.0)
        not_loaded = caplog.text.count("lora key not loaded")
        base = model.model.state_dict()
        patched = _patched_weights(lora_model)
        changed_model = sum(not torch.equal(patched[k], base[k].float()) for k in patched)
        changed_clip = 0
        if lora_clip is not None:
            clip_base = clip.cond_stage_model.state_dict()
            for key, patches in lora_clip.patcher.patches.items():
                weight = comfy.lora.calculate_weight(patches, clip_base[key].float().clone(), key)
                changed_clip += not torch.equal(weight, clip_base[key].float())
    errors = sum(record.levelname == "ERROR" and record.getMessage().startswith(
        ("ERROR lora ", "ERROR loha ", "ERROR lokr ", "ERROR oft ", "ERROR boft ", "ERROR glora "))
        for record in caplog.records)
    return changed_model, changed_clip, not_loaded, errors


def test_the_report_is_what_the_stock_loader_does(comfyui, caplog):
    """A trained SD1.5 LoRA (ComfyUI's names), and a kohya file with text-encoder layers, one layer misfit and keys
    of another family's: each count in the report is the stock loader's, on the MODEL alone and with the CLIP."""
    model, clip, run, comfy_name, kohya_name = _save_both("sd15", "lora")
    report, words = _inspect(comfy_name, model, clip).args
    check = _check(comfy_name, model, clip)
    assert report.startswith(f"OK: Load LoRA patches {check.model_weights} weights of the diffusion model (sd15) and "
                             "0 weights of the CLIP"), report
    assert (check.model_weights, check.clip_weights, 0, 0) == _stock(comfy_name, model, clip, caplog)
    assert "ComfyUI (diffusion_model.* / text_encoders.*) names" in report and "LoRA " in report
    assert words and report.splitlines()[-1] == f"trigger words: {words}"

    state = dict(_read_state(kohya_name)) | _text_encoder_lora(clip, "te", 2, 1.0, torch.float32, 0)
    down = next(k for k in sorted(state) if k.endswith(".lora_down.weight") and k.startswith("lora_unet_"))
    state[down] = torch.zeros(state[down].shape[0], state[down].shape[1] + 1)  # one layer for another width
    state["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"] = torch.zeros(4, 8)  # Flux's names
    state["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"] = torch.zeros(8, 4)
    name = _write_lora("inspect_mixed", state, {})
    layers = sum(k.endswith(".lora_down.weight") for k in state)
    text_tensors = sum(k.startswith("lora_te_") for k in state)

    check = _check(name, model, None)  # the MODEL alone: the text-encoder layers are said, not counted as skipped
    assert len(check.text_encoder) == text_tensors and len(check.skipped) == 2 and len(check.misfits) == 1
    assert (check.model_weights, 0, len(check.skipped) + len(check.text_encoder), 1) == \
        _stock(name, model, None, caplog)
    assert check.model_weights == layers - 3 - 1 - 1  # three text-encoder layers, the misfit, Flux's layer
    report = _inspect(name, model).args[0]
    lines = report.splitlines()
    assert lines[0].startswith("PARTLY APPLIES: Load LoRA patches"), report
    assert lines[1].startswith(f"! {text_tensors} text-encoder tensors (e.g. lora_te_"), report
    assert "connect the CLIP" in lines[1]
    assert lines[2].startswith(f"! 2 of its {len(state)} tensors match no weight of this MODEL") and \
        "lora_unet_double_blocks_0_img_attn_qkv" in lines[2], report
    assert lines[3].startswith("! 1 layer does not fit the shape of the weight it patches"), report
    assert "kohya (lora_unet_* / lora_te_*) names" in report and f"LoRA {layers}" in report

    check = _check(name, model, clip)  # with the CLIP: its three layers patched, as the stock loader's
    assert (check.model_weights, check.clip_weights, 2, 1) == _stock(name, model, clip, caplog)
    assert check.clip_weights == 3 and not check.text_encoder
    report = _inspect(name, model, clip).args[0]
    assert "and 3 weights of the CLIP" in report.splitlines()[0] and "match no weight of this MODEL or CLIP" in report
    # the CLIP alone (as load_lora_for_models takes it without a model): the diffusion model's layers are skipped
    report = _inspect(name, None, clip).args[0]
    assert report.startswith("PARTLY APPLIES: Load LoRA patches 3 weights of the CLIP\n"), report
    assert f"! {len(state) - text_tensors} of its {len(state)} tensors match no weight of this CLIP" in report


@pytest.mark.parametrize("family", ["sd15", "flux"])
def test_every_format_save_lora_writes_applies_whole(comfyui, caplog, family):
    """Save LoRA's three formats of one trained adapter: each applies whole, as the stock loader applies it, and is
    named by its format (SD1.5's diffusers file in diffusers' older attention-processor names, Flux's in PEFT's)."""
    from test_lora_formats import _save

    model, clip, run, comfy_name, kohya_name = _save_both(family, "lora")
    diffusers_name = _save(run, f"{family}_inspect_diffusers", "diffusers")
    for name, names in ((comfy_name, "ComfyUI"), (kohya_name, "kohya"), (diffusers_name, "diffusers / PEFT")):
        report = _inspect(name, model, clip).args[0]
        check = _check(name, model, clip)
        assert report.startswith(f"OK: Load LoRA patches {check.model_weights} weights"), report
        assert f", {names} (" in report.splitlines()[1], report
        assert (check.model_weights, 0, 0, 0) == _stock(name, model, clip, caplog)


def test_a_file_for_another_family_applies_nothing_and_says_so(comfyui, caplog):
    """An SD1.5 LoRA on a Flux MODEL: the stock loader patches nothing and only logs; the node says so first."""
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    _, _, _, comfy_name, _ = _save_both("sd15", "lora")
    with torch.inference_mode():
        flux, _, _ = build_tiny_models("flux", 0)
    tensors = len(_read_state(comfy_name))
    assert _stock(comfy_name, flux, None, caplog) == (0, 0, tensors, 0)
    report = _inspect(comfy_name, flux).args[0]
    assert report.startswith("NOTHING APPLIES: Load LoRA patches 0 weights of the diffusion model (flux)"), report
    assert f"! {tensors} of its {tensors} tensors match no weight of this MODEL" in report
    assert "for another model family" in report


def test_without_a_model_it_describes_the_file(comfyui):
    """No MODEL: format, kinds, ranks, dtypes and metadata; the report asks for the MODEL to check more."""
    from headroom.nodes import train_lora as T

    model, _, run, _, kohya_name = _save_both("sd15", "loha")
    report, words = _inspect(kohya_name).args
    assert report.startswith("connect the MODEL (and the CLIP) to see what Load LoRA applies of it"), report
    assert "LoHa " in report and "kohya (lora_unet_* / lora_te_*) names" in report and "float32" in report
    assert "sd_v1 (base model)" in report and "trained: steps 2" in report, report
    # with the MODEL: every LoHa layer's shape checked, and all fit
    check = _check(kohya_name, model, None)
    assert check.model_weights > 0 and check.unchecked == 0 and not check.problems
    assert _inspect(kohya_name, model).args[0].startswith("OK: Load LoRA patches")
    assert T.HeadroomInspectLora.define_schema().is_output_node


@pytest.mark.parametrize("family,kind,tensor", [("sd15", "loha", "hada_w1_b"), ("sd15", "oft", "oft_blocks"),
                                                ("flux", "lokr", "lokr_w")])
def test_loha_lokr_and_oft_layers_that_do_not_fit_are_the_ones_the_stock_loader_leaves_out(comfyui, caplog, family,
                                                                                           kind, tensor):
    """LoHa ((w1a @ w1b) * (w2a @ w2b)), LoKr (kron(w1, w2)) and OFT (block-diagonal rotation of the rows) as ComfyUI's
    weight adapters compute them: a trained file fits whole; with one layer made for another width (LoHa's products
    one column wider, a LoKr factor one row taller, OFT one block more) that layer is the one the stock loader logs an
    error for and leaves out, and every count of the report is the stock loader's."""
    model, _, _, comfy_name, _ = _save_both(family, kind)
    check = _check(comfy_name, model, None)
    assert check.model_weights > 0 and check.unchecked == 0 and not check.problems
    assert (check.model_weights, 0, 0, 0) == _stock(comfy_name, model, None, caplog)

    state = dict(_read_state(comfy_name))
    key = next(k for k in sorted(state) if k.rsplit(".", 1)[-1].startswith(tensor) and state[k].dim() >= 2)
    layer = key.rsplit(".", 1)[0]
    if kind == "loha":  # both products one column wider: they multiply, and their product is not the weight's size
        for part in ("hada_w1_b", "hada_w2_b"):
            rows, cols = state[f"{layer}.{part}"].shape
            state[f"{layer}.{part}"] = torch.zeros(rows, cols + 1)
    else:  # a LoKr factor one row taller, OFT one block more
        grown = list(state[key].shape)
        grown[0] += 1
        state[key] = torch.zeros(grown)
    name = _write_lora(f"inspect_misfit_{kind}", state, {})
    check = _check(name, model, None)
    assert len(check.misfits) == 1 and check.unchecked == 0, (check.misfits, key)
    assert (check.model_weights, 0, 0, 1) == _stock(name, model, None, caplog)
    report = _inspect(name, model).args[0]
    assert report.startswith("PARTLY APPLIES") and "! 1 layer does not fit the shape of the weight it patches" in \
        report, report


def _lycoris_layers(model, grown: bool) -> dict[str, torch.Tensor]:
    """Hand-made layers of the kinds Headroom does not train, for the tiny SD1.5 model in ComfyUI's names: a LoCon
    with a Tucker core on a 3x3 convolution, a LoRA naming its weight's shape (reshape_weight), BOFT on a linear, GLoRA
    on a linear (the newer form) and on a square linear whose rank equals its rows (LyCORIS' old form). `grown`: each
    made for another width, one column or block more where ComfyUI multiplies them inside its error handling."""
    g = torch.Generator().manual_seed(0)
    weights = model.model.state_dict()
    conv = next(k for k, w in sorted(weights.items()) if w.dim() == 4 and w.shape[2:] == (3, 3) and w.shape[1] >= 8)
    linears = [k for k, w in sorted(weights.items()) if w.dim() == 2 and k.endswith(".weight")]
    boft = next(k for k in linears if weights[k].shape[0] % 8 == 0)
    glora = next(k for k in linears if weights[k].shape[0] != weights[k].shape[1] and k != boft)
    square = next(k for k in linears if weights[k].shape[0] == weights[k].shape[1] and k not in (boft, glora))
    reshaped = next(k for k in linears if k not in (boft, glora, square))
    more = int(grown)

    def name(key: str) -> str:
        return key.removeprefix("diffusion_model.").removesuffix(".weight").join(("diffusion_model.", ""))

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    out_c, in_c = weights[conv].shape[:2]
    rows, cols = weights[glora].shape
    side = weights[square].shape[0]
    state = {
        f"{name(conv)}.lora_up.weight": rand(out_c, 2 + more, 1, 1),
        f"{name(conv)}.lora_down.weight": rand(2, in_c, 1, 1),
        f"{name(conv)}.lora_mid.weight": rand(2, 2, 3, 3),
        f"{name(reshaped)}.lora_up.weight": rand(weights[reshaped].shape[0], 2),
        f"{name(reshaped)}.lora_down.weight": rand(2, weights[reshaped].shape[1] + more),
        f"{name(reshaped)}.reshape_weight": torch.tensor(list(weights[reshaped].shape)),
        f"{name(boft)}.oft_blocks": rand(2, weights[boft].shape[0] // 4 + more, 4, 4),
        f"{name(boft)}.alpha": torch.tensor(1.0),  # its constraint (ComfyUI 0.33 fails a BOFT layer without one)
        f"{name(glora)}.a1.weight": rand(cols, 2), f"{name(glora)}.a2.weight": rand(2, cols),
        f"{name(glora)}.b1.weight": rand(rows, 2), f"{name(glora)}.b2.weight": rand(2, cols + more),
        f"{name(square)}.a1.weight": rand(3, side), f"{name(square)}.a2.weight": rand(side, 3),
        f"{name(square)}.b1.weight": rand(3, side), f"{name(square)}.b2.weight": rand(side + more, 3),
    }
    return state


@pytest.mark.parametrize("grown", [False, True])
def test_locon_tucker_reshaped_boft_and_glora_layers_are_checked_as_the_stock_loader_computes_them(comfyui, caplog,
                                                                                                   grown):
    """The kinds Headroom does not train but Load LoRA reads (LoCon's Tucker core, a reshaped weight, BOFT, GLoRA
    in both its forms): a file of layers that fit is applied whole, with nothing left unchecked; the same layers made
    for another width are the ones the stock loader logs an error for and leaves out, every count the stock
    loader's."""
    from test_train_lora_nodes import _data

    model = _data("sd15")[0]
    name = _write_lora(f"inspect_lycoris_{grown}", _lycoris_layers(model, grown), {})
    check = _check(name, model, None)
    assert check.unchecked == 0 and not check.skipped and not check.lacking, check
    assert len(check.misfits) == (5 if grown else 0), check.misfits
    assert (check.model_weights, 0, 0, len(check.misfits)) == _stock(name, model, None, caplog)
    assert check.model_weights == (0 if grown else 5)


def test_a_tucker_core_or_reshape_that_does_not_fit_is_a_misfit_and_fails_the_stock_sampling(comfyui):
    """ComfyUI folds a LoCon's Tucker core into its down weight, and pads the weight to a LoRA's reshape_weight,
    before its error handling: one that does not fit raises when the model is patched for sampling. The report
    counts it a misfit."""
    import comfy.lora
    import nodes
    from test_train_lora_nodes import _data

    model = _data("sd15")[0]
    state = _lycoris_layers(model, False)
    layers = {key.rsplit(".", 2)[0] for key in state if key.endswith(".lora_mid.weight")}
    reshaped = next(key for key in state if key.endswith(".reshape_weight"))
    for broken, change in (("mid", lambda layer: {f"{layer}.lora_mid.weight": torch.zeros(3, 2, 3, 3)}),
                           ("reshape", lambda layer: {reshaped: state[reshaped] - 1})):
        bad = {**state, **change(next(iter(layers)))}
        name = _write_lora(f"inspect_bad_{broken}", bad, {})
        assert len(_check(name, model, None).misfits) == 1, broken
        with torch.inference_mode():
            patched = nodes.LoraLoaderModelOnly().load_lora_model_only(model, name, 1.0)[0]
        base = patched.model.state_dict()
        with pytest.raises(RuntimeError if broken == "mid" else ValueError):
            for key, patches in patched.patches.items():
                comfy.lora.calculate_weight(patches, base[key].float().clone(), key)


def test_a_boft_layer_without_alpha_is_one_the_stock_loader_leaves_out(comfyui, caplog):
    """ComfyUI 0.33 compares a BOFT layer's alpha with 0 inside its error handling: without one it logs an error and
    leaves the layer out; the report counts it with the misfits, as the stock loader's counts."""
    from test_train_lora_nodes import _data

    model = _data("sd15")[0]
    state = {key: value for key, value in _lycoris_layers(model, False).items() if not key.endswith(".alpha")}
    name = _write_lora("inspect_boft_no_alpha", state, {})
    check = _check(name, model, None)
    assert len(check.misfits) == 1 and check.unchecked == 0, check.misfits
    assert (check.model_weights, 0, 0, 1) == _stock(name, model, None, caplog)


def test_metadata_and_trigger_words_from_untrusted_fields(comfyui):
    """Trigger words: modelspec's phrase first, else the most frequent tags summed over datasets; values with control
    characters, huge or malformed JSON are shown cut to one line or left out, never a failure."""
    model, _, _, comfy_name, _ = _save_both("sd15", "lora")
    state = _read_state(comfy_name)
    tags = json.dumps({"a": {"ohwx": 5, "red": 2, "bad": -1, "worse": True}, "b": {"red": 4}, "c": [1]})
    name = _write_lora("inspect_tags", state, {"ss_tag_frequency": tags, "ss_steps": "12\n\x1b[31mred",
                                               "modelspec.architecture": "x" * 5000})
    report, words = _inspect(name, model).args
    assert words == "red, ohwx", words
    assert "trained: steps 12 [31mred" in report and "\x1b" not in report
    assert "x" * 157 + "... (architecture)" in report and "x" * 161 not in report
    merged = _write_lora("inspect_merged_from", state, {"headroom.merged_from": json.dumps(
        [{"lora": "a.safetensors", "strength": 0.5}, {"lora": "b\nc.safetensors", "strength": -1}])})
    assert "merged from a.safetensors x 0.5 + b c.safetensors x -1" in _inspect(merged, model).args[0]
    merged = _write_lora("inspect_merged_from", state, {"headroom.merged_from": '[{"lora": 1}]'})
    assert 'merged from [{"lora": 1}]' in _inspect(merged, model).args[0]
    phrase = _write_lora("inspect_phrase", state, {"ss_tag_frequency": tags, "modelspec.trigger_phrase": "sks dog, \n"})
    assert _inspect(phrase, model).args[1] == "sks dog"
    for bad in ("{", "[1, 2]", "x" * (5 << 20), '{"a": {"t": NaN}}'):
        assert _inspect(_write_lora("inspect_bad_tags", state, {"ss_tag_frequency": bad}), model).args[1] == ""


def test_a_file_the_reader_cannot_use_is_refused_by_name(comfyui):
    from headroom.nodes import train_lora as T

    with pytest.raises(ValueError, match=r"Inspect LoRA \(Headroom\).*not_there.safetensors.*models/loras"):
        T.HeadroomInspectLora.execute("not_there.safetensors")
    for hostile in ("../../../../etc/passwd", "/etc/passwd", "x\x00y.safetensors", "..\\..\\x", None, 7):
        with pytest.raises(ValueError, match=r"^Inspect LoRA \(Headroom\): LoRA file .* is not in models/loras/"):
            T.HeadroomInspectLora.execute(hostile)
        assert T.HeadroomInspectLora.fingerprint_inputs(lora_name=hostile) == "not found"
    name = _write_lora("inspect_no_tensors", {"x": torch.zeros(1, dtype=torch.int8)}, {})
    report = _inspect(name).args[0]
    assert "layers: none found" in report


def test_a_file_comfyui_cannot_read_is_said_not_raised(comfyui):
    """An alpha of two numbers: the stock LoraLoader raises on it; the report says so and still shows the file."""
    import nodes
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    _, _, _, comfy_name, _ = _save_both("sd15", "lora")
    state = dict(_read_state(comfy_name))
    alpha = next(k for k in sorted(state) if k.endswith(".alpha"))
    state[alpha] = torch.ones(2)
    name = _write_lora("inspect_two_alphas", state, {})
    with torch.inference_mode():
        model, clip, _ = build_tiny_models("sd15", 0)
        with pytest.raises(Exception):
            nodes.LoraLoader().load_lora(model, clip, name, 1.0, 1.0)
    report = _inspect(name, model, clip).args[0]
    assert report.startswith("NOTHING APPLIES") and "! Load LoRA cannot read it: RuntimeError" in report, report
    assert "layers: LoRA" in report


def test_a_safetensors_file_is_read_from_its_header_with_the_same_report(comfyui, monkeypatch):
    """The header's shapes and dtypes (alphas read) give the report the whole file gives, without reading the
    file's tensors; a .pt file (torch's weights-only reader, as Load LoRA's) is read whole, to the same report."""
    import comfy.utils
    import folder_paths
    from headroom.nodes.bridge import inspect_lora

    model, clip, _, comfy_name, kohya_name = _save_both("sd15", "lora")
    state = dict(_read_state(kohya_name)) | _text_encoder_lora(clip, "te", 2, 1.0, torch.bfloat16, 0)
    mixed = _write_lora("inspect_header_mixed", state, {"ss_tag_frequency": json.dumps({"d": {"ohwx": 2}})})
    torch.save(state, folder_paths.get_folder_paths("loras")[0] + "/formats/inspect_header_mixed.pt")
    folder_paths.filename_list_cache.pop("loras", None)
    whole = {}
    with monkeypatch.context() as patch:
        patch.setattr(inspect_lora, "header_state", lambda path: None)
        for name in (comfy_name, mixed):
            whole[name] = _inspect(name, model).args
    with monkeypatch.context() as patch:
        patch.setattr(comfy.utils, "load_torch_file", lambda *a, **k: pytest.fail("the whole file was read"))
        for name in (comfy_name, mixed):
            assert _inspect(name, model).args == whole[name]
    pt_report, pt_words = _inspect("formats/inspect_header_mixed.pt", model).args
    assert pt_words == "" and [line for line in pt_report.splitlines() if not line.startswith(("file:", "trigger"))] \
        == [line for line in whole[mixed][0].splitlines() if not line.startswith(("file:", "trigger"))]
    assert "(bfloat16, float32)" in whole[mixed][0] and "(bfloat16, float32)" in pt_report


def test_peft_attention_names_the_stock_map_lacks_are_said_with_the_fix(comfyui, caplog):
    """An SD1.5 LoRA whose attention layers carry PEFT's names (`unet...attn1.to_q.lora_A.weight`, as diffusers'
    training scripts write them; here every layer of the trained file, as its targets are attention's): ComfyUI 0.33's
    map lacks them and Load LoRA skips those layers. The report says so, and that Merge LoRAs rewrites the file; the
    rewritten file applies whole, every weight the original patched."""
    import comfy.lora
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.lora_formats import _with_peft_attention_names

    model, clip, _, comfy_name, _ = _save_both("sd15", "lora")
    stock_map = comfy.lora.model_lora_keys_unet(model.model, {})
    peft_of = {target: name for name, target in _with_peft_attention_names(stock_map).items()
               if name not in stock_map and isinstance(target, str)}
    state, renamed = {}, 0
    for key, tensor in _read_state(comfy_name).items():
        layer, _, suffix = key.partition(".lora_")
        peft = peft_of.get(layer + ".weight") if suffix else None
        if peft is None:
            state[key] = tensor
        elif suffix == "up.weight":  # PEFT keeps no alpha: its scale folded into B
            rank = state.get(f"{peft}.lora_A.weight", _read_state(comfy_name)[f"{layer}.lora_down.weight"]).shape[0]
            state[f"{peft}.lora_B.weight"] = tensor * (float(_read_state(comfy_name)[f"{layer}.alpha"]) / rank)
            renamed += 1
        elif suffix == "down.weight":
            state[f"{peft}.lora_A.weight"] = tensor
    state = {k: v for k, v in state.items() if not (k.endswith(".alpha") and k[:-len(".alpha")] + ".weight" in peft_of)}
    assert renamed > 0
    name = _write_lora("inspect_peft_attention", state, {})
    full = _check(comfy_name, model, clip)
    check = _check(name, model, clip)
    assert check.peft_names and len(check.skipped) == 2 * renamed
    assert (check.model_weights, 0, 2 * renamed, 0) == _stock(name, model, clip, caplog)
    assert check.model_weights == full.model_weights - renamed
    report = _inspect(name, model, clip).args[0]
    assert report.startswith("NOTHING APPLIES" if not check.model_weights else "PARTLY APPLIES"), report
    assert "-> they are diffusers / PEFT attention names" in report, report
    with torch.inference_mode():
        rewritten = T.HeadroomMergeLoras.execute(model, 0, 0.0, "formats", "inspect_peft_rewritten", "auto",
                                                 lora_1=name, strength_1=1.0).args[0]
    assert _inspect(rewritten, model, clip).args[0].startswith(
        f"OK: Load LoRA patches {full.model_weights} weights of the diffusion model")
    assert not _check(comfy_name, model, clip).peft_names  # said only where it is the whole story


def test_a_file_saved_again_under_its_name_is_inspected_again(comfyui):
    """ComfyUI reruns a node whose fingerprint changed: the file's size and time are it."""
    import os

    import folder_paths
    from headroom.nodes import train_lora as T

    name = _write_lora("inspect_saved_again", {"a.lora_down.weight": torch.zeros(2, 4)}, {})
    first = T.HeadroomInspectLora.fingerprint_inputs(lora_name=name)
    assert T.HeadroomInspectLora.fingerprint_inputs(lora_name=name) == first
    path = folder_paths.get_full_path_or_raise("loras", name)
    _write_lora("inspect_saved_again", {"a.lora_down.weight": torch.zeros(4, 4)}, {})
    os.utime(path, ns=(1, 1))  # the same size would still differ by its time
    assert T.HeadroomInspectLora.fingerprint_inputs(lora_name=name) != first
    assert T.HeadroomInspectLora.fingerprint_inputs(lora_name="missing.safetensors") == "not found"
