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

"""The processes that exist to consolidate back torch's large tensors with huge pages; training processes do not."""

import os
import subprocess
import sys

import pytest

from nemo_patch.engine.huge_pages import THP_VARIABLE, prefer_huge_pages

#: Prints whether a new 64 MiB tensor's mapping is marked ``madvise(MADV_HUGEPAGE)`` (``hg`` in its ``VmFlags``,
#: proc(5)): c10 marks it so exactly when it read THP_MEM_ALLOC_ENABLE=1, whatever the kernel's THP mode.
HUGE = """
import torch
tensor = torch.empty(64 << 20, dtype=torch.uint8)
address, inside = tensor.data_ptr(), False
for line in open("/proc/self/smaps"):
    field = line.split()[0]
    if "-" in field and not field.endswith(":"):
        low, high = (int(bound, 16) for bound in field.split("-"))
        inside = low <= address < high
    elif inside and field == "VmFlags:":
        print("hg" in line.split()[1:])
        break
"""


def _run(code, **environment):
    env = {name: value for name, value in os.environ.items() if name != THP_VARIABLE}
    env.update(environment)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_variable_is_set_only_where_unset(monkeypatch):
    monkeypatch.delenv(THP_VARIABLE, raising=False)
    assert prefer_huge_pages() is ("torch" not in sys.modules)
    assert os.environ[THP_VARIABLE] == "1"
    monkeypatch.setenv(THP_VARIABLE, "0")
    assert prefer_huge_pages() is False and os.environ[THP_VARIABLE] == "0"  # the user's choice is kept


def test_torch_marks_large_tensors_for_huge_pages_only_after_prefer_huge_pages_before_its_import():
    prefix = "from nemo_patch.engine.huge_pages import prefer_huge_pages; print(prefer_huge_pages())\n"
    assert _run(prefix + HUGE) == ["True", "True"]
    # too late once torch has allocated a CPU tensor: c10 read the variable then
    assert _run("import torch\ntorch.zeros(1)\n" + prefix + HUGE) == ["False", "False"]
    assert _run(prefix + HUGE, **{THP_VARIABLE: "0"}) == ["False", "False"]
    assert _run("import nemo_patch\n" + HUGE) == ["False"]  # importing the package changes nothing


@pytest.mark.parametrize(
    "entry, arguments",
    [
        ("from nemo_patch.cli.nemo_consolidate import main", []),
        # as the overlay starts it (nemo_patch.overlay.extensions.launch), less --parent: no parent to die with here
        ("from nemo_patch.training.worker import main", ["--extension", "nemo_patch.overlay.extensions"]),
    ],
    ids=["nemo-consolidate", "consolidation-process"],
)
def test_the_consolidating_entry_points_turn_it_on_before_torch(entry, arguments, tmp_path):
    argv = [str(tmp_path / "missing"), *arguments]
    code = f"{entry}\nmain({argv!r})\n" + HUGE  # fails on the path, after the switch
    assert _run(code) == ["True"]


def test_the_overlay_starts_its_consolidation_process_with_the_extension_that_turns_it_on():
    from nemo_patch.overlay.extensions import launch

    args, _ = launch(["checkpoint"], {})
    assert args[args.index("--extension") + 1] == "nemo_patch.overlay.extensions"
