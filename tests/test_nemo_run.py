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

"""NeMo-Run (docs/nemo-run.md): a recipe configured on a launcher without nemo-patch, serialised as NeMo-Run sends it
to a job, and rebuilt where nemo-patch is installed.

The launcher is stock NeMo (``NEMO_PATCH_DISABLE=1``; nemo_patch is never imported there): NeMo's
``llm.llama32_1b.pretrain_recipe``, the cadence set as ``nemo llm pretrain`` does with a command-line override
(``trainer.strategy.ckpt_consolidation_frequency=every_n:5``), then serialised with NeMo-Run's own
``ZlibJSONSerializer`` (what its executors pass to ``nemo_run.core.runners.fdl_runner`` in the job). A second
configuration adds ``ckpt_consolidation=run.Config(ConsolidationConfig, ...)`` and overrides one of its fields the same
way. Each is rebuilt as the runner does (deserialise, ``fdl.build``) in a fresh interpreter:

* with nemo-patch installed (its start-up hook: a ``pip install`` at job start or a derived image): both configure the
  cadence, the second the config too;
* with nemo-patch only on ``PYTHONPATH`` (``python -S``: no ``.pth`` start-up hook, as for a directory on the path):
  the second still works, because decoding its ``ConsolidationConfig`` imports nemo_patch; the first, a cadence alone,
  builds NeMo's unedited class, which takes the argument into its ``**kwargs`` and consolidates nothing.
"""

import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

