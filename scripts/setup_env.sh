#!/usr/bin/env bash
# Create (or update) the project's virtual environment: Python 3.11, the pinned NeMo 2.7.3 stack on the CPU, and
# nemo-patch itself installed in editable mode with its llm, test, dev and docs extras (which also installs the
# overlay's start-up hook, nemo_patch.pth).
#
# Usage: bash scripts/setup_env.sh            # venv in .venv (override with NEMO_PATCH_VENV=path)
#        NEMO_PATCH_CONSTRAINTS=constraints/nemo-2.5.3.txt NEMO_PATCH_VENV=.venv-nemo-2.5 bash scripts/setup_env.sh
#                                             # the other supported NeMo line (docs/installation.md, "Supported stack")
# Idempotent: a stamp records the hash of what the install copies (pyproject.toml, the constraints, the start-up
# hook files); nothing is done when they are unchanged.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv="${NEMO_PATCH_VENV:-.venv}"
constraints="${NEMO_PATCH_CONSTRAINTS:-constraints/nemo-2.7.3.txt}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3

stamp="$venv/.nemo-patch-setup"
want="$(cat pyproject.toml "$constraints" _nemo_patch_autoload.py nemo_patch.pth scripts/setup_env.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  echo "setup_env: $venv is up to date"
  exit 0
fi

echo "setup_env: creating $venv with $("$python" --version 2>&1) (about 2-4 minutes the first time)"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
# torch first, pinned, so that no resolver step can reach for a multi-GB CUDA build.
"${pip[@]}" install -q -c "$constraints" "torch==2.13.0"
"${pip[@]}" install -q -c "$constraints" -e ".[llm,test,dev,docs]"
echo "$want" > "$stamp"
echo "setup_env: done"
