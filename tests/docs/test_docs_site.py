"""The documentation holds together: the MkDocs site builds with `--strict` (every link and anchor
resolves), README.md and DEVELOPERS.md stay short, the docs pages the code cites exist, and nothing in
the repository cites what the repository does not hold: a design document kept elsewhere, or an issue
tracker's numbers (docs/design/index.md: the code cites docs pages instead).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()

MAX_LINES = {"README.md": 250, "DEVELOPERS.md": 400}

# What is scanned for references: folders (recursively) and single files, relative to the root.
SCANNED = ("conveyor", "tests", "scripts", "tools", "docs", "README.md", "DEVELOPERS.md")
SKIPPED_PARTS = {"__pycache__", ".pytest_cache", ".hypothesis", "node_modules"}
SKIPPED_SUFFIXES = {".pyc", ".so", ".o", ".png", ".jpg", ".gguf", ".safetensors", ".whl"}

# A design document that lives outside the repository, cited by section or by name.
_SPEC = "SPEC"
OUTSIDE_DOCUMENT = [
    re.compile(_SPEC + r"\s+sections?\b", re.IGNORECASE),
    re.compile(r"\b" + _SPEC + r"\.md\b", re.IGNORECASE),
    re.compile(r"\b" + _SPEC + r"\s+\d"),  # e.g. "(SPEC 3-4)"
]
# Issue numbers: "issue 12", "Issue #12", "issues 3", "issue12", and tracker paths "issues/12".
ISSUE_NUMBER = re.compile(r"\bissues?[ \t]*#?[ \t]*\d+", re.IGNORECASE)
ISSUE_PATH = re.compile(r"issues/\d+", re.IGNORECASE)
# A link to another project's tracker is a legitimate citation (it names where the thread lives).
URL = re.compile(r"https?://[^\s)>\]\"'`]+")


def scanned_files() -> Iterator[Path]:
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            yield path
        elif path.is_dir():
            for file in sorted(path.rglob("*")):
                if (file.is_file() and file.resolve() != THIS and file.suffix not in SKIPPED_SUFFIXES
                        and not SKIPPED_PARTS.intersection(file.relative_to(ROOT).parts)):
                    yield file


def text_lines(file: Path) -> list[str]:
    try:
        return file.read_text(encoding="utf-8").splitlines()
    except (UnicodeDecodeError, OSError):
        return []  # binary or unreadable: nothing to cite


def external_url_spans(line: str) -> list[tuple[int, int]]:
    """Spans of URLs that point outside this project (another project's tracker, say)."""
    return [m.span() for m in URL.finditer(line) if "conveyor" not in m.group().lower()]


def offending_references(lines: list[str]) -> list[tuple[int, str]]:
    """(line number, the reference) for every citation of an outside document or an issue number."""
    found = []
    for number, line in enumerate(lines, 1):
        allowed = external_url_spans(line)
        for pattern in (*OUTSIDE_DOCUMENT, ISSUE_NUMBER, ISSUE_PATH):
            for m in pattern.finditer(line):
                if not any(start <= m.start() and m.end() <= end for start, end in allowed):
                    found.append((number, m.group()))
    return found


def test_the_reference_scan_sees_what_it_polices():
    lines = ["x = 1  # " + _SPEC + " section 6", "see " + _SPEC + ".md", "(" + _SPEC + " 3-4)",
             "# Issue 19 target", "issue #7", "scripts/issue19/run.sh",
             "https://github.com/vllm-project/vllm/issues/11382", "our tracker: issues/12",
             "the specification, a non-issue: 4 tokens", "docs/design/prefix-caching.md"]
    assert [n for n, _ in offending_references(lines)] == [1, 2, 3, 4, 5, 6, 8]


def test_the_site_builds_strict(tmp_path: Path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed: run scripts/setup.sh --test (it installs the docs extra, "
                    "`pip install -e '.[docs]'`)")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


@pytest.mark.parametrize("name", sorted(MAX_LINES))
def test_front_pages_stay_short(name: str):
    lines = len((ROOT / name).read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES[name], (f"{name} has {lines} lines, more than {MAX_LINES[name]}: move reference "
                                      "material to a page of docs/ and link it")


def test_nothing_cites_an_outside_document_or_an_issue_number():
    found = [f"{file.relative_to(ROOT)}:{number}: {reference!r}"
             for file in scanned_files() for number, reference in offending_references(text_lines(file))]
    assert not found, ("references to a document the repository does not hold, or to issue numbers: cite a "
                       "page of docs/ (e.g. docs/design/prefix-caching.md) or say it plainly\n" + "\n".join(found))


DOCS_PATH = re.compile(r"(?<![\w/.-])docs/[\w/.-]+\.md")


def test_the_docs_pages_the_code_cites_exist():
    missing = [f"{file.relative_to(ROOT)}:{number}: {m.group()}"
               for file in scanned_files() if not file.is_relative_to(ROOT / "docs")
               for number, line in enumerate(text_lines(file), 1)
               for m in DOCS_PATH.finditer(line) if not (ROOT / m.group()).is_file()]
    assert not missing, "citations of docs pages that do not exist:\n" + "\n".join(missing)
