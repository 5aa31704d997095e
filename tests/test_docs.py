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

"""The documentation: the README and the Sphinx site under ``docs/``.

The site is built as CI builds it (``sphinx-build -W --keep-going``: any warning fails), into a temporary directory,
and what it generates from the code is checked against the code independently: the exit-code table against
:mod:`nemo_patch.engine.errors`, the strategy-argument reference against the real ``MegatronStrategy`` signature and
the ``ConsolidationConfig`` dataclass, the CLI reference against the parser, the API page against
``nemo_patch.__all__``.
The cheap checks (the CLI epilog's exit codes, the cadence examples, the version, the README's size, links and first
commands, no internal matter on user pages) need no build and run in the quick suite too. Sphinx missing is a failure,
not a skip: the ``docs`` extra is part of the test environment (``scripts/setup_env.sh``).
"""

import ast
import concurrent.futures
import dataclasses
import html
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from html.parser import HTMLParser
from importlib import metadata
from typing import Dict, List, Optional, Tuple

import pytest
from conftest import REPO, run_python

from nemo_patch.cli.nemo_consolidate import build_parser, main
from nemo_patch.engine import errors
from nemo_patch.training.policy import parse_consolidation_frequency

DOCS = REPO / "docs"
README = REPO / "README.md"
#: Pages for developers, where test files, CI and the like belong.
DEVELOPER_PAGES = {"development.md", "UPSTREAM.md", "gpu-wheels.md"}
#: The pages the site must have.
REQUIRED_PAGES = [
    *("installation", "choosing", "cadences", "outputs", "retention", "parallel", "nemo-run", "troubleshooting"),
    *("strategy-arguments", "cli", "api", "how-it-works", "benchmarks", "upgrading", "development"),
]
#: The README's first block: the two set-up commands (main job, tests), as CI and a fresh machine run them.
FIRST_COMMANDS = [
    "bash scripts/setup_env.sh && .venv/bin/python scripts/demo_consolidation_cadence.py --frequency every_n:2 "
    "--max-steps 10 --save-every 2 --out runs/demo",
    "bash scripts/setup_env.sh && .venv/bin/python -m pytest -n 2 --dist loadfile",
]


class _Tables(HTMLParser):
    """The cells of the HTML tables with a given class: one list of cell texts per body row."""

    def __init__(self, table_class: str) -> None:
        super().__init__()
        self.table_class = table_class
        self.rows: List[List[str]] = []
        self._depth = 0  # > 0 inside a wanted table
        self._in_body = False
        self._cell: List[str] = []
        self._in_cell = False

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "table" and (self._depth or self.table_class in classes):
            self._depth += 1
        elif self._depth and tag == "tbody":
            self._in_body = True
        elif self._depth and self._in_body and tag == "tr":
            self.rows.append([])
        elif self._depth and self._in_body and tag == "td":
            self._in_cell, self._cell = True, []

    def handle_endtag(self, tag):
        if tag == "table" and self._depth:
            self._depth -= 1
        elif tag == "tbody":
            self._in_body = False
        elif tag == "td" and self._in_cell:
            self._in_cell = False
            self.rows[-1].append(" ".join("".join(self._cell).split()))

    def handle_data(self, data):
        if self._in_cell:
            self._cell.append(data)


def _table_rows(page, table_class: str) -> List[List[str]]:
    parser = _Tables(table_class)
    parser.feed(page.read_text())
    assert parser.rows, f"no table of class {table_class} in {page}"
    return parser.rows


