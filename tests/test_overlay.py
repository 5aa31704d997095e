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
import shutil
import textwrap
from importlib import metadata
from pathlib import Path

import pytest
from conftest import REPO, run_python

NEMO_VERSION = metadata.version("nemo_toolkit")  # the NeMo line this suite runs on (CI runs two)

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
        import inspect, json, sys
        import nemo.lightning as nl
        import nemo.lightning.pytorch.strategies as strategies
        import {NEMO_MODULE} as module
        s = nl.MegatronStrategy(ckpt_consolidation_frequency="latest")
        io = s.checkpoint_io
        print(json.dumps({{
            "nemo_patch_imported": "nemo_patch" in sys.modules,
            "applied": sys.modules["nemo_patch"].overlay_applied(),
            "policy": str(s.consolidation_settings.policy),
            "same_everywhere": nl.MegatronStrategy is strategies.MegatronStrategy is module.MegatronStrategy,
            "is_nemo_patch_class": nl.MegatronStrategy is sys.modules["nemo_patch"].MegatronStrategy,
            "nemo_s_own_class": [c.__module__ for c in nl.MegatronStrategy.__mro__[:2]],
            "io_chain": [type(io).__name__, type(io.checkpoint_io).__module__, bool(io.checkpoint_io.consolidation)],
            "default_policy": str(nl.MegatronStrategy().consolidation_settings.policy),
            "source_shows_the_edit": "checkpoint_consolidation.teardown(self)" in inspect.getsource(s.teardown),
            "file": inspect.getsourcefile(module.MegatronStrategy) == module.__file__,
        }}))
        """
    )
    result = _json_result(run_python(code))
    assert result == {
        "nemo_patch_imported": True,
        "applied": True,
        "policy": "latest",
        "same_everywhere": True,
        "is_nemo_patch_class": True,
        "nemo_s_own_class": [NEMO_MODULE, "lightning.pytorch.strategies.ddp"],  # edited in place, no subclass
        "io_chain": ["AsyncFinalizableCheckpointIO", "nemo.lightning.io.pl", True],
        "default_policy": "None",
        "source_shows_the_edit": True,
        "file": True,
    }


def test_a_traceback_shows_the_edited_lines():
    code = textwrap.dedent(
        """
        import traceback, nemo.lightning as nl
        try:
            nl.MegatronStrategy(ckpt_consolidation_frequency="weekly")
        except ValueError:
            print(traceback.format_exc())
        """
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "megatron_strategy.py" in proc.stdout
    assert "self.consolidation_settings = checkpoint_consolidation.strategy_settings(" in proc.stdout


def test_disable_env_turns_the_overlay_off():
    code = textwrap.dedent(
        """
        import inspect, json, sys
        import nemo.lightning as nl
        before = {"nemo_patch_imported": "nemo_patch" in sys.modules, "module": nl.MegatronStrategy.__module__}
        # NeMo's own class has no such argument: it swallows unknown keywords into Lightning's DDP kwargs.
        stock = nl.MegatronStrategy(ckpt_consolidation_frequency="latest")
        ignored = not hasattr(stock, "consolidation_settings") and "ckpt_consolidation_frequency" in stock._ddp_kwargs
        import nemo_patch
        print(json.dumps({
            **before,
            "new_argument_ignored": ignored,
            "still_unedited_after_import": "ckpt_consolidation" not in str(inspect.signature(nl.MegatronStrategy)),
            "applied": nemo_patch.overlay.apply.apply_overlay(),
            "overlay_applied": nemo_patch.overlay_applied(),
            "nemo_patch_class_is_nemo_s": nemo_patch.MegatronStrategy is nl.MegatronStrategy,
        }))
        """
    )
    result = _json_result(run_python(code, env={"NEMO_PATCH_DISABLE": "1"}))
    assert result == {
        "nemo_patch_imported": False,
        "module": NEMO_MODULE,
        "new_argument_ignored": True,
        "still_unedited_after_import": True,
        "applied": False,
        "overlay_applied": False,
        "nemo_patch_class_is_nemo_s": True,
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
            "depth": [c.__module__ for c in nl.MegatronStrategy.__mro__[:2]],
            "applied": nemo_patch.overlay_applied(),
        }))
        """
    )
    result = _json_result(run_python(code))
    assert result["stable"] and result["applied"]
    # NeMo's own class, edited: no layer on top of it, then Lightning's DDPStrategy.
    assert result["depth"] == [NEMO_MODULE, "lightning.pytorch.strategies.ddp"]


def test_nemo_imported_before_the_hook_is_edited_when_nemo_patch_is_imported():
    """Without the start-up hook (a program that removed it, an interpreter that skipped ``.pth`` files), NeMo's
    modules are imported unedited; importing nemo_patch executes them again, edited, rebinds the names other NeMo
    modules hold and rebases the classes derived from them (LoRA from PEFT)."""
    code = textwrap.dedent(
        f"""
        import inspect, json, sys
        sys.meta_path[:] = [finder for finder in sys.meta_path if type(finder).__name__ != "_OverlayFinder"]
        import nemo.lightning as nl
        import nemo.lightning.pytorch.strategies as strategies
        from nemo.collections.llm.peft.lora import LoRA
        before = "ckpt_consolidation_frequency" in str(inspect.signature(nl.MegatronStrategy))
        import nemo_patch
        peft = sys.modules["nemo.lightning.pytorch.callbacks.peft"]
        module = sys.modules[{NEMO_MODULE!r}]
        s = nl.MegatronStrategy(ckpt_consolidation_frequency="each", ckpt_async_save=False)
        print(json.dumps({{
            "before": before,
            "applied": nemo_patch.overlay_applied(),
            "rebound": nl.MegatronStrategy is strategies.MegatronStrategy is module.MegatronStrategy,
            "lora_rebased": issubclass(LoRA, peft.PEFT) and LoRA.__mro__[1] is peft.PEFT,
            "lora_setup_edited": "consolidation_settings" in inspect.getsource(LoRA.setup),
            "consolidates": s.checkpoint_io.consolidation is not None,
        }}))
        """
    )
    assert _json_result(run_python(code)) == {
        "before": False,
        "applied": True,
        "rebound": True,
        "lora_rebased": True,
        "lora_setup_edited": True,
        "consolidates": True,
    }


