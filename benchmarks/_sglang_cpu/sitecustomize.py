"""CPU stand-ins for SGLang's Triton-only ops, applied in every process of a
``e2e_sglang.py --cpu-smoke`` run (this folder is on PYTHONPATH there only, and SGLang's
scheduler is a spawned process: the patches must come with the interpreter, not the caller).

After a listed module is imported, its Triton entry point is replaced by plain torch (Triton
has no CPU driver here). ``sgl_kernel`` (the folder next to this file) covers the C++ ops.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys


def _rms_norm_gated(
    x,
    g,
    weight,
    bias=None,
    activation="swish",
    residual=None,
    prenorm=False,
    residual_in_fp32=False,
    eps=1e-6,
    **kwargs,
):
    import torch
    import torch.nn.functional as F

    xf = x.float()
    if residual is not None:
        xf = xf + residual.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if bias is not None:
        y = y + bias.float()
    if g is not None:
        gf = g.float()
        y = y * (torch.sigmoid(gf) if activation == "sigmoid" else F.silu(gf))
    y = y.to(x.dtype)
    return (y, xf.to(x.dtype)) if prenorm else y


def _patch_norm_gate(mod):
    mod.rms_norm_gated = _rms_norm_gated


def _gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states):
    import torch

    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float())
    final_hidden_states.add_((gate[:, None] * shared_output.float()).to(final_hidden_states.dtype))


def _patch_elementwise(mod):
    mod.fused_gate_sigmoid_mul_add = _gate_sigmoid_mul_add


PATCHES = {
    "sglang.kernels.ops.elementwise.elementwise": _patch_elementwise,
    "sglang.kernels.ops.attention.fla.fused_norm_gate": _patch_norm_gate,
}


class _After(importlib.abc.MetaPathFinder):
    """Runs PATCHES[name] right after module ``name`` has executed."""

    def find_spec(self, name, path=None, target=None):
        if name not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        orig = loader.exec_module

        def exec_module(module, _orig=orig, _name=name):
            _orig(module)
            PATCHES[_name](module)

        loader.exec_module = exec_module
        return spec


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    sys.meta_path.insert(0, _After())