def _error_classes() -> Dict[str, type]:
    """Every error class of the product, by name, with its exit code, found without the CLI's list: every module of
    nemo_patch (but the test aids) is imported and each class deriving from ConsolidationError is taken."""
    import importlib
    import pkgutil

    import nemo_patch

    found = {}
    for module in pkgutil.walk_packages(nemo_patch.__path__, "nemo_patch."):
        if module.name.startswith("nemo_patch.testing") or module.name == "nemo_patch.__main__":
            continue
        for name, cls in vars(importlib.import_module(module.name)).items():
            if isinstance(cls, type) and issubclass(cls, errors.ConsolidationError) and cls.__module__ == module.name:
                found[name] = cls
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The documentation site, built as CI builds it; any warning fails the build."""
    out = tmp_path_factory.mktemp("docs") / "html"
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    warnings = [line for line in proc.stderr.splitlines() if re.search(r"\b(WARNING|ERROR|CRITICAL): ", line)]
    assert proc.returncode == 0 and not warnings, "\n".join(warnings) or proc.stderr[-5000:]
    return out


@pytest.mark.slow
def test_the_site_builds_with_no_warning_and_has_every_page(site):
    pages = {path.stem for path in DOCS.glob("*.md")}
    assert pages <= {path.stem for path in site.glob("*.html")}
    assert set(REQUIRED_PAGES) <= pages


@pytest.mark.slow
def test_the_exit_code_table_is_the_errors_module(site):
    rows = _table_rows(site / "troubleshooting.html", "nemo-patch-exit-codes")
    table = [(int(code), name) for code, name, _ in rows]
    expected = sorted(
        [(0, ""), (2, ""), (21, ""), (130, "")] + [(cls.exit_code, name) for name, cls in _error_classes().items()]
    )
    assert table == expected
    causes = {name: cause.replace("\u2019", "'") for _, name, cause in rows}  # Sphinx's typographic apostrophes
    for name, cls in _error_classes().items():  # each row says what its class's docstring says
        doc = " ".join(inspect.cleandoc(cls.__doc__).split())
        plain = re.sub(r":[\w:]+:`~?([^`]+)`", r"\1", doc).replace("``", "")
        assert plain[:60] in causes[name], name


def test_the_cli_epilog_names_every_exit_code():
    parser = build_parser()
    assert parser.epilog is None  # made when help is printed: the error classes' modules import torch
    parser.format_help()
    epilog = parser.epilog
    assert epilog.startswith("Exit codes: ")
    named = [int(code) for code in re.findall(r"(?:^Exit codes: |, )(\d+) ", epilog)]
    assert sorted(named) == sorted({0, 2, 21, 130} | {cls.exit_code for cls in _error_classes().values()})
    assert len(named) == len(set(named))


@pytest.mark.slow
def test_the_cli_reference_is_the_parser(site):
    page = (site / "cli.html").read_text()
    for action in build_parser()._actions:
        for option in action.option_strings:
            assert f">{option}<" in page or f"{option}</" in page, option
    assert "Exit codes: 0 ok" in page  # the epilog
    # Placeholders such as <ckpt> in help texts are shown, not taken for HTML tags by the Markdown parser.
    placeholders = {word for action in build_parser()._actions for word in re.findall(r"<\w+>", action.help or "")}
    assert placeholders and all(html.escape(word) in page for word in placeholders), placeholders


class _Definitions(HTMLParser):
    """The entries of the HTML definition lists with a given class: ``(term text, [paragraph texts])`` each."""

    def __init__(self, list_class: str) -> None:
        super().__init__()
        self.list_class = list_class
        self.entries: List[Tuple[str, List[str]]] = []
        self._depth = 0  # > 0 inside a wanted list
        self._text: Optional[List[str]] = None
        self._in_term = False

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "dl" and (self._depth or self.list_class in classes):
            self._depth += 1
        elif self._depth == 1 and tag == "dt":
            self.entries.append(("", []))
            self._in_term, self._text = True, []
        elif self._depth == 1 and tag == "p" and self.entries:
            self._text = []

    def handle_endtag(self, tag):
        if tag == "dl" and self._depth:
            self._depth -= 1
        elif self._depth == 1 and tag in ("dt", "p") and self._text is not None:
            text = " ".join("".join(self._text).split())
            term, paragraphs = self.entries[-1]
            self.entries[-1] = (text, paragraphs) if self._in_term else (term, [*paragraphs, text])
            self._in_term, self._text = False, None

    def handle_data(self, data):
        if self._text is not None:
            self._text.append(data)


def _definitions(page, list_class: str) -> List[Tuple[str, Dict[str, str], str]]:
    """``(name, facts, meaning)`` per entry of the reference list ``list_class`` on ``page``."""
    parser = _Definitions(list_class)
    parser.feed(page.read_text())
    assert parser.entries, f"no definition list of class {list_class} in {page}"
    result = []
    for term, paragraphs in parser.entries:
        assert len(paragraphs) == 2, (term, paragraphs)  # the facts, then the meaning
        facts = dict(fact.split(": ", 1) for fact in paragraphs[0].split(" \u00b7 "))
        result.append((term, facts, paragraphs[1].replace("\u2019", "'")))
    return result


def _plain(rst: str) -> str:
    """Help text as the page shows it: literals and roles as their text."""
    return re.sub(r":[\w:]+:`~?([^`]+)`", r"\1", rst).replace("``", "").replace("~nemo_patch.", "")


@pytest.mark.slow
def test_the_strategy_argument_reference_is_the_signature_and_the_config(site):
    """The reference is two definition lists (nothing off a narrow screen, no wide table): the strategy's three
    arguments, checked against the real ``MegatronStrategy`` signature, and ``ConsolidationConfig``'s fields, checked
    against the dataclass and the CLI's parser."""
    from nemo_patch.training.config import SETTINGS, ConsolidationConfig

    page = site / "strategy-arguments.html"
    assert "<table" not in page.read_text().split('class="nemo-patch-strategy-arguments')[1].split("</dl>")[0]
    code = textwrap.dedent(
        """
        import inspect, json
        import nemo_patch
        ours = inspect.signature(nemo_patch.MegatronStrategy.__init__).parameters
        print(json.dumps({name: repr(p.default) for name, p in ours.items() if "consolidat" in name}))
        """
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-5000:]
    strategy = json.loads(proc.stdout.strip().splitlines()[-1])
    arguments = _definitions(page, "nemo-patch-strategy-arguments")
    assert (
        [name for name, _, _ in arguments]
        == list(strategy)
        == [
            "save_consolidated",
            "ckpt_consolidation_frequency",
            "ckpt_consolidation",
        ]
    )
    for name, facts, meaning in arguments:
        assert ast.literal_eval(facts["default"]) == ast.literal_eval(strategy[name]), name
        assert set(facts) == {"type", "default"} and meaning, name
    assert "NeMo Automodel" in arguments[0][2] and "ConsolidationConfig" in arguments[2][1]["type"]

    fields = _definitions(page, "nemo-patch-consolidation-config")
    assert [name for name, _, _ in fields] == [field.name for field in dataclasses.fields(ConsolidationConfig)]
    parser = {option: action for action in build_parser()._actions for option in action.option_strings}
    for (name, facts, meaning), spec in zip(fields, SETTINGS):
        assert ast.literal_eval(facts["default"]) == getattr(ConsolidationConfig(), name), name
        assert (
            facts["type"] == str(spec.annotation).replace("typing.", "") or facts["type"] == spec.annotation.__name__
        )
        if spec.cli is None:
            assert facts["nemo-consolidate"] == "none", name
        else:
            assert facts["nemo-consolidate"] == spec.cli.flag and spec.cli.flag in parser, name
        assert facts["replaces the deprecated"] == f"ckpt_consolidation_{name}=", name
        assert " ".join(_plain(spec.help).split())[:80] in meaning, name


