"""Tag shuffling (training/data/caption_tags.py): the tag orders a caption is cached in, the text cache that holds
them (cache_store.cache_text), and the trainer's choice of one order per item and step. The node runs it with
ComfyUI's CLIP in tests/comfy/test_cache_nodes.py."""
import math

import pytest
import torch

from headroom.training.core.trainer import TrainConfig
from headroom.training.data.cache_store import ShardStore, cache_text, text_key
from headroom.training.data.caption_tags import split_tags, tag_orders
from memory_caches import MemoryTextCache
from test_cache_store import CountingTextEncoder
from test_trainer import make_trainer, toy_data


def test_the_caption_as_written_comes_first_then_distinct_orders_with_the_kept_tags_in_place():
    caption = "ohwx,  red hair, smiling,, outdoors, from side"
    orders = tag_orders(caption, 8, 1)
    assert orders[0] == caption  # exactly as written: its text key is the one the latent cache names
    assert len(orders) == 9
    tags = split_tags(caption)
    assert tags == ["ohwx", "red hair", "smiling", "outdoors", "from side"]
    shuffled = [split_tags(order) for order in orders[1:]]
    assert all(order[0] == "ohwx" and sorted(order) == sorted(tags) for order in shuffled)
    assert len({tuple(order) for order in [tags, *shuffled]}) == 9  # none repeats another, nor the written order
    assert all(order == ", ".join(split_tags(order)) for order in orders[1:])
    assert tag_orders(caption, 8, 1) == orders  # seeded by the caption: a second caching finds them all
    assert tag_orders(caption, 8, 2)[1:] != orders[1:]
    assert all(split_tags(order)[:2] == ["ohwx", "red hair"] for order in tag_orders(caption, 8, 2))
    assert len({split_tags(order)[0] for order in tag_orders(caption, 16, 0)}) > 1  # keep 0: the first moves too


def test_captions_with_few_orders_give_what_there_is():
    assert tag_orders("a photo of a cat in the snow", 16, 0) == ["a photo of a cat in the snow"]  # a sentence
    assert tag_orders("ohwx, smiling", 16, 1) == ["ohwx, smiling"]  # one tag moves: nothing to shuffle
    assert tag_orders("ohwx, smiling", 4, 0) == ["ohwx, smiling", "smiling, ohwx"]
    assert len(tag_orders("ohwx, a, b, c", 16, 1)) == math.factorial(3)  # all 3! orders, the written one first
    # Repeated tags have fewer distinct orders (3 of a, a, b): it stops there rather than looking forever.
    assert sorted(tag_orders("ohwx, a, a, b", 16, 1)) == ["ohwx, a, a, b", "ohwx, a, b, a", "ohwx, b, a, a"]
    assert tag_orders("ohwx, a, b", 0, 1) == ["ohwx, a, b"]
    for shuffles, keep in ((-1, 1), (17, 1), (2, -1), (2, 65)):
        with pytest.raises(ValueError, match="choose"):
            tag_orders("a, b, c", shuffles, keep)


def test_tag_dropout_leaves_shuffled_tags_out_of_the_other_orders_at_its_rate():
    """kohya's caption_tag_dropout_rate on cached orders: the caption as written first, then distinct shuffles each
    leaving out tags after the kept ones at about the rate; the orders without dropout are those of before; a rate
    that leaves few distinct orders gives those, and stops."""
    tags = [f"tag{i}" for i in range(12)]
    caption = ", ".join(["ohwx", *tags])
    orders = tag_orders(caption, 16, 1, dropout=0.25)
    assert orders[0] == caption and len(orders) == 17 and len(set(orders)) == 17
    assert orders == tag_orders(caption, 16, 1, dropout=0.25)  # seeded by the caption: cached again, found again
    kept = [split_tags(order) for order in orders[1:]]
    assert all(order[0] == "ohwx" and set(order[1:]) <= set(tags) and len(set(order)) == len(order) for order in kept)
    dropped = sum(len(tags) + 1 - len(order) for order in kept) / (16 * len(tags))
    assert 0.15 < dropped < 0.35, dropped
    assert tag_orders(caption, 16, 1, dropout=0.0) == tag_orders(caption, 16, 1)
    # One tag after the kept one: with dropout it has one other order (the tag left out); at rate 1 every other
    # order is the kept tags alone: one, and the draws stop.
    assert tag_orders("ohwx, smiling", 4, 1, dropout=0.5) == ["ohwx, smiling", "ohwx"]
    assert tag_orders(caption, 16, 1, dropout=1.0) == [caption, "ohwx"]
    assert tag_orders("a photo of a cat", 4, 1, dropout=0.5) == ["a photo of a cat"]  # no tag after the kept one
    for rate in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="tag_dropout=.*choose 0"):
            tag_orders(caption, 4, 1, dropout=rate)


