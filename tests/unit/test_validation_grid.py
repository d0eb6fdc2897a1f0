"""The validation grids' labels (training/core/validation_grid.py): a title, each prompt over its column, each row's
title at its left, around cells that stay the samples' exact pixels; grid_cells reads the cells back (no ComfyUI)."""
import io

import numpy as np
import pytest
from PIL import Image, ImageFont

from headroom.training.core import validation_grid as G

PROMPTS = ["a green circle at the center", "a green square at the top left", "a green cross"]
ROWS = ["before: base model", "after: demo_run step 400"]


def _cells(rows=2, columns=3, size=64, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (rows, columns, size, size, 3), dtype=np.uint8)


def _written(image: Image.Image) -> Image.Image:
    """The grid as its PNG file reads back."""
    return Image.open(io.BytesIO(G.grid_png(image)))


def _has_text(strip: np.ndarray) -> bool:
    return bool((strip != np.array(G.BACKGROUND, np.uint8)).any())


def test_the_cells_are_the_samples_and_the_labels_lie_around_them():
    cells = _cells()
    grid = _written(G.labelled_grid(cells, "step 400 \u00b7 demo_run", [(p, 1) for p in PROMPTS], ROWS))
    layout = G.grid_layout(grid)
    left, top, size = layout["left"], layout["top"], 64
    assert np.array_equal(G.grid_cells(grid), cells)  # every cell the sample's pixels, bit for bit
    pixels = np.asarray(grid.convert("RGB"))
    assert pixels.shape == (top + 2 * size, left + 3 * size, 3) and left > 0 and top > 0
    # A title strip over everything, a header over each column, a title left of each row: each holds drawn text,
    # and none of it is a sample's pixels.
    title_height = G.title_height(size)
    assert _has_text(pixels[:title_height])
    headers = [pixels[title_height:top, left + c * size:left + (c + 1) * size] for c in range(3)]
    assert all(_has_text(header) for header in headers)
    assert not np.array_equal(headers[0], headers[1]), "different prompts must read differently"
    row_titles = [pixels[top + r * size:top + (r + 1) * size, :left] for r in range(2)]
    assert all(_has_text(strip) for strip in row_titles)
    assert not np.array_equal(row_titles[0], row_titles[1])
    assert (pixels[:top, left:] == np.array(G.BACKGROUND)).all(axis=-1).mean() > 0.5  # text on a plain strip
    assert not np.array_equal(pixels[top - size:top, left:left + size], cells[0, 0])
    # The labels in full (the drawn ones may be cut) travel with the picture.
    assert layout["title"] == "step 400 \u00b7 demo_run"
    assert layout["column_labels"] == PROMPTS and layout["row_labels"] == ROWS


def test_the_same_label_draws_the_same_pixels_over_any_column():
    grid = G.labelled_grid(_cells(1, 2), "step 1", [("a red square", 1)] * 2)
    pixels, top = np.asarray(grid.convert("RGB")), G.grid_layout(grid)["top"]
    headers = [pixels[G.title_height(64):top, c * 64:(c + 1) * 64] for c in range(2)]
    assert _has_text(headers[0]) and np.array_equal(headers[0], headers[1])


def test_a_label_spans_a_clips_frames_and_a_plain_grid_has_no_row_titles():
    cells = _cells(2, 6, 32)
    grid = G.labelled_grid(cells, "step 2", [("clip one", 3), ("clip two", 3)], ROWS)
    assert np.array_equal(G.grid_cells(_written(grid)), cells)
    plain = G.grid_layout(G.labelled_grid(cells[:1], "step 2", [(p, 1) for p in "abcdef"]))
    assert plain["left"] == 0 and plain["row_labels"] == []
    with pytest.raises(ValueError, match="column labels over 5 cells"):
        G.labelled_grid(cells, "step 2", [("clip one", 3), ("clip two", 2)], ROWS)
    with pytest.raises(ValueError, match="1 row labels"):
        G.labelled_grid(cells, "step 2", None, ROWS[:1])


