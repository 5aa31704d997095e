#!/usr/bin/env bash
# Create (or update) the project's virtual environment: Python 3.11, the pinned NeMo 2.7.3 stack on the CPU, and
# nemo-patch itself installed in editable mode with its llm, test, dev and docs extras (which also installs the
# overlay's start-up hook, nemo_patch.pth).
#
# Usage: bash scripts/setup_env.sh            # venv in .venv (override with NEMO_PATCH_VENV=path)
#        PYTHON=python3.12 NEMO_PATCH_CONSTRAINTS=constraints/nemo-2.5.3.txt NEMO_PATCH_VENV=.venv-nemo-2.5 \
#          bash scripts/setup_env.sh          # the other supported NeMo line, on the 25.09 container's Python 3.12
#                                             # (docs/installation.md, "Supported stack")
# PYTHON names the interpreter (default python3.11): a command, a path, or a pyenv version installed but not selected
# (its shim then fails to run; the newest installed pyenv version of that minor is used). On Python 3.11, torch 2.13.0
# is the CPU build on this machine's disk; for any other Python, PyPI serves only CUDA builds of torch for Linux
# x86_64, so the install downloads one (torch 2.13.0+cu130, 527 MB, and the CUDA libraries it needs): the venv is
# 6.5 GB instead of 2.7 GB (Python 3.12, NeMo 2.5.3: 7 min 36 s on a shared 2-core machine). It runs on the CPU all the
# same (CUDA is never initialised without a GPU).
# Idempotent: a stamp records the hash of what the install copies (pyproject.toml, the constraints, the start-up
# hook files); nothing is done when they are unchanged.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv="${NEMO_PATCH_VENV:-.venv}"
constraints="${NEMO_PATCH_CONSTRAINTS:-constraints/nemo-2.7.3.txt}"
python="${PYTHON:-python3.11}"
if ! "$python" -c pass >/dev/null 2>&1; then
  minor="${python##*/}"; minor="${minor#python}"
  found=""
  if [ -n "$minor" ] && command -v pyenv >/dev/null 2>&1; then
    version="$(pyenv versions --bare 2>/dev/null | grep -E "^${minor//./\\.}(\\.[0-9]+)?$" | sort -V | tail -1 || true)"
    [ -n "$version" ] && found="$(pyenv root)/versions/$version/bin/python$minor"
  fi
  if [ -n "$found" ] && "$found" -c pass >/dev/null 2>&1; then
    python="$found"
  elif [ -z "${PYTHON:-}" ]; then
    python=python3
  else
    echo "setup_env: PYTHON=$PYTHON does not run, and no pyenv version $minor is installed" >&2
    exit 1
  fi
fi

stamp="$venv/.nemo-patch-setup"
interpreter="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
want="$( (cat pyproject.toml "$constraints" _nemo_patch_autoload.py nemo_patch.pth scripts/setup_env.sh; echo "$interpreter") | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  echo "setup_env: $venv is up to date"
  exit 0
fi
if [ -x "$venv/bin/python" ] && [ "$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" != "$interpreter" ]; then
  echo "setup_env: $venv has another Python; recreating it with Python $interpreter"
  rm -rf "$venv"
fi

echo "setup_env: creating $venv with $("$python" --version 2>&1) (about 2-4 minutes the first time)"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
# torch first, pinned, so that no resolver step can reach for another build: on Python 3.11 the CPU wheel on disk; on
# another Python, PyPI's (CUDA) build of the same version.
"${pip[@]}" install -q -c "$constraints" "torch==2.13.0"
"${pip[@]}" install -q -c "$constraints" -e ".[llm,test,dev,docs]"
echo "$want" > "$stamp"
echo "setup_env: done"
