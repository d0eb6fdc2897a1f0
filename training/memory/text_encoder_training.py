"""What a run that trains the CLIP's text encoders too (Train LoRA's text_encoder_lr) holds on the device in a training
step beside the diffusion model's own, for the planner (planner.estimate adds it to the step, so the model's share of
the budget shrinks by it).

- The CLIP as ComfyUI loads it for the step: every encoder it holds, a frozen T5 too (each step encodes its captions
  through the trained encoders as CLIP Text Encode does; Flux's and SD3's take T5's part from the text cache instead
  of running it, but ComfyUI loads T5 with the CLIP). Flux's CLIP with T5-XXL in fp16 is ~9.5 GB of it.
- What each caption's encode keeps for backward until the diffusion model's backward reaches the conditioning
  (measured with the LoRA attached: nodes/bridge/text_encoder_lora.text_encoder_training), times the captions of a
  step (one encode per item).

The text encoder's LoRA, its gradients and optimizer state are trained tensors like the model's adapters: their shapes
are in the TrainableSpec, so they are placed, parked on the host, averaged (EMA), checkpointed and saved as the model's.
Its compute joins the time model's work outside the blocks: each caption's encode as measured, and a backward priced
as that work's.
"""
from __future__ import annotations

import dataclasses

from .cost import FeatureCost

ITEMS = "text encoder "  # what the names of its items start with (planner.Plan.text_encoder_bytes)
WEIGHTS = ITEMS + "weights (the CLIP, loaded for each step's captions)"


@dataclasses.dataclass(frozen=True)
class TextEncoderTraining:
    """The device bytes of a text encoder trained beside the model, per step."""

    weight_bytes: int  # the CLIP as loaded (all its encoders, as stored)
    saved_bytes_per_caption: int  # what one caption's encode keeps for backward (its longest caption's, measured)
    layers: int = 0  # the text encoders' trained layers (for the plan's note)
    forward_s: float = 0.0  # one caption's encode, measured with the same forward (0: not timed)

    def __post_init__(self):
        if min(self.weight_bytes, self.saved_bytes_per_caption, self.forward_s) < 0:
            raise ValueError(f"text encoder figures must be >= 0, got {self.weight_bytes} / "
                             f"{self.saved_bytes_per_caption} / {self.forward_s}")

    def cost(self, captions: int) -> FeatureCost:
        """A step's cost with `captions` items (the micro-batch: each item encodes its caption)."""
        return FeatureCost(
            training={WEIGHTS: self.weight_bytes,
                      ITEMS + f"activations ({captions} caption{'s' if captions != 1 else ''})":
                          captions * self.saved_bytes_per_caption},
            training_notes=[f"the text encoder trains too ({self.layers} layers): its LoRA is counted with the "
                            "trained weights, its compute with the work outside the blocks"])