def test_each_order_is_encoded_once_cached_and_found_again(tmp_path):
    captions = ["ohwx, red hair, smiling, outdoors", "ohwx, a photo", "a sentence without tags"]
    encoder = CountingTextEncoder()
    cache, report = cache_text(captions, ShardStore(tmp_path / "text"), encoder, "fp-te", {}, tag_shuffles=3,
                               keep_tags=1)
    expected = {caption: tag_orders(caption, 3, 1) for caption in captions}
    assert [len(orders) for orders in expected.values()] == [4, 1, 1]
    assert sorted(encoder.calls) == sorted(["", *[text for orders in expected.values() for text in orders]])
    for caption, orders in expected.items():
        key = text_key(caption)
        assert cache.tag_orders(key) == len(orders)
        for order, text in enumerate(orders):
            assert torch.equal(cache.conditioning(key, order)["cross_attn"], CountingTextEncoder()(text)["cross_attn"])
        assert torch.equal(cache.conditioning(key)["cross_attn"], CountingTextEncoder()(caption)["cross_attn"])
    assert cache.tag_orders(text_key("")) == 1 and cache.tag_shuffling == {"shuffles": 3, "keep": 1}
    assert "tag shuffling: 1 of 3 captions cached in 6 tag orders in all (keep_tags 1)" in report.summary()
    assert "warning" not in report.summary()

    encoder = CountingTextEncoder()
    again, report = cache_text(captions, ShardStore(tmp_path / "text"), encoder, "fp-te", {}, tag_shuffles=3,
                               keep_tags=1)
    assert encoder.calls == [] and report.hits == 7 and report.misses == 0
    plain, report = cache_text(captions, ShardStore(tmp_path / "text"), encoder, "fp-te", {})
    assert encoder.calls == [] and report.hits == 4  # as written: the same entries
    assert plain.tag_shuffling is None and plain.tag_orders(text_key(captions[0])) == 1

    dropped, report = cache_text(captions, ShardStore(tmp_path / "text"), encoder, "fp-te", {}, tag_shuffles=3,
                                 keep_tags=1, tag_dropout=0.5)
    assert dropped.tag_shuffling == {"shuffles": 3, "keep": 1, "dropout": 0.5}  # what a run stores and resumes on
    assert "(keep_tags 1, tag_dropout 0.5)" in report.summary()
    assert dropped.tag_orders(text_key(captions[1])) == 2  # "ohwx, a photo" and "ohwx"

    _, report = cache_text(["a sentence", "another one"], ShardStore(tmp_path / "text"), encoder, "fp-te", {},
                           tag_shuffles=4, keep_tags=1)
    assert "warning: tag_shuffles=4, but no caption has two or more comma-separated tags after its first 1" in \
        report.summary()


def _orders_seen(trainer, steps):
    """(item, draw) the trainer's batches gave each item in `steps` optimizer steps."""
    seen = []
    original = trainer._conds

    def spy(items, dropout=None, source=None, draws=None):
        seen.extend(zip(items, draws.tolist()))
        return original(items, dropout, source, draws)

    trainer._conds = spy
    trainer.train_to(steps)
    return seen


def test_training_draws_an_order_per_item_and_step_and_leaves_every_other_draw_as_it_was():
    _, texts = toy_data()
    g = torch.Generator().manual_seed(9)
    other = {key: [{"cross_attn": torch.randn(3, 8, generator=g)} for _ in range(2)] for key in ("k0", "k1")}
    shuffled = MemoryTextCache(texts._conds, texts._empty, orders=other)
    config = TrainConfig(batch_size=2, seed=3)

    plain = make_trainer(config=config)
    plain_seen = _orders_seen(plain, 30)
    run = make_trainer(config=config, text_cache=shuffled)
    seen = _orders_seen(run, 30)
    assert seen == plain_seen  # the same batches, and the same draws: their own generator, seeded by (seed, step)
    chosen = {item: {draw % 3 for i, draw in seen if i == item} for item in (0, 1)}
    assert chosen == {0: {0, 1, 2}, 1: {0, 1, 2}}  # every order of a shuffled caption is trained on
    assert run.loss_history != plain.loss_history  # ... and its conditioning is the order's

    # Orders whose conditioning is the caption's own: exactly the run without shuffling (no other draw moved).
    same = MemoryTextCache(texts._conds, texts._empty, orders={key: [texts._conds[key]] * 2 for key in ("k0", "k1")})
    again = make_trainer(config=config, text_cache=same)
    again.train_to(30)
    assert again.loss_history == plain.loss_history
    assert all(torch.equal(a, b) for a, b in zip(again.trainable.state_dict().values(),
                                                 plain.trainable.state_dict().values()))


