"""Data nodes: a deterministic synthetic dataset for demos, tests and ControlNet work; a preview of what a dataset
will train on."""
from comfy_api.latest import io, ui

from ..training.data.dataset import DatasetError
from ..training.data.preview import MAX_PREVIEWS, preview_batch, preview_items, preview_lines
from ..training.data.synthetic import COLOURS, SIZE_PRESETS, generate_shapes, parse_colours
from .bridge.comfy_bridge import node_name
from .io_types import DatasetType


class HeadroomSyntheticDataset(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomSyntheticDataset",
            display_name="Synthetic Dataset (Headroom)",
            category="Headroom/data",
            description=(
                "Coloured shapes (circle, square, triangle, cross) at one of 9 grid positions on a plain "
                "background, with captions naming colour, shape and position, and a control image per item "
                "(the shape's mask, white on black). Same inputs give identical images."
            ),
            inputs=[
                io.Int.Input("count", default=4, min=1, max=4096, tooltip="Number of images."),
                io.Int.Input("resolution", default=512, min=32, max=2048, step=8,
                             tooltip="Width and height in pixels; 512, as the dataset and validation nodes default to. "
                             "64 is enough for the built-in tiny models and far faster on a CPU."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, tooltip="Picks the shapes, sizes and offsets."),
                # Appended last and optional: workflows saved before it existed keep working (all colours).
                io.String.Input("colours", default="", optional=True,
                                tooltip=f"Only these colours, comma-separated (e.g. 'green', the colour the pretrained "
                                f"tiny model never saw); empty: all of {', '.join(COLOURS)}."),
                io.Combo.Input("sizes", options=list(SIZE_PRESETS), default="default", optional=True,
                               tooltip="Shape sizes: default (0.26-0.40 of a grid cell), or large (0.40-0.46), the "
                               "sizes the pretrained tiny model was trained on: use them to teach it."),
            ],
            outputs=[
                io.Image.Output("images", display_name="images",
                                tooltip="The images, resolution x resolution, as an IMAGE batch."),
                io.String.Output("captions", display_name="captions", tooltip="One caption per line, in image order."),
                io.Image.Output(
                    "control_images", display_name="control_images", tooltip="Each image's shape mask, white on black."
                ),
            ],
        )

    @classmethod
    def validate_inputs(cls, resolution: int | None = None, colours: str | None = None) -> bool | str:
        # The widget steps by 8, but API prompts can send any integer. None: linked, checked at run time.
        if resolution is not None and resolution % 8:
            return f"{node_name(cls)}: resolution={resolution} must be a multiple of 8"
        if colours is not None:
            try:
                parse_colours(colours)
            except ValueError as error:
                return f"{node_name(cls)}: {error}"
        return True

    @classmethod
    def execute(cls, count: int, resolution: int, seed: int, colours: str = "", sizes: str = "default") -> io.NodeOutput:
        if sizes not in SIZE_PRESETS:
            raise ValueError(f"{node_name(cls)}: sizes={sizes!r}; choose one of {', '.join(SIZE_PRESETS)}")
        data = generate_shapes(count, resolution, seed, parse_colours(colours or ""), **SIZE_PRESETS[sizes])
        return io.NodeOutput(data.images, "\n".join(data.captions), data.control_images)


class HeadroomPreviewDataset(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomPreviewDataset",
            display_name="Preview Dataset (Headroom)",
            category="Headroom/data",
            description="What the dataset will train on, before anything is cached: each item cropped to its "
            "bucket exactly as Cache Latents will encode it (at resolution, not mirrored; a clip's first frame), "
            "what its loss mask leaves out darkened, and its caption as it will be encoded (trigger word "
            "included). Only the items shown are decoded.",
            is_output_node=True,
            inputs=[
                DatasetType.Input("dataset", tooltip="From a Dataset node (Headroom)."),
                io.Int.Input("count", default=16, min=1, max=MAX_PREVIEWS,
                             tooltip="How many items to show, from start."),
                io.Int.Input("start", default=0, min=0, max=10_000_000,
                             tooltip="The first item shown (0: the first); step through a large dataset with it."),
                io.Boolean.Input("show_masks", default=True,
                                 tooltip="Darken what each item's loss mask (mask_folder, masks, or transparency "
                                 "loss_mask) leaves out, so you see what is learned. Off: the crops as they are."),
            ],
            outputs=[
                io.Image.Output("images", tooltip="The crops, scaled to fit 512 px and centred on a grey canvas of "
                                "the largest bucket's shape (an IMAGE batch has one size); each bucket's size is in "
                                "the captions."),
                io.String.Output("captions", tooltip="One line per item: its number, name, bucket size (repeats, "
                                 "share of the mask learned) and caption."),
            ],
        )

    @classmethod
    def execute(cls, dataset, count: int = 16, start: int = 0, show_masks: bool = True) -> io.NodeOutput:
        name = node_name(cls)
        if not 1 <= count <= MAX_PREVIEWS:
            raise ValueError(f"{name}: count={count!r}: give 1 to {MAX_PREVIEWS}")
        if not 0 <= start < len(dataset):
            raise ValueError(f"{name}: start={start!r} is past the dataset's last item ({len(dataset)} items: give "
                             f"0 to {len(dataset) - 1})")
        previews = preview_items(dataset, start, count)
        lines = preview_lines(previews)
        try:
            images = preview_batch(previews, show_masks)
        except DatasetError as error:
            raise DatasetError(f"{name}: {error}:\n- " + "\n- ".join(lines)) from None
        shown = f"items {start}-{previews[-1].index} of {len(dataset)}, at resolution {dataset.resolution}"
        text = "\n".join([shown + ":", *lines])
        return io.NodeOutput(images, "\n".join(lines),
                             ui={**ui.PreviewImage(images, cls=cls).as_dict(), "text": [text]})


NODES = [HeadroomSyntheticDataset, HeadroomPreviewDataset]