def test_the_reference_entries_are_the_declarations():
    """The same without a build (the quick suite): the directive's entries are the dataclass's fields, in order."""
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import nemo_patch_docs
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    from nemo_patch.training.config import ConsolidationConfig

    entries = nemo_patch_docs.config_field_entries()
    assert [entry[0] for entry in entries] == [field.name for field in dataclasses.fields(ConsolidationConfig)]
    assert {entry[3] for entry in entries} >= {"--format", "--dtype", "--max-shard-size", "--workers"}
    assert [entry[0] for entry in nemo_patch_docs.strategy_argument_entries()] == [
        "save_consolidated",
        "ckpt_consolidation_frequency",
        "ckpt_consolidation",
    ]


@pytest.mark.slow
def test_the_api_page_documents_every_public_name(site):
    import nemo_patch

    page = (site / "api.html").read_text()
    missing = [name for name in nemo_patch.__all__ if f'id="nemo_patch.{name}"' not in page]
    assert not missing
    documented = set(re.findall(r'id="nemo_patch\.(\w+)"', page))
    assert documented == set(nemo_patch.__all__)  # and nothing else: the rest is internal


def test_the_api_page_shows_the_classes_real_signatures(site):
    """Autodoc reads NeMo's ``IOMixin.__new__(*args, **kwargs)`` first; the page shows what Python's
    ``inspect.signature`` gives (the ``__init__``), every parameter in order, ours keyword-only, for both classes."""
    import nemo_patch

    page = (site / "api.html").read_text()
    for name in ("MegatronStrategy", "MegatronCheckpointIO"):
        heading = re.search(rf'id="nemo_patch\.{name}">(.*?)</dt>', page, re.S)
        assert heading, name
        text = " ".join(html.unescape(re.sub(r"<[^>]+>", "", heading.group(1))).split())
        assert "*args" not in text, text[:300]
        position = 0
        for param in inspect.signature(getattr(nemo_patch, name)).parameters.values():
            shown = f"**{param.name}" if param.kind is param.VAR_KEYWORD else f"{param.name}="
            found = text.find(shown, position)
            assert found > position, (name, shown, text[position : position + 200])
            position = found
        assert ("*, save_consolidated=" if name == "MegatronStrategy" else "*, consolidation_settings=") in text, name


