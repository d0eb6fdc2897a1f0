"""The run's validation grids (validation/step_<step>.png and step_<step>_before_after.png): the samples as the cells
of one picture, with a title strip (the step, the run), each column's prompt above it and each row's title at its left
(before / after), drawn with PIL's default font.

The cells are the samples' own pixels, untouched and side by side as before the labels; only strips were added above
and to the left. How wide those strips are depends on the font this Pillow has, so the PNG records where the cells are
(a text chunk, GRID_KEY) and `grid_cells` reads them back from that: the tests and the demo's pixel classifier
(.ci/demo) read a grid through it, never through offsets of their own.
"""
from __future__ import annotations

import json
import pathlib
from io import BytesIO

import numpy as np
from PIL import Image, ImageDraw, ImageFont
from PIL.PngImagePlugin import PngInfo

GRID_KEY = "headroom_grid"  # the PNG text chunk holding the cells' place: {"left", "top", "rows", "columns", ...}
BACKGROUND = (30, 30, 30)  # the label strips: dark, as the editor's nodes the grid is shown on
TEXT = (235, 235, 235)
HEADER_LINES = 4  # a prompt above its column: wrapped onto this many lines at most, then cut with an ellipsis
MIN_FONT, MAX_FONT = 11, 64


def grid_font(cell: int):
    """PIL's default font at a size that reads at the cell size (11 px on 64 px samples, a sixteenth of larger ones).
    Pillow >= 10.1 scales it (load_default(size=)); an older one has only its fixed bitmap font."""
    size = max(MIN_FONT, min(MAX_FONT, round(cell / 16)))
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: load_default() takes no size
        return ImageFont.load_default()


def _scalable(font) -> bool:
    return isinstance(font, ImageFont.FreeTypeFont)


def _drawable(text: str, font) -> str:
    # The bitmap font encodes latin-1 only (a CJK prompt would raise); the scalable one draws any character.
    return text if _scalable(font) else text.encode("latin-1", "replace").decode("latin-1")


def _ellipsis(font) -> str:
    return "\u2026" if _scalable(font) else "..."


def _width(font, text: str) -> float:
    return font.getlength(_drawable(text, font))


def _prefix(text: str, font, width: float) -> str:
    """The longest start of `text` at most `width` px wide."""
    low, high = 0, len(text)
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if _width(font, text[:middle]) <= width else (low, middle - 1)
    return text[:low]


def shorten(text: str, font, width: float) -> str:
    """`text` if it fits `width` px, else its longest start that fits with an ellipsis after it."""
    if _width(font, text) <= width:
        return text
    mark = _ellipsis(font)
    return _prefix(text, font, width - _width(font, mark)).rstrip() + mark


def fit_lines(text: str, font, width: float, lines: int) -> list[str]:
    """`text` word-wrapped onto at most `lines` lines of at most `width` px; the last one cut with an ellipsis when
    the text does not fit (a word wider than a line is broken)."""
    words, out = text.split(), []
    while words and lines > 0:
        if len(out) == lines - 1:  # the last line: the rest, shortened if need be
            out.append(shorten(" ".join(words), font, width))
            break
        line = words.pop(0)
        while words and _width(font, f"{line} {words[0]}") <= width:
            line = f"{line} {words.pop(0)}"
        if _width(font, line) > width:
            head = _prefix(line, font, width) or line[0]  # at least one character: the loop always moves on
            words.insert(0, line[len(head):])
            line = head
        out.append(line)
    return out


def _line_height(font) -> int:
    return font.getbbox(_drawable("Ag", font))[3] + 2


