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

"""The installed overlay, seen from fresh interpreters that never import nemo_patch themselves."""

import json
import textwrap

import pytest
from conftest import REPO, run_python

NEMO_MODULE = "nemo.lightning.pytorch.strategies.megatron_strategy"


def _json_result(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_startup_imports_no_nemo_and_no_torch():
    proc = run_python(
        "import json, sys; print(json.dumps(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('nemo', 'torch', 'lightning', 'megatron', 'nemo_patch', '_nemo_patch_autoload'))))"
    )
    # Only the start-up stub and the stdlib-only hook module; not the nemo_patch package (which imports torch).
    assert _json_result(proc) == ["_nemo_patch_autoload", "nemo_patch.overlay.hook"]


def test_nl_megatron_strategy_takes_the_new_arguments_without_importing_nemo_patch():
    code = textwrap.dedent(
        f"""
        import json, sys
        import nemo.lightning as nl
        import nemo.lightning.pytorch.strategies as strategies
        import {NEMO_MODULE} as module
        s = nl.MegatronStrategy(ckpt_consolidation_frequency="latest")
        original = nl.MegatronStrategy.__mro__[1]
        io = s.checkpoint_io
        print(json.dumps({{
            "nemo_patch_imported": "nemo_patch" in sys.modules,
            "policy": str(s.consolidation_policy),
            "same_everywhere": nl.MegatronStrategy is strategies.MegatronStrategy is module.MegatronStrategy,
            "is_nemo_patch_class": nl.MegatronStrategy is sys.modules["nemo_patch"].MegatronStrategy,
            "original_is_nemos": original.__module__ == "{NEMO_MODULE}" and original.__name__ == "MegatronStrategy",
            "isinstance_original": isinstance(s, original),
            "io_chain": [type(io).__name__, type(io.checkpoint_io).__module__],
            "default_policy": str(nl.MegatronStrategy().consolidation_policy),
        }}))
        """
    )
    result = _json_result(run_python(code))
    assert result == {
        "nemo_patch_imported": True,
        "policy": "latest",
        "same_everywhere": True,
        "is_nemo_patch_class": True,
        "original_is_nemos": True,
        "isinstance_original": True,
        "io_chain": ["AsyncFinalizableCheckpointIO", "nemo_patch.training.checkpoint_io"],
        "default_policy": "None",
    }


def test_disable_env_turns_the_overlay_off():
    code = textwrap.dedent(
        """
        import json, sys
        import nemo.lightning as nl
        before = {"nemo_patch_imported": "nemo_patch" in sys.modules, "module": nl.MegatronStrategy.__module__}
        # NeMo's own class has no such argument: it swallows unknown keywords into Lightning's DDP kwargs.
        stock = nl.MegatronStrategy(ckpt_consolidation_frequency="latest")
        ignored = not hasattr(stock, "consolidation_policy") and "ckpt_consolidation_frequency" in stock._ddp_kwargs
        import nemo_patch
        print(json.dumps({
            **before,
            "new_argument_ignored": ignored,
            "still_stock_after_import": nl.MegatronStrategy is not nemo_patch.MegatronStrategy,
            "applied": nemo_patch.overlay.apply.apply_overlay(),
            "explicit_class_works": str(nemo_patch.MegatronStrategy(ckpt_consolidation_frequency="every_n:2")
                                        .consolidation_policy),
            "explicit_class_module": nemo_patch.MegatronStrategy.__module__,
        }))
        """
    )
    result = _json_result(run_python(code, env={"NEMO_PATCH_DISABLE": "1"}))
    assert result == {
        "nemo_patch_imported": False,
        "module": NEMO_MODULE,
        "new_argument_ignored": True,
        "still_stock_after_import": True,
        "applied": False,
        "explicit_class_works": "every_n:2",
        "explicit_class_module": "nemo_patch.training.strategy",
    }


def test_explicit_import_applies_and_applying_twice_is_harmless():
    code = textwrap.dedent(
        """
        import importlib, json, sys
        import nemo_patch
        import nemo.lightning as nl
        first = nl.MegatronStrategy
        assert nemo_patch.overlay.apply.apply_overlay() and nemo_patch.overlay.apply.apply_overlay()
        importlib.reload(sys.modules["nemo_patch.overlay.apply"]).apply_overlay()
        print(json.dumps({
            "stable": nl.MegatronStrategy is first is nemo_patch.MegatronStrategy,
            "depth": [c.__module__ for c in nl.MegatronStrategy.__mro__[:3]],
            "applied": nemo_patch.overlay_applied(),
        }))
        """
    )
    result = _json_result(run_python(code))
    assert result["stable"] and result["applied"]
    # Exactly one layer of nemo_patch on top of NeMo's class, then Lightning's DDPStrategy.
    assert result["depth"] == [NEMO_MODULE, NEMO_MODULE, "lightning.pytorch.strategies.ddp"]


def _fake_nemo_toolkit(tmp_path, version):
    dist = tmp_path / f"nemo_toolkit-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nemo_toolkit\nVersion: {version}\n")
    return {"PYTHONPATH": str(tmp_path)}


def test_nemo_3_is_refused_with_a_message(tmp_path):
    """A dist-info for nemo_toolkit 3.0.0 shadows the installed one; importing nemo_patch must refuse clearly."""
    proc = run_python("import nemo_patch", env=_fake_nemo_toolkit(tmp_path, "3.0.0"))
    assert proc.returncode != 0
    assert (
        "ImportError: nemo_patch supports nemo_toolkit >= 2.5, < 3 (NeMo 2.x); found nemo_toolkit 3.0.0" in proc.stderr
    )
    assert "NeMo 3.x has no MegatronStrategy" in proc.stderr


def test_older_nemo_is_refused_and_the_overlay_hook_never_breaks_nemo_import(tmp_path):
    code = "import warnings, nemo.lightning as nl; print(nl.MegatronStrategy.__module__)"
    proc = run_python(code, env=_fake_nemo_toolkit(tmp_path, "2.4.1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == NEMO_MODULE
    assert "nemo_patch overlay not applied: nemo_patch supports nemo_toolkit >= 2.5, < 3" in proc.stderr


@pytest.mark.parametrize(
    "first_import",
    [
        "import nemo_patch.training.checkpoint_io",
        "from nemo_patch import MegatronStrategy",
        "import nemo_patch.training.strategy",
        "import nemo_patch.training.callback",
        "import nemo.lightning.io.pl",
    ],
)
def test_overlay_applies_whatever_is_imported_first(first_import):
    code = f"{first_import}\nimport nemo_patch, nemo.lightning as nl\n"
    code += "print(nl.MegatronStrategy is nemo_patch.MegatronStrategy)"
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "True"
    assert "overlay not applied" not in proc.stderr


def test_two_copies_of_the_hook_do_not_recurse(tmp_path):
    """A second install (say, a stale copy in another site directory) registers a finder of another class; each asks
    the other for NeMo's module. The search must end, and the overlay still applies."""
    copy = tmp_path / "other_autoload.py"
    copy.write_text((REPO / "nemo_patch" / "overlay" / "hook.py").read_text())
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import other_autoload; "
        "sys.meta_path.insert(0, other_autoload._OverlayFinder(lambda: False)); "
        "import nemo.lightning as nl, nemo_patch, json; "
        "print(json.dumps({'applied': nl.MegatronStrategy is nemo_patch.MegatronStrategy}))"
    )
    assert _json_result(run_python(code)) == {"applied": True}
