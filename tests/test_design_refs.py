"""Every ``docs/design.md §N`` reference in the repository names a section that exists.

A reference is ``design.md`` followed by the section sign and a number N; it is sound when
docs/design.md has a ``## N.`` heading. The old form, the upper-case word DESIGN followed by the
section sign (a brief the repository does not hold), is refused.
Scanned: every text file ``git ls-files`` lists. The patterns are built from parts so that this
file's own source holds no reference.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
SECTION = "\u00a7"
REFERENCE = re.compile(r"design\.md\s*" + SECTION + r"\s*(\d+)")
OLD_FORM = re.compile("DESIGN" + r"\s*" + SECTION)
HEADING = re.compile(r"^## (\d+)\.\s", re.MULTILINE)
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".sh", ".txt", ".cfg", ".ini", ".json"}


def sections(design_text: str) -> set[int]:
    """The section numbers of ``## N.`` headings.

    >>> sorted(sections("# T\\n## 1. One\\ntext\\n## 2. Two\\n### 2.1 not a section\\n"))
    [1, 2]
    """
    return {int(n) for n in HEADING.findall(design_text)}


def problems(name: str, text: str, known: set[int]) -> list[str]:
    """``name:line: why`` for each bad reference in ``text``.

    >>> s = chr(0xA7)
    >>> text = f"ok: design.md {s}2\\nbad: design.md {s}9"
    >>> [p.split(": ")[0] for p in problems("a.py", text, {1, 2})]
    ['a.py:2']
    >>> [p.split(": ")[0] for p in problems("b.md", "see " + "DESIGN " + s + "4", {4})]
    ['b.md:1']
    """
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in REFERENCE.finditer(line):
            if int(m.group(1)) not in known:
                out.append(f'{name}:{lineno}: design.md {SECTION}{m.group(1)} has no '
                           f'"## {m.group(1)}." heading in docs/design.md')
        if OLD_FORM.search(line):
            out.append(f'{name}:{lineno}: old-form reference "DESIGN {SECTION}"; '
                       f"write docs/design.md {SECTION}N")
    return out


def tracked_text_files(root: Path = ROOT) -> list[Path]:
    """Tracked files with a text suffix, or executable scripts under ``scripts/``."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True,
                                capture_output=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError) as exc:  # pragma: no cover
        pytest.skip(f"git ls-files failed ({exc}); the scan needs a git checkout")
    files = []
    for name in filter(None, listed):
        path = root / name
        if path.is_file() and (path.suffix in TEXT_SUFFIXES or name.startswith("scripts/")):
            files.append(path)
    return files


def test_design_has_the_numbered_sections():
    assert DESIGN.is_file(), "docs/design.md is missing"
    assert {1, 2, 3, 4, 5, 7} <= sections(DESIGN.read_text(encoding="utf-8"))


def test_every_design_reference_names_an_existing_section():
    known = sections(DESIGN.read_text(encoding="utf-8"))
    found = []
    for path in tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # not text after all
        found += problems(str(path.relative_to(ROOT)), text, known)
    assert not found, "bad design references:\n" + "\n".join(found)


def test_the_check_catches_a_bad_reference():
    """The scan is not vacuous: a missing section and the old form are both reported."""
    s = SECTION
    text = f"x = 1  # docs/design.md {s}3\ny = 2  # docs/design.md {s}42\n# {'DESIGN'} {s}2\n"
    assert problems("t.py", text, {3}) == [
        f't.py:2: design.md {s}42 has no "## 42." heading in docs/design.md',
        f't.py:3: old-form reference "DESIGN {s}"; write docs/design.md {s}N',
    ]
