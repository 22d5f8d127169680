#!/usr/bin/env bash
# Usage: tools/ci/freeze_constraints.sh NAME VENV
#
# Writes tools/ci/constraints/NAME.txt, the pip constraints (-c) that tools/test.sh and the
# install scripts build test environment NAME (base, vllm, sglang, flydsl) with, from VENV, a
# venv of that environment whose tests pass: every installed distribution, pip and setuptools
# included (the scripts upgrade pip), but mono-ext itself. The pins are what makes a fresh
# clone resolve the versions that passed; tools/test.sh's stamp hashes the file, so a changed
# pin rebuilds that environment.
set -euo pipefail
NAME=${1:?usage: freeze_constraints.sh NAME VENV}
VENV=${2:?usage: freeze_constraints.sh NAME VENV}
OUT="$(cd "$(dirname "$0")" && pwd)/constraints/$NAME.txt"
mkdir -p "$(dirname "$OUT")"
PINS=$("$VENV/bin/python" -m pip freeze --all --exclude-editable | grep -iv '^mono[-_]ext==')
{
  echo "# The $NAME test environment's pins (tools/ci/freeze_constraints.sh $NAME VENV)."
  echo "$PINS"
} > "$OUT"
echo "$OUT: $(grep -vc '^#' "$OUT") pins"
