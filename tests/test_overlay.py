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
import os
import shutil
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path
from typing import List, Tuple

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


def test_disable_env_turns_the_overlay_off_and_the_strategy_refuses_consolidation_arguments():
    """``NEMO_PATCH_DISABLE=1``: NeMo runs unedited, and ``MegatronStrategy`` given a consolidation argument raises
    (before, NeMo's own class passed the keyword on to Lightning's unused ``_ddp_kwargs``: nothing consolidated,
    nothing said), before and after ``import nemo_patch``; without one it builds as NeMo's."""
    code = textwrap.dedent(
        """
        import inspect, json, sys
        import nemo.lightning as nl
        before = {"nemo_patch_imported": "nemo_patch" in sys.modules, "module": nl.MegatronStrategy.__module__}
        def refusal(**kwargs):
            try:
                nl.MegatronStrategy(**kwargs)
            except Exception as error:
                return f"{type(error).__name__}: {error}"
        stock = nl.MegatronStrategy(ckpt_async_save=False)
        refused_before = refusal(ckpt_consolidation_frequency="latest")
        import nemo_patch
        print(json.dumps({
            **before,
            "plain_strategy_builds": not hasattr(stock, "consolidation_settings"),
            "refused_before": refused_before,
            "refused_after": [refusal(ckpt_consolidation=nemo_patch.ConsolidationConfig(format="hf")),
                              refusal(save_consolidated=True, ckpt_consolidation_dtype="bf16")],
            "still_unedited_after_import": "ckpt_consolidation" not in str(inspect.signature(nl.MegatronStrategy)),
            "applied": nemo_patch.overlay.apply.apply_overlay(),
            "overlay_applied": nemo_patch.overlay_applied(),
            "nemo_patch_class_is_nemo_s": nemo_patch.MegatronStrategy is nl.MegatronStrategy,
            "file": sys.modules[nl.MegatronStrategy.__module__].__file__,
        }))
        """
    )
    result = _json_result(run_python(code, env={"NEMO_PATCH_DISABLE": "1"}))
    message = (
        "OverlayNotAppliedError: MegatronStrategy({}=...) needs the nemo_patch overlay, which is not applied to "
        f"{result['file']} of nemo_toolkit {NEMO_VERSION}: NEMO_PATCH_DISABLE=1 is set."
    )
    assert result.pop("refused_before").startswith(message.format("ckpt_consolidation_frequency"))
    first, second = result.pop("refused_after")
    assert first.startswith(message.format("ckpt_consolidation")), first
    assert second.startswith(message.format("ckpt_consolidation_dtype, save_consolidated")), second
    assert "consolidate nothing" in first and "nemo-consolidate --check" in first
    del result["file"]
    assert result == {
        "nemo_patch_imported": False,
        "module": NEMO_MODULE,
        "plain_strategy_builds": True,
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
    code += "print('ckpt_consolidation' in str(inspect.signature(nl.MegatronStrategy)))\n"
    code += (
        "try:\n    nl.MegatronStrategy(ckpt_consolidation_frequency='each')\nexcept RuntimeError as e:\n    print(e)"
    )
    proc = run_python(code, env=_fake_nemo_toolkit(tmp_path, "2.4.1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-2] == "False"  # NeMo unedited
    assert "nemo_patch overlay not applied: nemo_patch supports nemo_toolkit >= 2.5, < 3" in proc.stderr
    # and the strategy refuses to take the keyword silently, naming the file and the version
    refusal = proc.stdout.strip().splitlines()[-1]
    assert refusal.startswith(
        "MegatronStrategy(ckpt_consolidation_frequency=...) needs the nemo_patch overlay, which "
    )
    assert "megatron_strategy.py of nemo_toolkit 2.4.1: nemo_patch supports nemo_toolkit >= 2.5, < 3" in refusal


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


def _nemo_with_one_context_line_edited(tmp_path: Path) -> Tuple[Path, Path]:
    """A copy of the installed NeMo in ``tmp_path`` (to put first on ``PYTHONPATH``) in which one context line of the
    file the series edits most, ``megatron_strategy.py``, reads differently (a docstring line, as a NeMo release may
    reword it): the directories on the way to it are real, every other entry a symlink to the installed NeMo's.
    Returns the copy's root and the edited file."""
    import nemo

    installed = Path(nemo.__file__).parent
    target = installed / "lightning" / "pytorch" / "strategies" / "megatron_strategy.py"
    line = "        use_gloo_process_groups (bool): Whether to use Gloo process groups. Defaults to True.\n"
    text = target.read_text()
    assert text.count(line) == 1 and any(line[:-1] in old for _, _, hunks in _series() for old, _ in hunks)
    source, copy = installed, tmp_path / "nemo"
    for part in ("lightning", "pytorch", "strategies", None):
        copy.mkdir(parents=True)
        for entry in source.iterdir():
            if entry.name != part and entry != target:
                (copy / entry.name).symlink_to(entry)
        if part is not None:
            source, copy = source / part, copy / part
    edited = copy / target.name
    edited.write_text(text.replace(line, line.replace("Defaults to True.", "Default: True.")))
    return tmp_path, edited


def _series() -> List[Tuple[str, str, List[Tuple[List[str], List[str]]]]]:
    from nemo_patch.overlay.hook import read_series

    return [entry for entry in read_series() if entry[1].endswith("megatron_strategy.py")]


def test_a_nemo_with_one_edited_context_line_refuses_consolidation_arguments_and_check_fails(tmp_path):
    """The edits do not apply to a NeMo whose ``megatron_strategy.py`` differs from them by one context line: NeMo
    runs unedited, and ``MegatronStrategy`` given a consolidation argument raises naming the file and the NeMo
    version (before: one RuntimeWarning at import, then the keyword went to Lightning's unused ``_ddp_kwargs``);
    ``nemo-consolidate --check`` exits 21 with the same reason."""
    root, edited = _nemo_with_one_context_line_edited(tmp_path / "site")
    code = textwrap.dedent(
        """
        import json, sys
        import nemo.lightning as nl
        try:
            nl.MegatronStrategy(ckpt_consolidation_frequency="each")
            refused = None
        except Exception as error:
            refused = f"{type(error).__name__}: {error}"
        print(json.dumps({"file": sys.modules[nl.MegatronStrategy.__module__].__file__, "refused": refused,
                          "plain": type(nl.MegatronStrategy(ckpt_async_save=False)).__name__}))
        """
    )
    env = {"PYTHONPATH": str(root)}
    result = _json_result(run_python(code, env=env))
    reason = (
        f"nemo/lightning/pytorch/strategies/megatron_strategy.py of nemo_toolkit {NEMO_VERSION} does not match "
        "knob.diff (hunk 2's context is found 0 times)"
    )
    assert result["file"] == str(edited) and result["plain"] == "MegatronStrategy"
    assert result["refused"].startswith(
        f"OverlayNotAppliedError: MegatronStrategy(ckpt_consolidation_frequency=...) needs the nemo_patch overlay, "
        f"which is not applied to {edited} of nemo_toolkit {NEMO_VERSION}: {reason}."
    ), result["refused"]
    check = subprocess.run(
        [sys.executable, "-m", "nemo_patch", "--check"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=REPO,
        timeout=600,
    )
    assert check.returncode == 21, check.stderr[-3000:]
    assert check.stdout == ""
    assert check.stderr.splitlines()[-1] == (
        f"nemo-consolidate: error: nemo_patch overlay not active: {edited} of nemo_toolkit {NEMO_VERSION} is not "
        f"edited: {reason}"
    )


def test_check_says_the_overlay_is_active_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_patch", "--check"], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import nemo

    file = Path(nemo.__file__).parent / "lightning" / "pytorch" / "strategies" / "megatron_strategy.py"
    assert proc.stdout == (
        f"nemo_patch overlay active: {file} of nemo_toolkit {NEMO_VERSION} is edited (start-up hook installed)\n"
    )


def _interpreter_without_the_startup_hook(tmp_path: Path) -> Path:
    """A virtual environment whose one ``.pth`` line puts this venv's site-packages on ``sys.path`` as a plain
    directory, whose own ``.pth`` files (``nemo_patch.pth``, the editable install's) are then never run: nemo-patch
    is importable only through ``PYTHONPATH``, as a user who put a checkout there has it."""
    import site
    import venv

    venv.create(tmp_path / "venv", with_pip=False)
    python = tmp_path / "venv" / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "nemo_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def test_a_pythonpath_install_check_fails_and_importing_nemo_patch_turns_the_overlay_on(tmp_path):
    """Without the start-up hook, ``--check`` exits 21 naming it; a job that imports nemo_patch (for
    ``ConsolidationConfig``) has the overlay whether it imports NeMo first or not."""
    python = _interpreter_without_the_startup_hook(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("NEMO_PATCH_DISABLE", None)
    check = subprocess.run(
        [str(python), "-m", "nemo_patch", "--check"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert check.returncode == 21, check.stderr[-3000:]
    assert "the start-up hook (nemo_patch.pth) did not run in a new interpreter" in check.stderr.splitlines()[-1]
    code = textwrap.dedent(
        """
        import json, sys
        hooked = "nemo_patch.overlay.hook" in sys.modules
        import nemo.lightning as nl
        unedited = "ckpt_consolidation" not in str(__import__("inspect").signature(nl.MegatronStrategy))
        from nemo_patch import ConsolidationConfig, overlay_applied
        s = nl.MegatronStrategy(ckpt_consolidation_frequency="each", ckpt_consolidation=ConsolidationConfig(),
                                ckpt_async_save=False)
        print(json.dumps([hooked, unedited, overlay_applied(), s.checkpoint_io.consolidation is not None]))
        """
    )
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [False, True, True, True]


def test_the_demo_refuses_to_run_with_the_overlay_off(tmp_path):
    """Before, the demo trained with the overlay off and its summary said ``ckpt_consolidation_frequency='every_n:2'``
    with "no" for every checkpoint; now it exits 21 with the reason and writes nothing."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo_consolidation_cadence.py"), "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env={**os.environ, "NEMO_PATCH_DISABLE": "1"},
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 21, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1].endswith(
        "error: the nemo_patch overlay is not active: NEMO_PATCH_DISABLE=1 is set"
    )
    assert not (tmp_path / "run").exists() and "global step" not in proc.stdout
