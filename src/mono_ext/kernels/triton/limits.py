"""Constants every Triton launch shares; no triton import, so host-side refusals can read them."""

# Rows per launch: tl.dot needs M >= 16, and widths 1..16 mask the rest.
BLOCK_B = 16
# Launch arguments that change between steps or layers: never specialised (runtime.build_cache).
PER_STEP_ARGS = ("n_rows", "layer", "layers_per_step")
# Plane format -> the ``Q`` constexpr the kernels branch on (``planes``: layouts, the reader).
FORMAT_CODES = {"bf16": 0, "fp8_block128": 1, "fp8_channel": 2, "fp8_tensor": 3}
# The H200's (sm_90) largest opt-in shared memory per block.
SHARED_PER_BLOCK = 227 * 1024
# What the Triton K1/K2 read (the builder's ``plane_formats``).
READ_FORMATS = frozenset(FORMAT_CODES)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): block sizes and padded extents of the
    constexprs every build derives from its shapes."""
    return 1 << max(0, (int(n) - 1).bit_length())


def pdl_options(on: bool) -> dict:
    """A persistent kernel's ``PDL`` constexpr (``primitives.pdl_prologue``) and Triton's
    ``launch_pdl`` option, both or neither, so a build without PDL compiles exactly as one that
    never heard of it."""
    return {"PDL": True, "launch_pdl": True} if on else {}