LAUNCHER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import nemo_run as run
    from nemo.collections import llm
    from nemo_run.cli.cli_parser import parse_cli_args
    from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

    out = Path(sys.argv[1])
    recipe = llm.llama32_1b.pretrain_recipe(name="nemo-patch", dir=str(out), num_nodes=1, num_gpus_per_node=1)
    recipe = parse_cli_args(recipe, ["trainer.strategy.ckpt_consolidation_frequency=every_n:5"])
    (out / "cadence.txt").write_text(ZlibJSONSerializer().serialize(recipe))
    stock = "nemo_patch" not in sys.modules

    # The command line's way to a ConsolidationConfig: the factory, by its dotted name, then a field override.
    recipe = llm.llama32_1b.pretrain_recipe(name="nemo-patch", dir=str(out), num_nodes=1, num_gpus_per_node=1)
    recipe = parse_cli_args(recipe, ["trainer.strategy.ckpt_consolidation_frequency=every_n:5",
                                     "trainer.strategy.ckpt_consolidation=nemo_patch.consolidation_config(format=hf,"
                                     "dtype=bf16)", "trainer.strategy.ckpt_consolidation.keep=3"])
    (out / "factory.txt").write_text(ZlibJSONSerializer().serialize(recipe))

    from nemo_patch import ConsolidationConfig

    recipe.trainer.strategy.ckpt_consolidation = run.Config(ConsolidationConfig, format="hf", dtype="bf16")
    recipe = parse_cli_args(recipe, ["trainer.strategy.ckpt_consolidation.keep=3"])
    (out / "config.txt").write_text(ZlibJSONSerializer().serialize(recipe))
    print(json.dumps({"nemo_patch_imported_before_config": not stock}))
    """
)

#: NeMo-Run's runner in the job (``nemo_run.core.runners.fdl_runner``): deserialise, build; here the strategy only.
JOB = textwrap.dedent(
    """
    import json, sys
    import fiddle as fdl
    from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

    results = {}
    for path in sys.argv[1:]:
        recipe = ZlibJSONSerializer().deserialize(open(path).read())
        strategy = fdl.build(recipe.trainer.strategy)
        settings = getattr(strategy, "consolidation_settings", None)
        results[path.rsplit("/", 1)[-1]] = {
            "policy": str(settings.policy) if settings is not None and settings.policy is not None else None,
            "config": repr(settings.config) if settings is not None else None,
        }
    results["nemo_patch_imported"] = "nemo_patch" in sys.modules
    results["start_up_hook"] = "_nemo_patch_autoload" in sys.modules
    print(json.dumps(results))
    """
)


#: The page's own Python blocks, run as written (but for ``run.run``, which would submit the job), then the strategy
#: of the recipe they configure, built.
PAGE = textwrap.dedent(
    """
    import json, sys
    import fiddle as fdl

    code = json.loads(open(sys.argv[1]).read())
    namespace = {}
    exec(code, namespace)
    recipe, executor = namespace["recipe"], namespace["executor"]
    strategy = fdl.build(recipe.trainer.strategy)
    print(json.dumps({
        "policy": str(strategy.consolidation_settings.policy),
        "config": repr(strategy.consolidation_settings.config),
        "executor": [type(executor).__name__, executor.nodes, executor.container_image, executor.env_vars],
    }))
    """
)


def page_code() -> str:
    """The Python blocks of docs/nemo-run.md, in order, without the line that submits the job; the recipe's
    directory is a temporary one."""

    text = (REPO / "docs" / "nemo-run.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 4, blocks
    code = "\n".join(line for block in blocks for line in block.splitlines() if not line.startswith("run.run("))
    assert 'ckpt_consolidation_frequency = "every_n:5"' in code and "run.SlurmExecutor(" in code
    return code


def _run(args, env, timeout=600):
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def serialized(tmp_path_factory):
    """The two serialised recipes, made on a stock-NeMo launcher."""
    out = tmp_path_factory.mktemp("nemo-run")
    env = {**os.environ, "NEMO_PATCH_DISABLE": "1"}
    launcher = _run([sys.executable, "-c", LAUNCHER, str(out)], env)
    assert launcher == {"nemo_patch_imported_before_config": False}  # the cadence needed no nemo-patch
    return out


def test_a_recipe_made_without_nemo_patch_consolidates_where_it_is_installed(serialized):
    from nemo_patch import ConsolidationConfig

    env = {k: v for k, v in os.environ.items() if k != "NEMO_PATCH_DISABLE"}
    paths = [str(serialized / name) for name in ("cadence.txt", "config.txt", "factory.txt")]
    job = _run([sys.executable, "-c", JOB, *paths], env)
    assert job["start_up_hook"] and job["nemo_patch_imported"]
    assert job["cadence.txt"] == {"policy": "every_n:5", "config": repr(ConsolidationConfig())}
    expected = ConsolidationConfig(format="hf", dtype="bf16", keep=3)
    assert job["config.txt"] == {"policy": "every_n:5", "config": repr(expected)}
    assert job["factory.txt"] == {"policy": "every_n:5", "config": repr(expected)}


def test_nemo_llm_dryrun_sets_consolidation_config_fields(tmp_path):
    """NeMo's own command line, ``nemo llm pretrain ... --dryrun``: ``ConsolidationConfig`` fields set through the
    factory ``nemo_patch.consolidation_config(...)`` and a field override after it, without deprecated keywords
    (before, ``trainer.strategy.ckpt_consolidation.format=hf`` failed: the recipe's ``None`` is no fiddle config)."""
    nemo = Path(sys.executable).parent / "nemo"
    overrides = [
        "trainer.strategy.ckpt_consolidation_frequency=every_n:5",
        "trainer.strategy.ckpt_consolidation=nemo_patch.consolidation_config(format=hf,dtype=bf16)",
        "trainer.strategy.ckpt_consolidation.keep=3",
    ]
    env = {k: v for k, v in os.environ.items() if k != "NEMO_PATCH_DISABLE"}
    env["COLUMNS"] = "400"  # rich prints the configuration as a table: one line per argument
    proc = subprocess.run(
        [str(nemo), "llm", "pretrain", "--factory", "llama32_1b", *overrides, "--dryrun", "-y"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert "Dry run for task nemo.collections.llm.api:pretrain" in proc.stdout, proc.stdout[-3000:]
    printed = re.sub(r"[\s\u2502]", "", proc.stdout)  # rich's table: its borders and line breaks left out
    assert "ckpt_consolidation_frequency='every_n:5'," in printed
    assert "ckpt_consolidation=ConsolidationConfig(format='hf',dtype='bf16',keep=3)" in printed, proc.stdout[-4000:]
    assert "DeprecationWarning" not in proc.stderr


def test_the_pages_examples_configure_what_it_says(tmp_path):
    """docs/nemo-run.md's Python blocks as written: the recipe override, the ``ConsolidationConfig``, the executor and
    its ``PYTHONPATH``; the strategy they configure has the page's cadence and config."""
    from nemo_patch import ConsolidationConfig

    code = page_code().replace('"/lustre/exp"', repr(str(tmp_path / "exp")))
    (tmp_path / "code.json").write_text(json.dumps(code))
    env = {k: v for k, v in os.environ.items() if k != "NEMO_PATCH_DISABLE"}
    result = _run([sys.executable, "-c", PAGE, str(tmp_path / "code.json")], env)
    assert result["policy"] == "every_n:5"
    assert result["config"] == repr(ConsolidationConfig(format="hf", dtype="bf16", keep=3))
    name, nodes, image, env_vars = result["executor"]
    assert (name, nodes, image) == ("SlurmExecutor", 2, "nvcr.io/nvidia/nemo:25.09")
    assert env_vars["PYTHONPATH"] == "/lustre/sw/nemo-patch"


def test_with_nemo_patch_only_on_the_path_a_consolidation_config_imports_it(serialized):
    """No start-up hook (``python -S``, nemo-patch and the environment's packages on ``PYTHONPATH``): the recipe that
    holds a ``ConsolidationConfig`` imports nemo_patch as it is decoded, so the strategy consolidates; a cadence alone
    is silently ignored by NeMo's unedited class, as docs/nemo-run.md warns."""
    from nemo_patch import ConsolidationConfig

    path = os.pathsep.join([sysconfig.get_paths()["purelib"], str(REPO)])
    env = {k: v for k, v in os.environ.items() if k != "NEMO_PATCH_DISABLE"}
    env["PYTHONPATH"] = path
    with_config = _run([sys.executable, "-S", "-c", JOB, str(serialized / "config.txt")], env)
    assert not with_config["start_up_hook"] and with_config["nemo_patch_imported"]
    expected = ConsolidationConfig(format="hf", dtype="bf16", keep=3)
    assert with_config["config.txt"] == {"policy": "every_n:5", "config": repr(expected)}

    cadence_only = _run([sys.executable, "-S", "-c", JOB, str(serialized / "cadence.txt")], env)
    assert not cadence_only["nemo_patch_imported"]
    assert cadence_only["cadence.txt"] == {"policy": None, "config": None}
