#!/usr/bin/env bash
# Usage: tools/ci/install_sglang_cpu.sh VENV_DIR
#
# The CPU test environment of the SGLang adapter (tests/engines/sglang, marked sglang):
#   - SGLang 0.5.17 (the release the H200 runs), without its CUDA dependencies, on the
#     torch 2.13 CPU build; the Python packages it imports on the text-model path;
#   - a torchvision stand-in: 0.5.17 imports torchvision at module level and the registry's
#     torchvision wheels want CUDA libtorch; the stand-in raises when anything is called;
#   - mono_ext (editable) with its test dependencies;
#   - SGLang 0.5.23 (no dependencies) in VENV/overlays/sglang-0.5.23, which
#     tests/engines/sglang/test_sglang_native_api.py puts first on PYTHONPATH in a child process to test
#     registration through 0.5.23's kernel-plugin API against the real package.
# SGLang's own MoE/GDN/attention forwards do not run on CPU; model construction, weight
# loading, the memory pools and dispatch do, which is what the tests use.
set -euo pipefail
VENV=${1:?usage: install_sglang_cpu.sh VENV_DIR}
# absolute: the .pth file below names a folder inside it, and a relative .pth entry is
# resolved against site-packages
VENV=$(realpath -m "$VENV")
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3}
SGLANG=0.5.17
SGLANG_API=0.5.23

"$PY" -m venv "$VENV"
# Every install of the environment proper under its pins (the versions it passed with).
PIP=("$VENV/bin/python" -m pip install -q -c "$ROOT/tools/ci/constraints/sglang.txt")
"${PIP[@]}" --upgrade pip
# The CPU torch first: resolved freely, pip could pick a multi-GB CUDA build.
"${PIP[@]}" torch==2.13.0 triton==3.6.0
"${PIP[@]}" --no-deps "sglang==$SGLANG"
# What sglang 0.5.17 imports to build and load Qwen3-Next / Qwen3.5-MoE on CPU (0.5.17 needs
# transformers 5.12; it does not import with 5.17).
"${PIP[@]}" transformers==5.12.1 openai==2.6.1 xgrammar==0.2.1 apache-tvm-ffi==0.1.11 \
  compressed-tensors gguf numpy msgspec pydantic orjson psutil pyzmq requests aiohttp fastapi \
  uvicorn uvloop einops packaging tqdm pybase64 setproctitle interegular partial_json_parser \
  sentencepiece tiktoken safetensors pillow xxhash prometheus-client python-multipart ipython dill

# torchvision stand-in, on the path through a .pth file (kept out of site-packages proper).
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
TV="$VENV/cpu-stand-ins/torchvision"
mkdir -p "$TV/transforms/v2"
cat > "$TV/_standin.py" <<'PYEOF'
"""mono_ext CI stand-in for torchvision: names import, calls raise."""
import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def missing(module, name):
    def call(*args, **kwargs):
        raise NotImplementedError(f"{module}.{name} is not available (CPU test stand-in)")

    call.__name__ = name
    return call
PYEOF
printf '"""CPU test stand-in for torchvision (see _standin)."""\n__version__ = "0.0.0+standin"\n' \
  > "$TV/__init__.py"
for mod in io transforms/__init__ transforms/functional transforms/v2/__init__ \
  transforms/v2/functional; do
  dotted="torchvision.${mod%/__init__}"
  dotted=${dotted//\//.}
  cat > "$TV/$mod.py" <<PYEOF
from torchvision._standin import ImageReadMode, InterpolationMode, missing  # noqa: F401


def __getattr__(name):
    return missing("$dotted", name)
PYEOF
done
echo "$VENV/cpu-stand-ins" > "$SITE/zz_mono_ext_cpu_stand_ins.pth"

# mono_ext and its test dependencies
"${PIP[@]}" -e "$ROOT" pytest pluggy safetensors

# SGLang 0.5.23 beside it (its kernel-plugin API; imports under torch 2.13 on CPU): one
# distribution at an exact version and no dependencies, so nothing for constraints to hold,
# and the environment's constraints would refuse it (they pin sglang at $SGLANG)
"$VENV/bin/python" -m pip install -q --no-deps --target "$VENV/overlays/sglang-$SGLANG_API" \
  "sglang==$SGLANG_API"

"$VENV/bin/python" -c "
import sglang, sglang.srt.models.qwen3_next, sglang.srt.models.qwen3_5, mono_ext.engines.sglang
print('sglang', sglang.__version__, 'imports; mono_ext adapter imports')"
PYTHONPATH="$VENV/overlays/sglang-$SGLANG_API" "$VENV/bin/python" -c "
import sglang, sglang.kernels.plugin_kernels.nvidia.spec
print('sglang', sglang.__version__, 'overlay: kernel-plugin API imports')"