def test_captions_encoded_with_their_reference_images_are_shuffled_per_item(tmp_path):
    """Qwen-Image-Edit's text path (a caption encoded with its item's reference image) with tag shuffling: every order
    of an item's caption is encoded with that item's reference, under the item's key, and training draws among them."""
    from headroom.training.data.cache_store import item_conditioning
    from test_cache_store import folder_dataset, run_latents, write_folder

    write_folder(tmp_path / "data", count=2, controls=tmp_path / "controls")
    for i in range(2):
        (tmp_path / "data" / f"img{i}.txt").write_text("ohwx, red, night, rain")
    dataset = folder_dataset(tmp_path / "data", control_folder=tmp_path / "controls")
    calls = []

    def with_reference(text, image):
        calls.append(text)
        reference = image.mean().reshape(1, 1).expand(1, 8)
        return {"cross_attn": torch.cat([CountingTextEncoder()(text)["cross_attn"], reference])}

    text, report = cache_text([i.caption for i in dataset.items], ShardStore(tmp_path / "text"), CountingTextEncoder(),
                              "fp-te", {}, references=[i.control for i in dataset.items],
                              encode_with_reference=with_reference, reference_encoding="TextEncodeQwenImageEdit",
                              tag_shuffles=2, keep_tags=1)
    orders = tag_orders("ohwx, red, night, rain", 2, 1)
    assert sorted(calls) == sorted(orders * 2) and report.misses == 7  # 2 items x 3 orders + the empty prompt
    latents = run_latents(dataset, tmp_path / "latents", control_encoding="latents")[0]
    for item in range(2):
        drawn = {draw: item_conditioning(text, latents, item, draw)["cross_attn"] for draw in range(3)}
        for draw, order in enumerate(orders):
            assert torch.equal(drawn[draw][:-1], CountingTextEncoder()(order)["cross_attn"])
        assert len({drawn[draw][-1, 0].item() for draw in range(3)}) == 1  # every order with this item's reference
    first, second = (item_conditioning(text, latents, item, 1)["cross_attn"] for item in range(2))
    assert first[-1, 0] != second[-1, 0]  # the same order, each item with its own reference


def test_ai_toolkits_trigger_placeholder_takes_the_trigger_word_and_is_refused_without_one():
    """Captions written for ai-toolkit hold '[trigger]' where the trigger word goes: it is put there (every one),
    not in front; captions without it are prefixed as before; without a trigger word the placeholder would be
    learned literally, so the dataset is refused, naming an item and the fix."""
    from headroom.training.data.dataset import Dataset, DatasetError, DatasetItem, TensorImage, with_trigger_word

    pixels = torch.zeros(8, 8, 3)
    captions = ["[trigger] sitting on a sofa", "a photo of [trigger], [trigger] smiling", "a plain caption"]
    dataset = Dataset(items=tuple(DatasetItem(f"image {i}", caption, TensorImage(pixels, f"image {i}"))
                                  for i, caption in enumerate(captions)), resolution=64, step=64)
    assert [item.caption for item in with_trigger_word(dataset, " ohwx ").items] == [
        "ohwx sitting on a sofa", "a photo of ohwx, ohwx smiling", "ohwx, a plain caption"]
    with pytest.raises(DatasetError, match=r"2 caption\(s\) hold ai-toolkit's \[trigger\] placeholder \(e\.g\. "
                                           r"image 0: '\[trigger\] sitting on a sofa'\) but trigger_word is empty: "
                                           r"set trigger_word"):
        with_trigger_word(dataset, "")