def test_long_prompts_are_cut_with_an_ellipsis_to_the_column_width():
    font = G.grid_font(64)
    long = "a green circle at the center of a very large picture with many words that never fit in a column"
    lines = G.fit_lines(long, font, 60, 2)
    assert len(lines) == 2 and lines[-1].endswith("\u2026"), lines
    assert all(font.getlength(line) <= 60 for line in lines), lines
    assert " ".join(lines)[:-1].rstrip() in long  # the start of the prompt, in order
    assert G.fit_lines("a red cross", font, 200, 2) == ["a red cross"]  # fits: as it is
    assert G.shorten("a red cross", font, 200) == "a red cross"
    word = G.fit_lines("supercalifragilisticexpialidocious", font, 40, 2)  # one word wider than a line: broken
    assert len(word) == 2 and word[0] and "supercalifragilisticexpialidocious".startswith(word[0]), word
    assert font.getlength(word[1]) <= 40 and word[1].endswith("\u2026")
    assert G.fit_lines("", font, 40, 2) == []

    # In the grid: the header drawn is the cut text (the same pixels as a grid labelled with it directly).
    cut = G.fit_lines(long, font, 64 - 2 * G._padding(font), G.HEADER_LINES)
    assert cut[-1].endswith("\u2026")
    drawn, expected = (np.asarray(G.labelled_grid(_cells(1, 1), "t", [(text, 1)]).convert("RGB"))
                       for text in (long, " ".join(cut)))
    assert np.array_equal(drawn, expected)


def test_the_font_grows_with_the_samples():
    assert G.grid_font(64).size == 11 and G.grid_font(32).size == 11  # legible on the tiny model's images
    assert G.grid_font(512).size == 32 and G.grid_font(4096).size == G.MAX_FONT


def test_an_old_pillow_draws_with_its_bitmap_font(monkeypatch):
    """Pillow < 10.1: load_default() takes no size and its bitmap font encodes latin-1 only; the grid still draws
    (a CJK prompt as '?', "..." for the ellipsis) and its cells are still the samples."""
    bitmap = ImageFont.load_default_imagefont()

    def load_default(*args, **kwargs):
        if args or kwargs:
            raise TypeError("load_default() got an unexpected keyword argument 'size'")
        return bitmap

    monkeypatch.setattr(ImageFont, "load_default", load_default)
    font = G.grid_font(64)
    assert font is bitmap
    cells = _cells()
    prompts = ["\u4e00\u53ea\u7eff\u8272\u7684\u5706", PROMPTS[1], "a long prompt " * 10]
    grid = _written(G.labelled_grid(cells, "step 3", [(p, 1) for p in prompts], ROWS))
    assert np.array_equal(G.grid_cells(grid), cells)
    assert G.fit_lines("a long prompt " * 10, font, 60, 2)[-1].endswith("...")


def test_grid_cells_needs_the_grids_own_record():
    plain = Image.new("RGB", (64, 64))
    with pytest.raises(ValueError, match="not a Headroom validation grid"):
        G.grid_cells(plain)
    grid = G.labelled_grid(_cells(1, 1), "t", [("p", 1)])
    grid.info[G.GRID_KEY] = grid.info[G.GRID_KEY].replace('"columns": 1', '"columns": 9')
    with pytest.raises(ValueError, match="do not lie inside"):
        G.grid_cells(grid)


def test_grid_cells_reads_a_file(tmp_path):
    cells = _cells(1, 2)
    path = tmp_path / "step_00000001.png"
    path.write_bytes(G.grid_png(G.labelled_grid(cells, "step 1", [("a", 1), ("b", 1)])))
    assert np.array_equal(G.grid_cells(path), cells)


def test_the_prompt_strip_is_as_tall_as_the_longest_prompt_needs():
    """Prompts of a run often differ only at their end: the strip wraps them onto up to HEADER_LINES lines."""
    font, cells = G.grid_font(64), _cells(1, 2)
    short = G.labelled_grid(cells, "step 1", [("a cat", 1), ("a dog", 1)])
    long = G.labelled_grid(cells, "step 1", [("a green circle at the center", 1), ("a dog", 1)])
    line = G._line_height(font)
    assert G.grid_layout(short)["top"] == G.title_height(64) + line + 2 * G._padding(font)
    lines = G.fit_lines("a green circle at the center", font, 64 - 2 * G._padding(font), G.HEADER_LINES)
    assert len(lines) > 1 and not lines[-1].endswith("\u2026"), lines  # all of it, on more lines
    assert G.grid_layout(long)["top"] == G.title_height(64) + len(lines) * line + 2 * G._padding(font)