def _quoted_values(text: str) -> List[str]:
    return re.findall(r'`"([^"`]*)"`', text)


def test_the_cadence_examples_are_what_the_parser_takes():
    for path in (README, DOCS / "cadences.md"):
        text = path.read_text()
        table_values = [v for line in text.splitlines() if line.startswith("| `") for v in _quoted_values(line)]
        frequencies = [v for v in table_values if re.match(r"(each|latest|best|every_n)", v) and "<" not in v]
        assert len(frequencies) >= 4, path
        for value in frequencies:
            parse_consolidation_frequency(value)  # raises on a value the docs show as valid
    text = (DOCS / "cadences.md").read_text()
    invalid = text[text.index("Any other value (") : text.index(") raises `ValueError`")]
    values = _quoted_values(invalid) + [int(v) for v in re.findall(r"`(\d+)`", invalid)]
    assert len(values) >= 7
    for value in values:
        with pytest.raises(ValueError):
            parse_consolidation_frequency(value)


def test_one_version_everywhere(capsys):
    import nemo_patch

    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert nemo_patch.__version__ == version
    assert metadata.version("nemo-patch") == version  # the installed metadata (re-run setup_env.sh after a bump)
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == version
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"nemo-consolidate (nemo-patch {version})\n"
    assert f"(nemo-patch {version})" in README.read_text()
    installation = (DOCS / "installation.md").read_text()
    assert f"nemo_patch-{version}-py3-none-any.whl" in installation and f"(nemo-patch {version})" in installation


