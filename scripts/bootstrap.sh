#!/usr/bin/env bash
# Creates .venv and installs the project with its test extras. Idempotent: a second run with nothing
# changed only checks a stamp and returns (changing PUZZLETRON_TORCH or pyproject.toml reinstalls). torch
# goes in first, pinned by PUZZLETRON_TORCH (default 2.13.0), and stays pinned while the dependencies
# install, so none of them swaps it for another version. The pin chooses the version, not the build: from
# PyPI a plain version is the multi-GB CUDA build on Linux; ask for the CPU one with a local version
# (PUZZLETRON_TORCH=2.13.0+cpu) and PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
# The torchao / torch _pytree lines transformers prints when it loads a model or processor come from torchao
# (a NeMo AutoModel dependency); no torchao pin or setting removes them without hiding real warnings, so none
# is made here (README, "Try it").
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_PIN="${PUZZLETRON_TORCH:-2.13.0}"
PYTHON="${PUZZLETRON_PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3

stamp=.venv/.bootstrap-stamp
want="torch=$TORCH_PIN $(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/puzzletron-data ]; then
    exit 0
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==$TORCH_PIN"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]" "torch==$TORCH_PIN"
echo "$want" > "$stamp"
