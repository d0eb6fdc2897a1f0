"""Validation prompt lines with kohya's sample options (nodes/bridge/sample_prompts.py): what each option sets, and
each line that cannot be used refused with its line number, the option and what to do."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.comfyui


def test_options_are_read_and_the_rest_is_the_prompt(comfyui):
    from headroom.nodes.bridge.sample_prompts import SamplePrompt, parse_prompts

    lines, width, height = parse_prompts(
        "V", "a red fox, forest --n blurry, low quality --d 42 --s 28 --l 5.5 --g 3.5 --w 768 --h 512\n\n"
             "an owl--at night -- moon --W 768 --H 512\n  a plain prompt --w 768 --h 512  ", 512, 512)
    assert (width, height) == (768, 512)
    assert lines == [SamplePrompt("a red fox, forest", negative="blurry, low quality", seed=42, steps=28, cfg=5.5,
                                  guidance=3.5, width=768, height=512),
                     SamplePrompt("an owl--at night -- moon", width=768, height=512),  # dashes inside the text stay
                     SamplePrompt("a plain prompt", width=768, height=512)]
    assert lines[0].label == "a red fox, forest (seed 42, steps 28, cfg 5.5, guidance 3.5)"
    assert lines[1].label == lines[1].text
    assert parse_prompts("V", "", 64, 32) == ([], 64, 32)
    assert parse_prompts("V", "a --d 18446744073709551615", 64, 64)[0][0].seed == 2 ** 64 - 1


@pytest.mark.parametrize("line, message", [
    ("a --d 1 --d 2", r"--d is given twice"),
    ("--n only a negative", r"has options but no prompt before them"),
    ("a --d -1", r"--d '-1' is not a whole number"),
    ("a --d 18446744073709551616", r"above the largest seed"),
    ("a --s 0", r"--s 0: sampling steps go from 1 to 1000"),
    ("a --l inf", r"--l 'inf' is not a cfg scale"),
    ("a --w 500", r"--w 500: a size from 16 to 8192 pixels, a multiple of 8"),
    ("a --f 33", r"--f \(.*\) is not read from a prompt here: remove it and use the frames input"),
    ("a --g high", r"--g 'high' is not a guidance: give a number from 0 to 100"),
    ("a --neg blurry", r"--neg is not a sample option"),
])
def test_lines_that_cannot_be_used_are_refused_by_line_and_option(comfyui, line, message):
    from headroom.nodes.bridge.sample_prompts import parse_prompts

    with pytest.raises(ValueError, match=r"^Validate LoRA \(Headroom\): prompt line 2 \(.*" + message):
        parse_prompts("Validate LoRA (Headroom)", f"a cat\n{line}", 512, 512)
