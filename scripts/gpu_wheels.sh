#!/usr/bin/env bash
# Copyright (c) 2026, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

# Collect the wheels that scripts/gpu_check.py needs on the GPU machine (CPython 3.12, x86-64, no network; it has
# torch, lightning, transformers 5.x, huggingface-hub 1.x, numpy 2.x, ... but no NeMo stack), within its 64 MiB.
# Why each wheel is there, and how the set was found and checked: docs/gpu-wheels.md.
#
# Usage: bash scripts/gpu_wheels.sh [DIR]      # default gpu-wheels/ at the repo root (keep it out of git:
#                                              # echo gpu-wheels/ >> .git/info/exclude)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dir="${1:-gpu-wheels}"
limit=$((64 * 1024 * 1024))
python="${PYTHON:-python3}"
pip=("$python" -m pip --disable-pip-version-check)
# The GPU machine's target. manylinux_2_31 is for nvidia-resiliency-ext 0.4.1 (its only cp312 build).
target=(--python-version 3.12 --implementation cp --only-binary :all:
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
  --platform manylinux_2_31_x86_64)

# Exact pins, all as in constraints/nemo-2.7.3.txt. Everything else gpu_check imports is the GPU machine's own.
pins=(
  nemo-toolkit==2.7.3 megatron-core==0.15.3 lightning==2.4.0 # lightning: nv-one-logger's trainer fails on 2.6
  nvidia-modelopt==0.37.0 PuLP==3.3.2 torchprofile==0.1.0     # llm.api (llm.train) and checkpoint saving
  nvidia-resiliency-ext==0.4.1 defusedxml==0.7.1              # NeMoLogger's local-checkpoint callback check
  fiddle==0.3.1 absl-py==2.5.1 libcst==1.9.0 graphviz==0.21 cloudpickle==3.0.0 wrapt==2.5.2
  omegaconf==2.3.0 hydra-core==1.3.2 onnx==1.17.0  # protobuf: the machine's (7.x); 5.29 broke its tensorboard
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5  # nv-one-logger; not there
  nv-one-logger-core==2.3.1 nv-one-logger-training-telemetry==2.3.1
  nv-one-logger-pytorch-lightning-integration==2.3.1 StrEnum==0.4.15 overrides==7.7.0 toml==0.10.2
  datasets==4.0.0 multiprocess==0.70.16 dill==0.3.8
  nemo_run==0.7.0 catalogue==2.0.10 torchx==0.7.0 typing-inspect==0.9.0 mypy_extensions==1.2.0
  pyre-extensions==0.0.32 docstring_parser==0.18.0
  paramiko==5.1.0 fabric==3.2.3 invoke==2.2.1 decorator==5.3.1 cryptography==42.0.8 cffi==2.1.1 bcrypt==5.0.0
  PyNaCl==1.6.2
  leptonai==0.27.3 ledoc-ui==0.1.0 loguru==0.7.3 contextlib2==21.6.0 exceptiongroup==1.3.2 pillow==13.0.0
  fastapi==0.163.2 starlette==0.52.1 opentelemetry-api==1.45.2 uvicorn==0.54.0
  prometheus-fastapi-instrumentator==7.0.0 prometheus_client==0.26.0
)
# Published as sdists only (pure Python): built here into py3-none-any wheels.
sdists=(antlr4-python3-runtime==4.9.3 wget==3.2)

mkdir -p "$dir"
for pin in "${pins[@]}" "${sdists[@]}"; do # warn if the constraints moved on
  grep -qix "$pin" constraints/nemo-2.7.3.txt || echo "gpu_wheels: warning: $pin is not in constraints/nemo-2.7.3.txt"
done
"${pip[@]}" download -q --no-deps "${target[@]}" -d "$dir" "${pins[@]}"
"${pip[@]}" wheel -q --no-deps -w "$dir" "${sdists[@]}" .   # the two sdists, and nemo-patch itself

# Slim two wheels (same name, RECORD rewritten): drop PuLP's CBC binaries for other platforms (modelopt only imports
# pulp) and onnx's backend test data (NeMo only imports onnx). Saves 25 MiB; idempotent (a rerun re-downloads the
# two: pip warns of their changed hash).
"$python" - "$dir" <<'EOF'
import glob, os, sys, zipfile
drops = {"pulp-*.whl": ["pulp/solverdir/cbc/win/", "pulp/solverdir/cbc/osx/", "pulp/solverdir/cbc/linux/i32/",
                        "pulp/solverdir/cbc/linux/arm64/"],
         "onnx-*.whl": ["onnx/backend/test/data/"]}
for pattern, prefixes in drops.items():
    for path in glob.glob(os.path.join(sys.argv[1], pattern)):
        prefixes = tuple(prefixes)
        with zipfile.ZipFile(path) as zin, zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as zout:
            for item in zin.infolist():
                if item.filename.startswith(prefixes):
                    continue
                data = zin.read(item)
                if item.filename.endswith(".dist-info/RECORD"):
                    data = b"".join(l for l in data.splitlines(True) if not l.decode().startswith(prefixes))
                zout.writestr(item, data)
        os.replace(path + ".tmp", path)
EOF

total=$(cat "$dir"/*.whl | wc -c)
echo "gpu_wheels: $(ls "$dir"/*.whl | wc -l) wheels, $((total / 1024 / 1024)) MiB ($total bytes) in $dir"
if [ "$total" -gt "$limit" ]; then
  echo "gpu_wheels: FAIL: over the GPU machine's 64 MiB" >&2
  exit 1
fi

# Verify: every pin is present and installable for CPython 3.12 from $dir alone (no index, no config's find-links).
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
for req in "${pins[@]}" "${sdists[@]}" "nemo-patch==$version"; do
  env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "${pip[@]}" install -q --dry-run --no-index --no-deps \
    --find-links "$dir" "${target[@]}" --target "$tmp" "$req" || { echo "gpu_wheels: FAIL: $req" >&2; exit 1; }
done
echo "gpu_wheels: PASS: all $((${#pins[@]} + ${#sdists[@]} + 1)) pins install from $dir for CPython 3.12"
echo "On the GPU machine, from the repo root (the working tree first on PYTHONPATH, so its nemo_patch is the one run):"
echo "  pip install --no-index --no-deps --target /tmp/gpuw $dir/*.whl"
echo "  PYTHONPATH=\$PWD:/tmp/gpuw python3 scripts/gpu_check.py"
