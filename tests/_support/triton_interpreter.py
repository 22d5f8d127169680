"""Triton's CPU interpreter, made to compute what the GPU does for this package's kernels.

With ``TRITON_INTERPRET=1`` (the ``interpreter`` run of tools/test.sh) the conftests of the
folders holding Triton kernel tests (tests/kernels/triton, tests/models/qwen3_next/triton)
call :func:`patch_triton_interpreter` before any kernel runs; it fills five gaps of Triton's
stock interpreter (3.6 as released) that the kernels hit:

- ``tl.dot`` on bfloat16 operands: the interpreter keeps bfloat16 as its uint16 bits and
  multiplied the bit patterns (triton-lang/triton#11584; "not supported yet" upstream); the
  operands are widened to float32 first (exact).
- float32 -> bfloat16 casts truncated the mantissa (and could turn a NaN into an infinity);
  they round to nearest even with NaN kept, as ``cvt.rn.bf16.f32`` does.
- float8 e4m3fn -> bfloat16 / float32 casts turned the NaN codes (0x7F, 0xFF) into +-480 (the
  generic float conversion knows no e4m3fn NaN); they give NaN, as ``cvt`` does on the GPU.
- float32 -> float8 e4m3fn casts rounded differently from the GPU's ``cvt.rn.satfinite`` (102
  of 4096 random values); they round to nearest even and saturate at +-448, as it does.
- a one-element tensor that is not 0-d (a value loaded as a 1-block) used as a Python int
  (``tl.range`` bounds) raised; it is taken by ``.item()`` (one element only, as in 3.8).
"""


def _rne_bf16_bits(x):
    """float32 array -> bfloat16 bits (uint16), round to nearest even, NaN stays a quiet NaN."""
    import numpy as np

    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return np.where(nan, (u >> 16) | 0x0040, rounded).astype(np.uint16)


def _satfinite_e4m3_bits(x):
    """float32 array -> e4m3fn codes (uint8), round to nearest even, saturating at +-448 and
    NaN kept, as ``cvt.rn.satfinite.e4m3x2.f32`` does on sm_90."""
    import numpy as np
    import torch

    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    t = torch.where(t.isnan(), t, t.clamp(-448.0, 448.0))
    return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def patch_triton_interpreter():
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    builder = ti.InterpreterBuilder
    if getattr(builder, "_mono_ext_patched", False):
        return

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            bits = np.asarray(h.data).astype(np.uint32) << 16
            return ti.TensorHandle(bits.view(np.float32), tl.float32)
        return h

    stock_dot = builder.create_dot

    def create_dot(self, a, b, *rest):
        return stock_dot(self, widen(a), widen(b), *rest)

    stock_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return ti.TensorHandle(_rne_bf16_bits(src.data), dst_type.scalar)
        return stock_cast(self, src, dst_type)

    stock_fp_to_fp = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar == tl.float32:
            return ti.TensorHandle(_satfinite_e4m3_bits(src.data), dst_type.scalar)
        out = stock_fp_to_fp(self, src, dst_type, rounding_mode)
        if src.dtype.scalar != tl.float8e4nv:
            return out
        nan = (np.asarray(src.data).view(np.uint8) & 0x7F) == 0x7F
        if not nan.any():
            return out
        data = np.array(out.data, copy=True)
        data[nan] = 0x7FC0 if dst_type.scalar == tl.bfloat16 else np.nan
        return ti.TensorHandle(data, out.dtype)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl
    builder.create_fp_to_fp = create_fp_to_fp
    builder._mono_ext_patched = True

    stock_patch_tensor = getattr(ti, "_patch_lang_tensor", None)
    if stock_patch_tensor is not None:

        def _patch_lang_tensor(tensor, scope):
            stock_patch_tensor(tensor, scope)
            scope.set_attr(
                tensor, "__index__", lambda self: int(np.asarray(self.handle.data).item())
            )

        ti._patch_lang_tensor = _patch_lang_tensor