def _padding(font) -> int:
    return max(3, getattr(font, "size", MIN_FONT) // 3)  # the bitmap font has no size: 11 px


def title_height(cell: int) -> int:
    """The title strip's height over a grid of `cell`-px samples (the column labels' strip starts below it)."""
    font = grid_font(cell)
    return _line_height(font) + 2 * _padding(font)


def labelled_grid(cells: np.ndarray, title: str, columns: list[tuple[str, int]] | None = None,
                  rows: list[str] | None = None) -> Image.Image:
    """`cells` [R, C, H, W, 3] uint8 side by side under a title strip, with `columns` ((label, span): a label over
    `span` cells, e.g. a prompt over its clip's frames) above them and `rows` (one label each) at their left. The
    image's `info[GRID_KEY]` says where the cells are (written into the PNG by `grid_png`)."""
    count_rows, count_columns, height, width = cells.shape[:4]
    if columns and sum(span for _, span in columns) != count_columns or rows and len(rows) != count_rows:
        raise ValueError(f"grid of {count_rows} x {count_columns} cells: {len(rows or [])} row labels, column labels "
                         f"over {sum(span for _, span in columns or [])} cells")
    font = grid_font(min(height, width))
    line, pad = _line_height(font), _padding(font)
    # A row's title: wrapped onto the lines its height holds, in a strip as wide as its longest line (at most the
    # wider of a cell and ten lines' height: a long run name is cut rather than widen the picture without end).
    label_lines = [fit_lines(label, font, max(width, 10 * line), max(1, (height - 2 * pad) // line))
                   for label in rows or []]
    widest = max((_width(font, text) for lines in label_lines for text in lines), default=0)
    left = int(np.ceil(2 * pad + widest)) if rows else 0
    # Each prompt wrapped over its column; the strip as tall as the longest needs (the prompts of a run often differ
    # only at their end: "a green circle at the center", "a green square at the top left").
    headers = [fit_lines(label, font, span * width - 2 * pad, HEADER_LINES) for label, span in columns or []]
    header = max((len(lines) for lines in headers), default=0) * line + 2 * pad if columns else 0
    top = title_height(min(height, width)) + header
    image = Image.new("RGB", (left + count_columns * width, top + count_rows * height), BACKGROUND)
    image.paste(Image.fromarray(np.ascontiguousarray(cells.transpose(0, 2, 1, 3, 4).reshape(
        count_rows * height, count_columns * width, 3))), (left, top))
    draw = ImageDraw.Draw(image)

    def text_at(x: float, y: float, text: str) -> None:
        draw.text((x, y), _drawable(text, font), fill=TEXT, font=font)

    text_at(pad, pad, shorten(title, font, image.width - 2 * pad))
    x = left
    for (_, span), lines in zip(columns or [], headers):
        room = span * width - 2 * pad
        for index, text in enumerate(lines):  # centred over its cells
            text_at(x + pad + (room - _width(font, text)) / 2, line + 3 * pad + index * line, text)
        x += span * width
    for row, lines in enumerate(label_lines):  # centred on the row's height
        y = top + row * height + (height - len(lines) * line) / 2
        for index, text in enumerate(lines):
            text_at(pad, y + index * line, text)
    # Where the cells are, and the labels in full (the drawn ones may be cut): for grid_cells and grid_layout.
    image.info[GRID_KEY] = json.dumps({"left": left, "top": top, "rows": count_rows, "columns": count_columns,
                                       "height": height, "width": width, "title": title,
                                       "column_labels": [label for label, _ in columns or []],
                                       "row_labels": list(rows or [])})
    return image


def grid_png(image: Image.Image) -> bytes:
    """The grid as PNG bytes, its cells' place in the GRID_KEY text chunk."""
    info = PngInfo()
    info.add_text(GRID_KEY, image.info[GRID_KEY])
    buffer = BytesIO()
    image.save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


def enlarged(image: Image.Image | str | pathlib.Path, factor: int) -> Image.Image:
    """A grid `factor` times larger, every pixel a block (labels too: the picture stays the file the run wrote), its
    record scaled with it: a picture of a grid for the docs (docs/before_after.png) that grid_cells still reads."""
    image = _opened(image)
    layout = grid_layout(image)
    big = image.resize((image.width * factor, image.height * factor), Image.NEAREST)
    big.info[GRID_KEY] = json.dumps({**layout, **{key: int(layout[key]) * factor
                                                 for key in ("left", "top", "height", "width")}})
    return big


def _opened(image: Image.Image | str | pathlib.Path) -> Image.Image:
    if isinstance(image, Image.Image):
        return image
    with Image.open(image) as opened:
        opened.load()
        return opened.copy()  # with its info: the PNG's text chunks


def _no_constant(name: str):
    # json.loads reads NaN / Infinity, which JSON has not (this module imports nothing of the package: files.py's
    # no_json_constants is not at hand for workflows/thumbnails.py, which loads it from its file)
    raise ValueError(f"{name} is not a number JSON allows")


def grid_layout(image: Image.Image | str | pathlib.Path) -> dict:
    """What a validation grid's GRID_KEY chunk records: where its cells are ("left", "top": the first cell's corner;
    "rows", "columns", "height", "width") and its labels in full ("title", "column_labels", "row_labels")."""
    image = _opened(image)
    recorded = image.info.get(GRID_KEY)
    if recorded is None:
        raise ValueError(f"not a Headroom validation grid: no '{GRID_KEY}' chunk says where its cells are")
    layout = json.loads(recorded, parse_constant=_no_constant)  # a grid under output/ is untrusted
    if not isinstance(layout, dict):
        raise ValueError(f"validation grid: its '{GRID_KEY}' chunk is not a record of its cells")
    left, top, count_rows, count_columns, height, width = (int(layout[key]) for key in
                                                           ("left", "top", "rows", "columns", "height", "width"))
    if min(left, top) < 0 or min(count_rows, count_columns, height, width) < 1 or \
            left + count_columns * width > image.width or top + count_rows * height > image.height:
        raise ValueError(f"validation grid: its cells ({recorded}) do not lie inside its "
                         f"{image.width}x{image.height} pixels")
    return layout


def grid_cells(image: Image.Image | str | pathlib.Path) -> np.ndarray:
    """The cells [R, C, H, W, 3] uint8 of a validation grid (an image or its file), where its GRID_KEY chunk says:
    the samples' pixels without the labels around them."""
    image = _opened(image)
    layout = grid_layout(image)
    left, top, rows, columns, height, width = (int(layout[key]) for key in
                                               ("left", "top", "rows", "columns", "height", "width"))
    pixels = np.asarray(image.convert("RGB"))[top:top + rows * height, left:left + columns * width]
    return np.ascontiguousarray(pixels.reshape(rows, height, columns, width, 3).transpose(0, 2, 1, 3, 4))  # a copy: writable


def grid_samples(image: Image.Image | str | pathlib.Path) -> tuple[np.ndarray, list[str]]:
    """A validation grid's samples, one per prompt [P, H, W, 3] uint8, and their prompts: a grid of pictures is one
    row of them under their prompts; a grid of clips has a row per prompt (its label at the left), whose first frame
    is taken. Labels that are not text, or not one per sample, read as empty."""
    layout = grid_layout(image)
    cells = grid_cells(image)
    clips = bool(layout.get("row_labels"))
    samples = cells[:, 0] if clips else cells[0]
    labels = layout.get("row_labels" if clips else "column_labels")
    if not isinstance(labels, list) or len(labels) != len(samples) or not all(isinstance(x, str) for x in labels):
        labels = [""] * len(samples)
    return samples, labels


def history_sheet(rows: list[tuple[int, np.ndarray, list[str]]], title: str,
                  cell_size: int) -> tuple[Image.Image, list[str]]:
    """The samples of several validations of a run as one labelled grid: a row per validation (`rows`: (step,
    samples [P, H, W, 3], prompts), oldest first; each row titled with its step), a column per prompt, each sample
    scaled down to at most `cell_size` px on its longer side. The newest validation sets the prompts and sample
    size; older ones of other prompts or sizes are left out, and said in the notes returned."""
    _, newest, prompts = rows[-1]
    kept, notes = [], []
    for step, samples, labels in rows:
        if samples.shape != newest.shape or labels != prompts:
            notes.append(f"step {step}: other prompts or sample size than step {rows[-1][0]}'s; left out")
            continue
        kept.append((step, samples))
    height, width = newest.shape[1:3]
    scale = min(1.0, cell_size / max(height, width))
    size = (max(1, round(width * scale)), max(1, round(height * scale)))

    def fitted(sample: np.ndarray) -> np.ndarray:
        if scale == 1.0:
            return sample
        return np.asarray(Image.fromarray(sample).resize(size, Image.LANCZOS))

    cells = np.stack([np.stack([fitted(sample) for sample in samples]) for _, samples in kept])
    image = labelled_grid(cells, title, [(prompt, 1) for prompt in prompts], [f"step {step}" for step, _ in kept])
    return image, notes
