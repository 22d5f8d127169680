"""Constants every Triton launch shares; no triton import, so host-side refusals can read them."""

# Rows per launch: tl.dot needs M >= 16, and widths 1..16 mask the rest.
BLOCK_B = 16
# Launch arguments that change between steps or layers: never specialised (runtime.build_cache).
PER_STEP_ARGS = ("n_rows", "layer", "layers_per_step")
