"""Small layer graphs shared by the pure unit tests (no torch)."""

from gpp_deepspeed.graph import LayerGraph, build_layer_graph

# The README's two-branch example: each modality projected and refined, then fused and classified.
TWO_BRANCH_LAYERS = [
    ("text_proj", ["text"]),
    ("image_proj", ["image"]),
    ("text_block", ["text_proj"]),
    ("image_block", ["image_proj"]),
    ("fuse", ["text_block", "image_block"]),
    ("head", ["fuse"]),
]


def two_branch_graph() -> LayerGraph:
    return build_layer_graph(["text", "image"], TWO_BRANCH_LAYERS)
