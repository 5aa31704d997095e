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

"""Check (or, with ``--fix``, add) the Apache-2.0 licence header NeMo puts at the top of every Python file.

Usage: ``python scripts/check_license_headers.py [--fix] FILE...`` (pre-commit passes the files). Exits 1 and lists the
files without the header. A ``#!`` line may come first. The header is this file's own first 13 lines, with any year.
"""

import re
import sys
from pathlib import Path
from typing import List, Optional

HEADER_LINES = 13
_YEAR = re.compile(r"Copyright \(c\) \d{4}(-\d{4})?, NVIDIA CORPORATION\.")


def _header() -> List[str]:
    return Path(__file__).read_text().splitlines(keepends=True)[:HEADER_LINES]


def has_header(text: str) -> bool:
    """Whether ``text`` starts (after an optional ``#!`` line) with the licence header, any copyright year."""
    lines = text.splitlines(keepends=True)
    if lines and lines[0].startswith("#!"):
        lines = lines[1:]
    expected = _header()
    if len(lines) < len(expected) or not _YEAR.search(lines[0]):
        return False
    return lines[1:HEADER_LINES] == expected[1:]


def add_header(text: str) -> str:
    """``text`` with the header inserted after an optional ``#!`` line."""
    lines = text.splitlines(keepends=True)
    shebang = [lines.pop(0)] if lines and lines[0].startswith("#!") else []
    return "".join(shebang + _header() + ["\n"] + lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    fix = "--fix" in args
    missing = []
    for name in (a for a in args if a != "--fix"):
        path = Path(name)
        text = path.read_text()
        if not has_header(text):
            missing.append(name)
            if fix:
                path.write_text(add_header(text))
    for name in missing:
        print(f"{name}: missing the Apache-2.0 licence header{' (added)' if fix else ''}")
    return 1 if missing and not fix else 0


if __name__ == "__main__":
    sys.exit(main())
