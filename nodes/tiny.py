"""The Tiny Model node: a tiny model of a real ComfyUI family with its text encoders and VAE (built in
nodes/bridge/tiny_models.py)."""
from __future__ import annotations

import torch

from comfy_api.latest import io

from .bridge.tiny_models import FAMILIES, WEIGHTS, build_tiny_models, tiny_spec


class HeadroomTinyModel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="HeadroomTinyModel",
            display_name="Tiny Model (Headroom)",
            category="Headroom/models",
            description="A tiny model of a real ComfyUI family (built from ComfyUI's own classes) with its text "
            "encoders and VAE: for trying workflows and tests on a CPU, no download. Random weights, or (sd15) the "
            "shipped pretrained ones that draw the synthetic shapes at 64x64, every colour except green.",
            inputs=[
                io.Combo.Input("family", options=list(FAMILIES), default="sd15",
                               tooltip="; ".join(tiny_spec(name).tooltip for name in FAMILIES) + "."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFF,
                             tooltip="Seed of the random weights (weights=random)."),
                # Appended last and optional: workflows saved before it existed keep working (random weights).
                io.Combo.Input("weights", options=list(WEIGHTS), default="random", optional=True,
                               tooltip="random: seeded random weights (draws noise). pretrained (sd15 only): the "
                               "shipped weights from workflows/pretrain_tiny.py, which draw 'a <colour> <shape> at "
                               "the <position>' at 64x64 in every synthetic colour except green (held out for the "
                               "demo's LoRA to teach); seed is then unused."),
            ],
            outputs=[io.Model.Output(tooltip="The diffusion model, as a checkpoint loader's MODEL."),
                     io.Clip.Output(tooltip="Its text encoder(s), as a checkpoint loader's CLIP."),
                     io.Vae.Output(tooltip="Its VAE (8x downscale; flux2: 16x; hunyuan_image: 32x), as a checkpoint "
                                          "loader's VAE.")],
        )

    @classmethod
    def execute(cls, family: str, seed: int, weights: str = "random") -> io.NodeOutput:
        with torch.inference_mode(False):
            # Weights made outside inference mode stay usable by training nodes downstream.
            return io.NodeOutput(*build_tiny_models(family, seed, weights))


NODES = [HeadroomTinyModel]
