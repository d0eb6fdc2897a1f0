"""Tag shuffling (and tag dropout): other orders of a caption's comma-separated tags, for tag-captioned datasets.

kohya's `shuffle_caption` / `keep_tokens` shuffle the tags of a caption every step, before the text encoder. Headroom
trains on cached encodings, so the orders are drawn once, when the captions are cached: `tag_orders` gives, besides
the caption as written, up to `shuffles` other orders of its tags (the first `keep` tags stay in place: the trigger
word), each encoded and cached; training picks one of a caption's orders at random per item and step
(trainer `_SALT_TAGS`). Cost: the text cache holds (1 + shuffles) encodings per caption, and caching encodes as many.
Written here because no library does it for cached encodings; the orders are seeded by the caption, so caching the
same dataset again finds every order in the cache. With `dropout` (kohya's `caption_tag_dropout_rate`), each other
order also leaves out each of its shuffled tags with that probability, so no tag is always there to lean on.
"""
from __future__ import annotations

import hashlib
import itertools
import math
import random
import re
from collections import Counter

MAX_SHUFFLES = 16  # the node's limit: each order is one more encoding per caption on disk (a T5 prompt: ~2-4 MB)
MAX_KEEP = 64
TRIES_PER_ORDER = 64  # with dropout, distinct orders are drawn until this many tries per order have been made


def caption_lines(caption: str) -> list[str]:
    """A caption file's lines, stripped, empty ones left out: several lines are alternative captions of one image
    (OneTrainer's and kohya's wildcard convention), one picked per step."""
    return [line.strip() for line in caption.splitlines() if line.strip()]


MAX_LINES = 32  # alternative captions per caption file: more is likely not captions (a pasted document)
MAX_VARIANTS = 64  # texts cached per caption (lines x wildcard texts x tag orders): each is an encoding on disk


class TooManyVariants(ValueError):
    """A caption would be cached as more than MAX_VARIANTS texts; the message says what makes them."""


WILDCARD = re.compile(r"\{([^{}]*\|[^{}]*)\}")  # kohya's wildcard: {red|blue|green}, one option per step
MAX_WILDCARD_TEXTS = 16  # per line: more combinations are sampled (seeded by the line), the first options first


def wildcard_texts(line: str) -> list[str]:
    """The texts a line's `{a|b|c}` wildcards make (kohya's enable_wildcard): every combination of one option per
    group, the first options first, at most MAX_WILDCARD_TEXTS (sampled, seeded by the line, where there are
    more); a line without wildcards: itself. Braces without '|' are left as written."""
    groups = [match.group(1).split("|") for match in WILDCARD.finditer(line)]  # spaces kept, as written
    if not groups:
        return [line]
    parts = WILDCARD.split(line)[::2]  # the text around the groups

    def text(choice: tuple[int, ...]) -> str:
        joined = parts[0] + "".join(group[i] + part for group, i, part in zip(groups, choice, parts[1:]))
        return " ".join(joined.split())  # an empty option leaves no double space

    total = math.prod(len(group) for group in groups)
    if total <= MAX_WILDCARD_TEXTS:
        choices = list(itertools.product(*(range(len(group)) for group in groups)))
    else:
        rng = random.Random(hashlib.sha256(f"wildcards\x00{line}".encode("utf-8")).digest())
        choices = [tuple(0 for _ in groups)]
        while len(choices) < MAX_WILDCARD_TEXTS:  # total > 16 distinct: ends
            choice = tuple(rng.randrange(len(group)) for group in groups)
            if choice not in choices:
                choices.append(choice)
    return list(dict.fromkeys(text(choice) for choice in choices))


def caption_variants(caption: str, shuffles: int = 0, keep: int = 0, dropout: float = 0.0) -> list[str]:
    """Every text cached for a caption, the one used where no draw is made first: a one-line caption's tag orders
    (tag_orders: the caption as written first), or, for a caption of several lines, each line's tag orders in turn
    (the first line as written first), once each; a line with `{a|b}` wildcards, each text they make
    (wildcard_texts) with its tag orders. Training draws one per item and step, uniformly: a line with more tag
    orders is picked more often, in proportion to them."""
    lines = caption_lines(caption)
    if len(lines) < 2 and not WILDCARD.search(caption):
        return tag_orders(caption, shuffles, keep, dropout)
    if len(lines) > MAX_LINES:
        raise TooManyVariants(f"caption {lines[0][:60]!r}... has {len(lines)} lines (alternative captions); at most "
                              f"{MAX_LINES}")
    texts = [text for line in lines for text in wildcard_texts(line)]
    variants = list(dict.fromkeys(order for text in texts for order in tag_orders(text, shuffles, keep, dropout)))
    if len(variants) > MAX_VARIANTS:
        raise TooManyVariants(f"caption {lines[0][:60]!r} makes {len(variants)} texts to cache ({len(lines)} line(s), "
                              f"{len(texts)} with their wildcards, then their tag orders); at most {MAX_VARIANTS}, "
                              "each an encoding on disk: use fewer lines, wildcard options or tag_shuffles")
    return variants


