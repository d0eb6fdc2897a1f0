"""Validation prompts with kohya's per-line sample options (sd-scripts' and musubi-tuner's sample prompt files):
`a red fox --n blurry --d 42 --s 28 --l 5.5 --w 768 --h 512`. Users paste those files; without reading the options
the text `--n blurry --d 42` would be encoded as part of the prompt, and the samples would show it, silently.

Read here: --n (negative prompt), --d (seed), --s (steps), --l (cfg), --g (embedded guidance, set on the prompt as the
stock FluxGuidance node sets it), --w / --h (size). Every other option is refused, naming it and the node input that
does its job: an option left in the prompt would be encoded as text. So is ai-toolkit's [trigger] placeholder, which
ai-toolkit fills in and which here would be encoded as written.
Hand-written: no library parses this format (sd-scripts and musubi-tuner each parse it inside their samplers).
"""
from __future__ import annotations

import dataclasses
import math
import re

from ...training.data.dataset import TRIGGER_PLACEHOLDER

# " --x value": an option starts at a space followed by two dashes and its letters (kohya splits lines on " --").
_OPTION = re.compile(r"\s--([A-Za-z]+)(?=\s|$)")
# Options of the other trainers' prompt files that no prompt line sets here: what to use instead.
_ELSEWHERE = {
    "ss": "the sampler_name input", "f": "the frames input",
    "fs": "the MODEL's own shift (a ModelSampling node before the training node)",
    "i": "the start_image input (image-to-video) or reference_images (edit models)",
    "cn": "the validation_control input (ControlNet runs)",
}
MAX_SIDE = 8192  # the width / height inputs' maximum


@dataclasses.dataclass(frozen=True)
class SamplePrompt:
    """One validation prompt; None: the node's setting."""
    text: str
    negative: str | None = None
    seed: int | None = None
    steps: int | None = None
    cfg: float | None = None
    guidance: float | None = None  # embedded guidance (Flux): FluxGuidance's value on the prompt
    width: int | None = None
    height: int | None = None

    @property
    def label(self) -> str:
        """The prompt as the grid names it: its text, and what its options change."""
        changed = [f"{name} {value}" for name, value in (("seed", self.seed), ("steps", self.steps), ("cfg", self.cfg),
                                                          ("guidance", self.guidance)) if value is not None]
        return f"{self.text} ({', '.join(changed)})" if changed else self.text


def parse_line(name: str, number: int, line: str) -> SamplePrompt:
    """Line `number` of node `name`'s prompts, its options read; a ValueError naming the line and option when one
    cannot be used."""
    if TRIGGER_PLACEHOLDER in line:
        raise ValueError(f"{name}: prompt line {number} ({line.strip()[:60]!r}) holds ai-toolkit's "
                         f"{TRIGGER_PLACEHOLDER} placeholder: write the trigger word itself in its place")
    parts = _OPTION.split(" " + line)  # [text, option, value, option, value, ...]
    text, options = parts[0].strip(), {}
    for option, value in zip(parts[1::2], parts[2::2]):
        key, value = option.lower(), value.strip()
        where = f"{name}: prompt line {number} ({line.strip()[:60]!r}): --{option}"
        if key in options:
            raise ValueError(f"{where} is given twice: keep one")
        if key in _ELSEWHERE:
            raise ValueError(f"{where} (another trainer's sample option) is not read from a prompt here: remove it "
                             f"and use {_ELSEWHERE[key]}")
        if key not in ("n", "d", "s", "l", "g", "w", "h"):
            raise ValueError(f"{where} is not a sample option (read here: --n negative, --d seed, --s steps, --l cfg, "
                             "--g guidance, --w / --h size): remove it, or it would be encoded as part of the prompt")
        options[key] = _value(where, key, value)
    if not text:
        raise ValueError(f"{name}: prompt line {number} ({line.strip()[:60]!r}) has options but no prompt before them")
    return SamplePrompt(text, negative=options.get("n"), seed=options.get("d"), steps=options.get("s"),
                        cfg=options.get("l"), guidance=options.get("g"), width=options.get("w"),
                        height=options.get("h"))


def _value(where: str, key: str, value: str):
    if key == "n":
        return value
    if key in ("l", "g"):
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and 0.0 <= number <= 100.0):
            what = "cfg scale" if key == "l" else "guidance"
            raise ValueError(f"{where} {value!r} is not a {what}: give a number from 0 to 100")
        return number
    if not re.fullmatch(r"\d{1,20}", value):
        raise ValueError(f"{where} {value!r} is not a whole number: give one (e.g. --{key} "
                         f"{ {'d': 42, 's': 28}.get(key, 512) })")
    number = int(value)
    if key == "d" and number > 0xFFFFFFFFFFFFFFFF:
        raise ValueError(f"{where} {value} is above the largest seed, {0xFFFFFFFFFFFFFFFF}")
    if key == "s" and not 1 <= number <= 1000:
        raise ValueError(f"{where} {value}: sampling steps go from 1 to 1000")
    if key in ("w", "h") and not (16 <= number <= MAX_SIDE and number % 8 == 0):
        raise ValueError(f"{where} {value}: a size from 16 to {MAX_SIDE} pixels, a multiple of 8 (as the width / "
                         "height inputs take)")
    return number


def parse_prompts(name: str, prompts: str, width: int, height: int) -> tuple[list[SamplePrompt], int, int]:
    """The non-empty lines of `prompts`, each with its options, and the samples' size: the node's `width` / `height`,
    or what the lines' --w / --h say. Every sample of a validation is one image of one IMAGE batch, so lines that
    would give different sizes are refused, saying so."""
    lines = [(number, line.strip()) for number, line in enumerate((prompts or "").splitlines(), start=1)
             if line.strip()]
    parsed = [parse_line(name, number, line) for number, line in lines]
    sizes = {(p.width or width, p.height or height) for p in parsed}
    if len(sizes) > 1:
        listed = ", ".join(f"{w}x{h}" for w, h in sorted(sizes))
        raise ValueError(f"{name}: the prompts' --w / --h give samples of several sizes ({listed}), and one "
                         "validation's samples are one IMAGE batch of one size: give every line the same --w / --h "
                         "(or none, and set width / height on the node)")
    (width, height), = sizes or {(width, height)}
    return parsed, width, height