def test_a_caption_file_of_several_lines_is_cached_line_by_line_and_trained_one_line_per_step(tmp_path):
    """Several lines in a caption file are alternative captions (OneTrainer's and kohya's wildcard convention): each
    line is cached (with its tag orders) under the caption's key, the first line as the caption used without a draw;
    a trigger word goes before every line; the file's blank lines and indents are dropped."""
    from PIL import Image

    from headroom.training.data.caption_tags import caption_variants
    from headroom.training.data.dataset import dataset_from_folder, with_trigger_word

    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("a dog on grass\r\n\r\n   a brown dog, outdoors  \n", encoding="utf-8")
    caption = dataset_from_folder(tmp_path, resolution=32, step=32).items[0].caption
    assert caption == "a dog on grass\na brown dog, outdoors"
    dataset = dataset_from_folder(tmp_path, resolution=32, step=32)
    assert with_trigger_word(dataset, "ohwx").items[0].caption == "ohwx, a dog on grass\nohwx, a brown dog, outdoors"
    assert caption_variants(caption) == ["a dog on grass", "a brown dog, outdoors"]
    assert caption_variants(caption, 4, 0) == ["a dog on grass", "a brown dog, outdoors", "outdoors, a brown dog"]
    assert caption_variants("one line, two tags", 4, 0) == tag_orders("one line, two tags", 4, 0)  # as before

    encoder = CountingTextEncoder()
    cache, report = cache_text([caption, "a cat"], ShardStore(tmp_path / "text"), encoder, "fp-te", {})
    key = text_key(caption)
    assert cache.tag_orders(key) == 2 and cache.tag_shuffling is None
    for order, line in enumerate(caption_variants(caption)):
        assert torch.equal(cache.conditioning(key, order)["cross_attn"], CountingTextEncoder()(line)["cross_attn"])
    assert caption not in encoder.calls  # never the lines joined
    assert "1 caption(s) of several lines: each line cached as an alternative caption" in report.summary()


def test_wildcards_make_a_text_per_combination_cached_and_drawn_per_step(tmp_path):
    """kohya's {a|b} wildcards: every combination (the first options first), an empty option without a double space,
    braces without '|' left as written, many combinations sampled to MAX_WILDCARD_TEXTS, seeded by the line; each text
    cached under the caption's key, never the braces."""
    from headroom.training.data.caption_tags import MAX_WILDCARD_TEXTS, caption_variants, wildcard_texts

    assert wildcard_texts("a {red|blue} car{| with wheels}") == [
        "a red car", "a red car with wheels", "a blue car", "a blue car with wheels"]
    assert wildcard_texts("a {} thing {x} {y|}") == ["a {} thing {x} y", "a {} thing {x}"]
    many = wildcard_texts("{a|b|c} {d|e|f} {g|h|i}")  # 27 combinations
    assert len(many) == MAX_WILDCARD_TEXTS and many[0] == "a d g" and many == wildcard_texts("{a|b|c} {d|e|f} {g|h|i}")
    assert caption_variants("ohwx, {red|blue} hair, smiling", 2, 1) == [
        "ohwx, red hair, smiling", "ohwx, smiling, red hair", "ohwx, blue hair, smiling", "ohwx, smiling, blue hair"]

    caption = "a {red|blue} car\na truck"
    encoder = CountingTextEncoder()
    cache, report = cache_text([caption], ShardStore(tmp_path / "text"), encoder, "fp-te", {})
    assert cache.tag_orders(text_key(caption)) == 3
    assert sorted(encoder.calls) == sorted(["", "a red car", "a blue car", "a truck"])
    assert "1 caption(s) with {a|b} wildcards: each text they make cached" in report.summary()


def test_a_caption_that_would_make_too_many_texts_is_refused_naming_it():
    """Caption files are untrusted: a file of many lines, or wildcards times tag orders, would each be an encoding on
    disk; refused with what makes them, before anything is encoded."""
    from headroom.training.data.caption_tags import MAX_LINES, MAX_VARIANTS, TooManyVariants, caption_variants

    assert len(caption_variants("\n".join(f"line {i}" for i in range(MAX_LINES)))) == MAX_LINES
    with pytest.raises(TooManyVariants, match=f"has {MAX_LINES + 1} lines \\(alternative captions\\); at most"):
        caption_variants("\n".join(f"line {i}" for i in range(MAX_LINES + 1)))
    with pytest.raises(TooManyVariants, match=r"makes 68 texts to cache \(2 line\(s\), 4 with their wildcards, then "
                                              rf"their tag orders\); at most {MAX_VARIANTS}"):
        caption_variants("{a|b}, x, y, z, w\n{c|d}, x, y, z, w", 16, 1)


def test_tag_frequency_counts_each_tag_once_per_caption_most_frequent_first():
    """kohya's ss_tag_frequency: comma-separated tags, stripped, counted per caption (a tag on several of a caption's
    alternative lines counts once), the most frequent first, ties in the order first seen."""
    from headroom.training.data.caption_tags import tag_frequency

    counts = tag_frequency(["ohwx, red, circle", "ohwx,blue , circle\nohwx, circle, night", "ohwx", " , ,", ""])
    assert counts == {"ohwx": 3, "circle": 2, "red": 1, "blue": 1, "night": 1}
    assert list(counts) == ["ohwx", "circle", "red", "blue", "night"]