def test_an_enlarged_grid_keeps_its_record():
    """docs/before_after.png is the demo's grid enlarged: its cells are the samples' pixels as blocks."""
    cells = _cells(2, 3, 32)
    grid = _written(G.labelled_grid(cells, "step 400", [(p, 1) for p in PROMPTS], ROWS))
    big = _written(G.enlarged(grid, 2))
    assert big.size == (2 * grid.width, 2 * grid.height)
    assert np.array_equal(G.grid_cells(big), cells.repeat(2, axis=2).repeat(2, axis=3))
    assert G.grid_layout(big)["column_labels"] == PROMPTS


def test_the_docs_picture_is_the_demos_grid_and_the_thumbnail_reads_it():
    """docs/before_after.png (README) is the demo's labelled grid enlarged 2x; the tiny_lora template's thumbnail
    (workflows/thumbnails.py) takes the samples out of it through its record."""
    import importlib.util
    import pathlib

    repo = pathlib.Path(__file__).resolve().parents[2]
    picture = repo / "docs" / "before_after.png"
    layout = G.grid_layout(picture)
    assert G.grid_cells(picture).shape == (2, 8, 128, 128, 3)
    assert layout["row_labels"][0] == "before: base model" and layout["row_labels"][1].startswith("after: tiny_demo")
    assert all(label.startswith("a green ") for label in layout["column_labels"])
    spec = importlib.util.spec_from_file_location("headroom_thumbnails", repo / "workflows" / "thumbnails.py")
    thumbnails = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(thumbnails)
    thumbnail = np.asarray(thumbnails.demo_picture())
    assert thumbnail.shape == (thumbnails.SIZE[1], thumbnails.SIZE[0], 3)
    # The samples alone, enlarged to fill it (its own labels drawn over the top of each half): no title strip.
    cells = G.grid_cells(picture)
    bare = np.concatenate([np.concatenate(list(row), axis=1) for row in cells], axis=0)
    width = bare.shape[0] * thumbnails.SIZE[0] // thumbnails.SIZE[1]
    expected = np.asarray(Image.fromarray(bare[:, :width]).resize(thumbnails.SIZE, Image.NEAREST))
    assert np.array_equal(thumbnail[40:180], expected[40:180])


def test_a_history_sheet_is_a_row_per_validation_of_the_newest_prompts():
    """Validations as rows, oldest first, titled with their steps; one of other prompts or size left out and named;
    the samples at their own pixels below cell_size, scaled down above it; a clip grid gives its first frames."""
    rows = [(step, _cells(1, 3, 32, seed=step)[0], PROMPTS) for step in (100, 200, 300)]
    other = (150, _cells(1, 2, 32, seed=9)[0], PROMPTS[:2])
    sheet, notes = G.history_sheet([rows[0], other, *rows[1:]], "demo_run \u00b7 steps 100-300", 256)
    assert notes == ["step 150: other prompts or sample size than step 300's; left out"]
    layout = G.grid_layout(_written(sheet))
    assert layout["row_labels"] == ["step 100", "step 200", "step 300"] and layout["column_labels"] == PROMPTS
    assert np.array_equal(G.grid_cells(_written(sheet)), np.stack([samples for _, samples, _ in rows]))
    small, _ = G.history_sheet(rows, "t", 16)  # 32 px samples to 16
    assert G.grid_cells(small).shape == (3, 3, 16, 16, 3)
    # A clip grid (a row per prompt, its frames across): the first frames, under the prompts at its left
    clips = _cells(3, 4, 32, seed=5)
    grid = _written(G.labelled_grid(clips, "step 5", [(f"frame {i + 1}", 1) for i in range(4)], PROMPTS))
    samples, prompts = G.grid_samples(grid)
    assert np.array_equal(samples, clips[:, 0]) and prompts == PROMPTS


def test_a_grids_record_is_untrusted():
    """A record that is no JSON object, or holds NaN, is refused as a ValueError (Validation History leaves that grid
    out, naming it); labels that are not one text per sample read as empty."""
    grid = G.labelled_grid(_cells(1, 2), "t", [("a", 1), ("b", 1)])
    for record in ("[1, 2]", '{"left": NaN}', "not json"):
        grid.info[G.GRID_KEY] = record
        with pytest.raises(ValueError):
            G.grid_samples(grid)
    grid = G.labelled_grid(_cells(1, 2), "t", [("a", 1), ("b", 1)])
    grid.info[G.GRID_KEY] = grid.info[G.GRID_KEY].replace('"column_labels": ["a", "b"]', '"column_labels": [1]')
    assert G.grid_samples(grid)[1] == ["", ""]