def split_tags(caption: str) -> list[str]:
    """The caption's tags: its comma-separated parts, stripped, empty ones left out (kohya's split)."""
    return [tag.strip() for tag in caption.split(",") if tag.strip()]


def tag_frequency(captions) -> dict[str, int]:
    """How many of `captions` hold each tag (comma-separated, as kohya's ss_tag_frequency counts them: what Civitai and
    LoRA managers show as a LoRA's trained words), a tag counted once per caption whatever its lines hold; most
    frequent first."""
    counts: dict[str, int] = {}
    for caption in captions:
        for tag in dict.fromkeys(tag for line in caption_lines(caption) for tag in split_tags(line)):
            counts[tag] = counts.get(tag, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def tag_orders(caption: str, shuffles: int, keep: int, dropout: float = 0.0) -> list[str]:
    """The caption as written, then up to `shuffles` distinct other orders of its tags (the first `keep` in place),
    joined with ", ". Fewer where the tags have fewer orders (a caption without commas: none); the same caption,
    shuffles, keep and dropout give the same orders. `dropout`: each other order leaves out each tag after the
    first `keep` with this probability (the orders without dropout are the ones of before it existed)."""
    if not 0 <= shuffles <= MAX_SHUFFLES:
        raise ValueError(f"tag_shuffles={shuffles}: choose 0 (captions as written) to {MAX_SHUFFLES}")
    if not 0 <= keep <= MAX_KEEP:
        raise ValueError(f"keep_tags={keep}: choose 0 to {MAX_KEEP}")
    if not 0.0 <= dropout <= 1.0:  # NaN fails this too
        raise ValueError(f"tag_dropout={dropout}: choose 0 (every tag kept) to 1")
    tags = split_tags(caption)
    kept, moved = tags[:keep], tags[keep:]
    if dropout > 0 and shuffles > 0 and moved:
        return _orders_with_dropout(caption, kept, moved, shuffles, keep, dropout)
    if shuffles == 0 or len(moved) < 2:
        return [caption]
    distinct = math.factorial(len(moved)) // math.prod(math.factorial(n) for n in Counter(moved).values())
    wanted = min(shuffles, distinct - 1)  # every distinct order but the written one (a repeated tag: fewer)
    rng = random.Random(hashlib.sha256(f"{keep}\x00{caption}".encode("utf-8")).digest())
    seen, orders = {tuple(moved)}, [caption]
    while len(orders) <= wanted:  # at most 16 of >= 17 distinct orders, or every one of few: ends quickly
        order = moved[:]
        rng.shuffle(order)
        if tuple(order) not in seen:
            seen.add(tuple(order))
            orders.append(", ".join(kept + order))
    return orders


def _orders_with_dropout(caption: str, kept: list[str], moved: list[str], shuffles: int, keep: int,
                         dropout: float) -> list[str]:
    """tag_orders with dropout: each other order shuffles the moved tags and leaves out each with probability
    `dropout`. The number of distinct results is hard to count (subsets times orders, fewer with repeated tags or a
    high rate), so draws stop after TRIES_PER_ORDER per order wanted: fewer orders, never a loop without end."""
    rng = random.Random(hashlib.sha256(f"{keep}\x00{dropout!r}\x00{caption}".encode("utf-8")).digest())
    seen, orders = {tuple(moved)}, [caption]
    for _ in range(TRIES_PER_ORDER * shuffles):
        if len(orders) > shuffles:
            break
        order = moved[:]
        rng.shuffle(order)
        order = [tag for tag in order if rng.random() >= dropout]
        if tuple(order) not in seen:
            seen.add(tuple(order))
            orders.append(", ".join(kept + order))
    return orders
