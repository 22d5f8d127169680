"""Scale every floating parameter of an SGLang model in place, once, after its graphs are
captured: the ``--weight-scale`` of ``e2e_sglang.py``.

SGLang's ``load_format="dummy"`` fills parameters uniform in +-1e-3 (logits and router scores
nearly flat, every greedy token a near tie). SGLang 0.5.17 has no call into a scheduler's
model from the offline ``Engine`` other than its RPCs, but it does import and call the
factories of ``ServerArgs.forward_hooks`` in each scheduler, right after CUDA-graph capture
and before the first request (``register_forward_hooks(model, specs)`` in
``model_runner_components/cuda_graph_setup.py``). :func:`factory` is such a factory: it finds
that call's ``model`` argument one frame up, scales the model there
(``_e2e_runner.scale_floating``: graphs keep their pointers; mono_ext reads the engine's
tensors in place), writes what it did to ``config["record"]`` and returns a no-op hook. It
raises where the frame holds no model, so a changed SGLang fails the run instead of measuring
unscaled weights.
"""

from __future__ import annotations

import json
import sys
from typing import Any

# the schedulers find this folder on PYTHONPATH (e2e_sglang.entry_pythonpath)
from _e2e_runner import scale_floating


def factory(config: dict[str, Any]):
    import torch

    frame = sys._getframe(1)
    model = frame.f_locals.get("model")
    if not isinstance(model, torch.nn.Module):
        raise RuntimeError(
            f"_sglang_scale: no model in the caller {frame.f_code.co_name!r}; SGLang's "
            "forward_hooks no longer pass it"
        )
    scale = float(config["scale"])
    n = scale_floating(model, scale)
    if config.get("record"):
        with open(config["record"], "w") as f:
            json.dump({"scaled": n, "scale": scale, "model": type(model).__name__}, f)
    return lambda module, args, output: None
