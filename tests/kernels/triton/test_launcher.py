"""``kernels.triton.launcher``: a launch planned once and run with new per-step values.

Runs anywhere Triton imports, without the interpreter: a real ``@triton.jit`` kernel's parameters, with
its ``warmup`` replaced by one that records what it was asked and hands back a stand-in for
the compiled kernel, so the test sees the exact call the launcher makes (Triton's JIT calls
``CompiledKernel.run`` with every parameter, constexprs included, in signature order).
test_launcher_run.py launches the kernel itself.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

from mono_ext.kernels.triton import launcher  # noqa: E402
from mono_ext.kernels.triton.launcher import (  # noqa: E402
    ROWS,
    FrozenLaunch,
    FrozenLaunches,
    Live,
    live_template,
    live_values,
)

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("the interpreter's kernels have no parameters to plan", allow_module_level=True)

N = 64


@triton.jit(do_not_specialize=["n_rows"])
def _axpy(x_ptr, y_ptr, out_ptr, n_rows, scale, N: tl.constexpr, BB: tl.constexpr,
          SHIFT: tl.constexpr = 0.0):  # fmt: skip
    r = tl.arange(0, BB)[:, None]
    c = tl.arange(0, N)[None, :]
    m = (r < n_rows) & (c < N)
    x = tl.load(x_ptr + r * N + c, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + r * N + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * N + c, (x * scale + y + SHIFT).to(out_ptr.dtype.element_ty), mask=m)


class _Compiled:
    """Stands in for the CompiledKernel that ``warmup`` returns; records each ``run``."""

    function, packed_metadata = "fn-handle", "packed"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)

    def launch_metadata(self, grid, stream, *args):
        return ("meta", grid, stream, len(args))


@pytest.fixture
def recorded(monkeypatch):
    compiled, asked = _Compiled(), []

    def warmup(*args, grid, **kwargs):
        asked.append((args, grid, kwargs))
        return compiled

    monkeypatch.setattr(_axpy, "warmup", warmup)
    monkeypatch.setattr(_axpy, "device_caches", {0: (None, None, None, None, _sig_binder)})
    monkeypatch.setattr(launcher, "_current_device", lambda: 0)
    monkeypatch.setattr(launcher, "_current_stream", lambda device: 7000 + device)
    return compiled, asked


def _sig_binder(*args, **kwargs):
    """What Triton's binder returns first, by its own definition ("sig.bind followed by
    apply_defaults"; keywords that are no parameter are launch options)."""
    sig = inspect.signature(_axpy.fn)
    options = {k: kwargs.pop(k) for k in list(kwargs) if k not in sig.parameters}
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments), None, options


def _bufs(rows, dtype=torch.bfloat16, n=N):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, n, generator=g).to(dtype)
    y = torch.randn(rows, n, generator=g).to(dtype)
    return x, y, torch.full((rows, n), float("nan")).to(dtype)


def _plan(x, y, out, *, compiled, passes=None):
    t, names, values = live_template((x, y, out), (0, 1, 2))
    template = [*t, Live(ROWS), 0.5]
    passes = passes or [dict(N=N, BB=16, num_warps=1)]
    return FrozenLaunch(_axpy, 1, template, names, values, passes, compiled=compiled, max_rows=16)


def test_compiled_run_passes_every_parameter_in_signature_order(recorded):
    compiled, asked = recorded
    x, y, out = _bufs(3)
    fl = _plan(x, y, out, compiled=True)
    args, grid, kwargs = asked[0]
    assert grid == (1, 1, 1) and args == (x, y, out, 3, 0.5)  # the first step's values
    assert kwargs == dict(N=N, BB=16, num_warps=1)
    x2, y2, out2 = _bufs(5)
    fl.run(live_values((x2, y2, out2), (0, 1, 2)))
    (call,) = compiled.calls
    # grid, stream, function, packed metadata, launch metadata, enter and exit hooks, args
    hooks = (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook)
    meta = ("meta", (1, 1, 1), 7000, 8)  # launch_metadata(grid, stream, *the 8 parameters)
    assert call[:9] == (1, 1, 1, 7000, "fn-handle", "packed", meta, *hooks)
    # positional args with the new values, then N, BB and SHIFT's default (num_warps is an
    # option, not a parameter)
    assert call[9:] == (x2, y2, out2, 5, 0.5, N, 16, 0.0)