def test_a_series_that_does_not_match_this_nemo_leaves_it_unedited_with_one_warning(tmp_path):
    edits = tmp_path / "nemo_edits"
    shutil.copytree(REPO / "nemo_patch" / "overlay" / "nemo_edits", edits)
    knob = edits / "knob.diff"
    text = knob.read_text()
    assert text.count(" from nemo.lightning.io.capture import IOProtocol\n") == 1
    knob.write_text(text.replace(" from nemo.lightning.io.capture import IOProtocol\n", " from nowhere import x\n"))
    code = textwrap.dedent(
        f"""
        import inspect, json
        from nemo_patch.overlay import hook
        hook.EDITS_DIR = {str(edits)!r}
        import nemo.lightning as nl
        import nemo_patch
        print(json.dumps({{
            "edited": "ckpt_consolidation_frequency" in str(inspect.signature(nl.MegatronStrategy)),
            "applied": nemo_patch.overlay_applied(),
        }}))
        """
    )
    proc = run_python(code)
    assert _json_result(proc) == {"edited": False, "applied": False}
    # NeMo's logging shows the warning (it captures Python's warnings once imported), once.
    warning = (
        "RuntimeWarning: nemo_patch overlay not applied: nemo/lightning/io/pl.py of nemo_toolkit "
        f"{NEMO_VERSION} does not match "
        "knob.diff (hunk 1's context is found 0 times); NeMo runs unedited"
    )
    assert proc.stderr.count(warning) == 1, proc.stderr[-3000:]


def test_the_hunks_apply_strictly():
    from nemo_patch.overlay.hook import apply_hunks

    text = "a\nb\nc\nb\n"
    assert apply_hunks(text, [(["a", "b"], ["a", "x", "b"])]) == ("a\nx\nb\nc\nb\n", None)
    assert apply_hunks(text, [(["b"], ["y"])]) == (text, "hunk 1's context is found 2 times")
    assert apply_hunks(text, [(["a"], ["a"]), (["z"], [])]) == (text, "hunk 2's context is found 0 times")


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
    code = "import inspect, nemo.lightning as nl; "
    code += "print('ckpt_consolidation' in str(inspect.signature(nl.MegatronStrategy)))"
    proc = run_python(code, env=_fake_nemo_toolkit(tmp_path, "2.4.1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"  # NeMo unedited
    assert "nemo_patch overlay not applied: nemo_patch supports nemo_toolkit >= 2.5, < 3" in proc.stderr


@pytest.mark.parametrize(
    "first_import",
    [
        "import nemo_patch.training.integration",
        "from nemo_patch import MegatronStrategy",
        "import nemo_patch.training.coordinator",
        "import nemo_patch.training.callback",
        "import nemo.lightning.io.pl",
        "import nemo.lightning.pytorch.callbacks.peft",
    ],
)
def test_overlay_applies_whatever_is_imported_first(first_import):
    code = f"{first_import}\nimport nemo_patch, nemo.lightning as nl\n"
    code += "print(nl.MegatronStrategy is nemo_patch.MegatronStrategy and nemo_patch.overlay_applied())"
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
        "sys.meta_path.insert(0, other_autoload._OverlayFinder()); "
        "import nemo.lightning as nl, nemo_patch, json; "
        "print(json.dumps({'applied': nemo_patch.overlay_applied()}))"
    )
    assert _json_result(run_python(code)) == {"applied": True}


def test_the_edits_are_git_patches_that_apply_to_the_installed_nemo(tmp_path):
    """Each diff of the series is a real patch: ``git apply`` takes them in order on NeMo's files (the start-up hook
    applies the same hunks, by their lines)."""
    import subprocess

    import nemo

    from nemo_patch.overlay.hook import EDITS_DIR, read_series

    series = read_series()
    nemo_root = Path(nemo.__file__).parent.parent
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    for path in {path for _, path, _ in series}:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(nemo_root / path, tmp_path / path)
    names = [name for name in dict.fromkeys(name for name, _, _ in series)]
    assert names[0] == "knob.diff" and set(names) == {"knob.diff", "best.diff", "peft.diff"}
    for name in names:
        proc = subprocess.run(
            ["git", "apply", str(Path(EDITS_DIR) / name)], cwd=tmp_path, capture_output=True, text=True
        )
        assert proc.returncode == 0, (name, proc.stderr)
    from nemo_patch.overlay.hook import edited_sources

    for path in {path for _, path, _ in series}:
        module = path.removesuffix(".py").replace("/", ".")
        assert edited_sources()[module] == (tmp_path / path).read_text(), path
