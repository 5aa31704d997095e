#!/usr/bin/env python
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

"""What the installed overlay hook costs at interpreter start-up.

Runs ``python -c pass`` in this interpreter's environment (where ``nemo_patch.pth`` is installed) many times, and the
same with the hook's ``.pth`` line suppressed (``site`` skipped, then every site directory added back through
``site.addsitedir`` except for ``nemo_patch.pth``), and prints both medians side by side, plus the hook's own import
time from ``python -X importtime``. Start-up never imports NeMo or torch either way.

Usage: .venv/bin/python scripts/bench_startup.py [--runs 30]
"""

import argparse
import statistics
import subprocess
import sys
import time

WITHOUT_HOOK = (
    "import site, sys, os\n"
    "for d in site.getsitepackages():\n"
    "    names = [n for n in os.listdir(d) if n.endswith('.pth') and n != 'nemo_patch.pth']\n"
    "    sys.path.append(d)\n"
    "    for n in sorted(names): site.addpackage(d, n, None)\n"
)


def _median_seconds(argv, runs):
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    with_hook = _median_seconds([sys.executable, "-c", "pass"], args.runs)
    without_hook = _median_seconds([sys.executable, "-S", "-c", WITHOUT_HOOK], args.runs)
    importtime = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, text=True, check=True
    ).stderr
    hook_us = sum(
        int(line.split("|")[0].split(":")[1])
        for line in importtime.splitlines()
        if line.rstrip().endswith(("_nemo_patch_autoload", "nemo_patch.overlay.hook"))
    )
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in ('nemo','torch')))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    print(f"python -c pass, median of {args.runs} runs")
    print(f"{'':28}{'wall ms':>10}")
    print(f"{'with nemo_patch.pth':28}{with_hook * 1e3:>10.1f}")
    print(f"{'without nemo_patch.pth':28}{without_hook * 1e3:>10.1f}")
    print(f"{'difference':28}{(with_hook - without_hook) * 1e3:>10.1f}")
    print(f"hook modules' import self time (-X importtime): {hook_us} us")
    print(f"nemo/torch modules loaded at start-up: {loaded}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