def _github_slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_is_short_starts_with_the_two_commands_and_links_to_what_exists():
    text = README.read_text()
    assert len(text.encode()) <= 10 * 1024
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    assert text.index("```bash") < text.index("\n## ")  # at the very top
    commands = [line for line in first_block.splitlines() if line and not line.startswith("#")]
    assert commands == FIRST_COMMANDS
    assert FIRST_COMMANDS[1] in (REPO / ".ci" / "run").read_text()  # the tests command is what CI runs
    links = re.findall(r"\]\(([^)#]+)(?:#([^)]+))?\)", text)
    assert len(links) >= 10
    for target, anchor in links:
        path = REPO / target
        assert path.exists(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
            assert anchor in {_github_slug(h) for h in headings}, (target, anchor)


def test_user_pages_carry_no_internal_matter():
    pages = [README, REPO / "CHANGELOG.md"] + [path for path in DOCS.glob("*.md") if path.name not in DEVELOPER_PAGES]
    for path in pages:
        text = path.read_text()
        for pattern in (r"(?<![\w/&])#\d+\b", r"\btests/", r"\bCI machine\b", r"fresh clone of `"):
            found = re.findall(pattern, text)
            assert not found, (path.name, pattern, found)


#: Measures a page once it is laid out (fonts included) and appends the result as JSON in a ``<pre>`` that Chromium's
#: ``--dump-dom`` prints: the root's scroll width against its width (the page scrolls sideways), visible elements that
#: reach past the right edge without a box of their own that clips or scrolls them, and tables wider than their box.
_OVERFLOW_PROBE = """
window.addEventListener("load", () => document.fonts.ready.then(() => {
  const root = document.documentElement;
  const width = root.clientWidth;
  const describe = (el) => el.tagName.toLowerCase() + (el.id ? "#" + el.id : "") +
    (typeof el.className === "string" && el.className ? "." + el.className.trim().split(/\\s+/).join(".") : "");
  const offenders = [];
  for (const el of document.body.querySelectorAll("*")) {
    const style = getComputedStyle(el);
    if (style.visibility === "hidden" || style.display === "none") continue;
    const box = el.getBoundingClientRect();
    if (box.width === 0) continue;
    // The box that clips or scrolls it: a code block may scroll sideways, tables are checked below, any other box
    // (the article, a sidebar) must not, nor may the window.
    let clip = el.parentElement;
    while (clip && clip !== document.body && getComputedStyle(clip).overflowX === "visible") clip = clip.parentElement;
    if (clip && clip.closest("pre, div.highlight, .pst-scrollable-table-container")) continue;
    const clipped = clip && clip !== document.body;
    const edge = clipped ? clip.getBoundingClientRect().left + clip.clientLeft + clip.clientWidth : width;
    if (box.right > edge + 1) offenders.push(describe(el) + " ends at " + Math.round(box.right) + " px, past " +
      (clipped ? describe(clip) + "'s edge" : "the window's edge") + " at " +
      Math.round(edge) + " px");
  }
  const tables = [...document.querySelectorAll("table")].filter((table) => {
    const box = table.parentElement;
    return table.getBoundingClientRect().width > box.clientWidth + 1;
  }).map((table) => describe(table) + " needs " + Math.round(table.getBoundingClientRect().width) + " px of " +
    table.parentElement.clientWidth);
  const out = document.createElement("pre");
  out.id = "nemo-patch-overflow";
  out.textContent = JSON.stringify({scrollWidth: root.scrollWidth, width: width, innerWidth: window.innerWidth,
                                    offenders: offenders.slice(0, 5), tables: tables});
  document.body.appendChild(out);
}));
"""


def _chromium() -> str:
    """Debian's Chromium; missing, a skip on a developer's machine and a failure where the browser test must run:
    ``NEMO_PATCH_REQUIRE_BROWSER=1`` (``.ci/run`` installs Chromium and sets it) or ``CI`` set."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    message = "Chromium is not installed: apt-get install -y chromium (Debian's package; .ci/run installs it)"
    required = [os.environ.get(name, "").lower() for name in ("NEMO_PATCH_REQUIRE_BROWSER", "CI")]
    if any(value not in ("", "0", "false", "no") for value in required):
        pytest.fail(f"{message}; CI must run the browser test, not skip it")
    pytest.skip(message)


def _layout(chromium: str, page, profile) -> Optional[dict]:
    """The probe's result for ``page`` in headless Chromium at 1280 x 900 px, or ``None`` if it printed none."""
    proc = subprocess.run(
        [
            chromium,
            *("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"),
            *("--disable-background-networking", "--disable-component-update", "--disable-sync"),
            f"--user-data-dir={profile}",
            "--window-size=1280,900",
            "--virtual-time-budget=5000",  # the page's scripts and fonts run before the DOM is printed
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = re.search(r'<pre id="nemo-patch-overflow"[^>]*>(.*?)</pre>', proc.stdout, re.S)
    return json.loads(html.unescape(found.group(1))) if found else None


@pytest.mark.slow
def test_every_page_fits_a_1280_px_browser_window(site, tmp_path):
    """Every built page, opened in a real browser (headless Chromium) 1280 px wide: the page never scrolls sideways,
    nothing visible reaches past the window's right edge, and every table fits its column (code blocks may scroll
    inside their own box)."""
    chromium = _chromium()
    copy = tmp_path / "site"
    shutil.copytree(site, copy)
    (copy / "_static" / "overflow-probe.js").write_text(_OVERFLOW_PROBE)
    pages = sorted(copy.rglob("*.html"))
    pages = [page for page in pages if not page.relative_to(copy).parts[0].startswith("_")]
    assert len(pages) >= len(REQUIRED_PAGES) + 2, pages  # every page, the index and search included
    for page in pages:
        script = "../" * (len(page.relative_to(copy).parts) - 1) + "_static/overflow-probe.js"
        text = page.read_text()
        assert text.count("</body>") == 1, page
        page.write_text(text.replace("</body>", f'<script src="{script}"></script></body>'))

    def measure(index_page):
        index, page = index_page
        for attempt in range(2):
            result = _layout(chromium, page, tmp_path / f"profile-{index}-{attempt}")
            if result is not None:
                return page, result
        return page, None

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(measure, enumerate(pages)))
    problems = []
    for page, result in results:
        name = page.relative_to(copy).as_posix()
        if result is None:
            problems.append(f"{name}: Chromium printed no measurement")
            continue
        assert result["innerWidth"] == 1280, result
        if result["scrollWidth"] > result["width"]:
            problems.append(f"{name}: the page scrolls sideways ({result['scrollWidth']} px of {result['width']})")
        problems += [f"{name}: {offender}" for offender in result["offenders"]]
        if name.removesuffix(".html") + ".md" not in DEVELOPER_PAGES:  # a table of test ids scrolls in its box there
            problems += [f"{name}: table {table}" for table in result["tables"]]
    assert not problems, "\n".join(problems)


# The second probe (#47): every element that ends past the window's right edge, or past the edge of a box that clips
# it, unless a box of its own scrolls sideways (``overflow-x: auto|scroll``: a code block, a table's box, an API
# signature; not the page's layout, which holds its title); and every identifier ([A-Za-z0-9_]+) of an inline literal
# in a table cell that the browser broke over two lines.
_PHONE_PROBE = """
window.addEventListener("load", () => document.fonts.ready.then(() => {
  const root = document.documentElement;
  const width = root.clientWidth;
  const describe = (el) => el.tagName.toLowerCase() + (el.id ? "#" + el.id : "") +
    (typeof el.className === "string" && el.className ? "." + el.className.trim().split(/\\s+/).join(".") : "");
  const offenders = [];
  const title = document.querySelector("h1") || document.body;
  for (const el of document.body.querySelectorAll("*")) {
    const style = getComputedStyle(el);
    if (style.visibility === "hidden" || style.display === "none") continue;
    const box = el.getBoundingClientRect();
    if (box.width === 0 || box.height === 0) continue;
    let clip = el.parentElement;
    while (clip && clip !== document.body && getComputedStyle(clip).overflowX === "visible") clip = clip.parentElement;
    const clipped = clip && clip !== document.body;
    // A box of its own that scrolls sideways (a code block, a table's box, a signature): fine. The page's layout
    // boxes (those holding the page's title) scrolling sideways are not.
    if (clipped && ["auto", "scroll"].includes(getComputedStyle(clip).overflowX) && !clip.contains(title)) continue;
    const edge = clipped ? Math.min(width, clip.getBoundingClientRect().left + clip.clientLeft + clip.clientWidth)
      : width;
    if (box.right > edge + 1) offenders.push(describe(el) + " '" + (el.textContent || "").trim().slice(0, 40) +
      "' ends at " + Math.round(box.right) + " px, past " +
      (clipped ? describe(clip) + "'s edge" : "the window's edge") + " at " + Math.round(edge) + " px");
  }
  const broken = [];
  for (const code of document.querySelectorAll("table td code, table td span.pre")) {
    const walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (const match of node.data.matchAll(/[A-Za-z0-9_]+/g)) {
        const range = document.createRange();
        range.setStart(node, match.index);
        range.setEnd(node, match.index + match[0].length);
        const tops = new Set([...range.getClientRects()].filter((r) => r.width > 0).map((r) => Math.round(r.top)));
        if (tops.size > 1) broken.push(match[0]);
      }
    }
  }
  const tables = [...document.querySelectorAll("table")]
    .filter((table) => table.getBoundingClientRect().width > table.parentElement.clientWidth + 1)
    .map((table) => describe(table) + " '" + table.rows[0].textContent.trim().slice(0, 30) + "'");
  const out = document.createElement("pre");
  out.id = "nemo-patch-overflow";
  out.style.display = "none";
  out.textContent = JSON.stringify({scrollWidth: root.scrollWidth, width: width, innerWidth: window.innerWidth,
    offenders: offenders.slice(0, 8), tables: tables, broken: [...new Set(broken)].slice(0, 8)});
  document.body.appendChild(out);
}));
"""
#: A page shown in a frame ``width`` px wide (Chromium's window is at least 500 px); the probe's result is copied out.
_FRAME_HOST = """<!DOCTYPE html><html><body style="margin:0">
<iframe id="f" src="{page}" style="width:{width}px;height:900px;border:0"></iframe><script>
const frame = document.getElementById("f");
const poll = () => {{
  const found = frame.contentDocument && frame.contentDocument.getElementById("nemo-patch-overflow");
  if (!found) return setTimeout(poll, 50);
  const out = document.createElement("pre");
  out.id = "nemo-patch-overflow";
  out.textContent = found.textContent;
  document.body.appendChild(out);
}};
frame.addEventListener("load", poll);
</script></body></html>"""


def _measure_every_page(site, tmp_path, width: int) -> List[Tuple[str, Optional[dict]]]:
    """Every built page with :data:`_PHONE_PROBE`, in headless Chromium, in a frame ``width`` px wide:
    ``(page, the probe's result or None)``."""
    chromium = _chromium()
    copy = tmp_path / f"site-{width}"
    shutil.copytree(site, copy)
    (copy / "_static" / "phone-probe.js").write_text(_PHONE_PROBE)
    pages = [page for page in sorted(copy.rglob("*.html")) if not page.relative_to(copy).parts[0].startswith("_")]
    opened = []
    for page in pages:
        script = "../" * (len(page.relative_to(copy).parts) - 1) + "_static/phone-probe.js"
        page.write_text(page.read_text().replace("</body>", f'<script src="{script}"></script></body>'))
        host = page.with_name(f"{page.stem}.frame-{width}.html")
        host.write_text(_FRAME_HOST.format(page=page.name, width=width))
        opened.append((page, host))

    def measure(index_opened):
        index, (page, host) = index_opened
        for attempt in range(2):
            proc = subprocess.run(
                [
                    chromium,
                    *("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"),
                    *("--disable-background-networking", "--disable-component-update", "--disable-sync"),
                    "--allow-file-access-from-files",  # the host page reads its frame's result
                    f"--user-data-dir={tmp_path / f'profile-{width}-{index}-{attempt}'}",
                    f"--window-size={max(width, 1280) + 20},1000",
                    "--virtual-time-budget=5000",
                    "--dump-dom",
                    host.as_uri(),
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            found = re.search(r'<pre id="nemo-patch-overflow"[^>]*>(.*?)</pre>', proc.stdout, re.S)
            if found:
                return page.relative_to(copy).as_posix(), json.loads(html.unescape(found.group(1)))
        return page.relative_to(copy).as_posix(), None

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(measure, enumerate(opened)))


@pytest.mark.slow
def test_every_page_fits_a_390_px_phone_screen(site, tmp_path):
    """Every built page on a phone (390 px, in headless Chromium): no element runs past the screen's right edge, or is
    cut at the edge of its box (the footer's previous / next links), unless it is inside a box of its own that
    scrolls sideways (a code block, a table's box, an API signature); the page itself never scrolls sideways."""
    problems = []
    for name, result in _measure_every_page(site, tmp_path, 390):
        if result is None:
            problems.append(f"{name}: Chromium printed no measurement")
            continue
        assert result["innerWidth"] == 390, result
        if result["scrollWidth"] > result["width"]:
            problems.append(f"{name}: the page scrolls sideways ({result['scrollWidth']} px of {result['width']})")
        problems += [f"{name}: {offender}" for offender in result["offenders"]]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_no_table_breaks_an_inline_identifier_at_1280_px(site, tmp_path):
    """At 1280 px, an inline literal in a table cell wraps only between its parts (after ".", "/", "(", ...), never
    inside an identifier (``ckpt_consolida|tion_frequency``)."""
    problems = []
    for name, result in _measure_every_page(site, tmp_path, 1280):
        if result is None:
            problems.append(f"{name}: Chromium printed no measurement")
            continue
        assert result["innerWidth"] == 1280, result
        problems += [f"{name}: {word!r} is broken over two lines in a table" for word in result["broken"]]
    assert not problems, "\n".join(problems)