def test_runs_with_the_launch_hooks_set_at_run_time(recorded, monkeypatch):
    compiled, _ = recorded
    x, y, out = _bufs(2)
    fl = _plan(x, y, out, compiled=True)
    hook = lambda meta: None  # noqa: E731
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", hook)
    fl.run(live_values((x, y, out), (0, 1, 2)))
    assert compiled.calls[0][7] is hook


def test_fits_holds_live_tensors_to_the_planned_variant(recorded):
    x, y, out = _bufs(4)
    fl = _plan(x, y, out, compiled=True)

    def fits(*bufs):
        return fl.fits(live_values(bufs, (0, 1, 2)))

    assert fits(*_bufs(1)) and fits(*_bufs(16))
    big = _bufs(17)
    assert not fits(*big)  # rows 1..16 only
    xs, ys, outs = _bufs(4, n=2 * N)
    assert not fits(xs, ys, outs)  # trailing shape
    assert not fits(x.float(), y, out)  # dtype
    flat = torch.empty(4 * N + 8, dtype=torch.bfloat16)
    assert not fits(flat[1 : 1 + 4 * N].view(4, N), y, out)  # 2-byte, not 16-byte, aligned
    wide = torch.empty(4, 2 * N, dtype=torch.bfloat16)
    assert not fits(wide[:, :N], y, out)  # not contiguous
    assert not fits(x, y[:3], out)  # a tensor with other rows than the count
    assert not fits(x, None, out)  # None where a tensor was planned


def test_a_value_planned_as_none_must_stay_none(recorded):
    x, y, out = _bufs(2)
    t, names, values = live_template((x, None, out), (0, 1, 2))
    assert t[1] is None and values[1] is None
    fl = FrozenLaunch(_axpy, 1, [t[0], t[0], t[2], Live(ROWS), 0.5], names, values,
                      [dict(N=N, BB=16)], compiled=True, max_rows=16)  # fmt: skip
    assert fl.fits(live_values((x, None, out), (0, 1, 2)))
    assert not fl.fits(live_values((x, y, out), (0, 1, 2)))


def test_a_table_other_than_tritons_binding_is_refused(recorded, monkeypatch):
    def binder(*args, **kwargs):
        params, spec, options = _sig_binder(*args, **kwargs)
        return {**params, "extra": 1}, spec, options

    monkeypatch.setattr(_axpy, "device_caches", {0: (None, None, None, None, binder)})
    x, y, out = _bufs(2)
    with pytest.raises(RuntimeError, match="differs from Triton's binding"):
        _plan(x, y, out, compiled=True)


def test_compiled_launch_takes_one_pass(recorded):
    x, y, out = _bufs(2)
    with pytest.raises(ValueError, match="one pass"):
        _plan(x, y, out, compiled=True, passes=[dict(N=N, BB=16), dict(N=N, BB=16)])


def test_frozen_launches_replan_only_when_needed(recorded):
    x, y, out = _bufs(4)
    cache, plans = FrozenLaunches(), []

    def plan():
        plans.append(1)
        return _plan(x, y, out, compiled=True)

    layer_a, layer_b = object(), object()
    first = cache.get("k", layer_a, live_values((x, y, out), (0, 1, 2)), plan)
    again = cache.get("k", layer_a, live_values(_bufs(9), (0, 1, 2)), plan)
    assert again is first and len(plans) == 1  # other rows and buffers: same plan
    cache.get("k", layer_b, live_values((x, y, out), (0, 1, 2)), plan)
    assert len(plans) == 2  # another bound layer object
    cache.get("k", layer_b, live_values((x.float(), y, out), (0, 1, 2)), plan)
    assert len(plans) == 3 and len(cache) == 1  # no longer fits: planned again, replaced
