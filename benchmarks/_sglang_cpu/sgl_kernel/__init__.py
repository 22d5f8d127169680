"""Stand-in for ``sgl_kernel`` on SGLang's CPU build, for ``e2e_sglang.py --cpu-smoke`` only.

SGLang 0.5.17 with ``SGLANG_USE_CPU_ENGINE=1`` imports ``sgl_kernel`` (its C++ CPU ops) at
module level and calls a few of its ops on the GDN path; the CPU venv has no ``sgl_kernel``.
This package makes those imports succeed and gives the GDN ops plain-torch implementations
(:mod:`.mamba`: causal conv1d prefill/update, GDN gating, the gated delta rule over a
sequence and for one decode token), so a whole ``sglang.Engine`` prefills and decodes the tiny
model on CPU. Every other name is a function that raises when called (they sit on paths the
smoke run does not take: speculative decoding, AMX-packed weights). Nothing here registers
``convert_weight_packed``: SGLang reads its presence as "the AMX backend is available" and
would then route norms, MoE and linears to ops that are not here.
"""

from __future__ import annotations

import torch

from . import mamba as _mamba


def _stub(name: str):
    def f(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel CPU stand-in has no {name}")

    f.__name__ = name
    return f


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _stub(name)


# the torch.ops.sgl_kernel names SGLang's CPU path looks up (at import or per call)
for _name, _fn in {
    "fused_gdn_gating_cpu": _mamba.fused_gdn_gating_cpu,
    "fused_sigmoid_gating_delta_rule_update_cpu": _mamba.fused_sigmoid_gating_delta_rule_update_cpu,
}.items():
    setattr(torch.ops.sgl_kernel, _name, _fn)
