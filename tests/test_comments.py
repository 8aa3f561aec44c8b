"""Product code comments and docstrings keep the reason and the source (a paper, a datasheet, torch's docs, a results
file), never the logbook: no dates, no clock times of runs, no issue numbers, no "this VM", no "N cores" of the
development machine. Measured figures of particular runs live in benchmarks/results/ (measurements.md and the JSON
files), which the comments cite by section.

Comments are read with tokenize, docstrings (module, class, function) with ast; other string literals are code
(messages printed to users) and out of scope. Consecutive comment lines and a docstring's lines are checked as one
text, so a phrase broken over two lines is still found."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT_DIRS = ("cost_models", "planner", "executor")
PRODUCT_FILES = ("cli.py",)
MEASUREMENTS = ROOT / "benchmarks" / "results" / "measurements.md"

FORMS = {
    "a date": re.compile(r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b"),
    # a run's clock time (the 08:31 run, at 23:18); not a slice such as x[0:2] or a host:port
    "a clock time": re.compile(r"(?<![\w:.\[])(?:[01]?\d|2[0-3]):[0-5]\d(?![\w:])"),
    "an issue number": re.compile(r"\bissue\s*#?\s*\d+", re.IGNORECASE),
    "this VM": re.compile(r"\bthis\s+VM\b", re.IGNORECASE),
    "a core count": re.compile(r"\b\d+(?:\.\d+)?[\s-]+cores?\b", re.IGNORECASE),
}
# `measurements.md, "Section"`: the section's heading, before its parenthesised list of modules
CITATION = re.compile(r'measurements\.md,?\s*"([^"]+)"')


def product_files() -> list[Path]:
    files = [p for d in PRODUCT_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    return files + [ROOT / f for f in PRODUCT_FILES]


def _docstrings(tree: ast.AST) -> list[ast.Constant]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                out.append(body[0].value)
    return out


def text_blocks(source: str) -> list[list[tuple[int, str]]]:
    """Each docstring, and each run of comments on consecutive lines, as [(line number, text of that line)]."""
    blocks: list[list[tuple[int, str]]] = []
    lines = source.splitlines()
    for doc in _docstrings(ast.parse(source)):
        blocks.append([(doc.lineno + i, lines[doc.lineno - 1 + i].strip())
                       for i in range(doc.end_lineno - doc.lineno + 1)])
    run: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        if run and tok.start[0] != run[-1][0] + 1:
            blocks.append(run)
            run = []
        run.append((tok.start[0], tok.string.lstrip("#").strip()))
    if run:
        blocks.append(run)
    return blocks


def _joined(block: list[tuple[int, str]]) -> tuple[str, list[tuple[int, int, str]]]:
    """The block's lines joined by spaces, and (start offset, line number, line) of each."""
    text, starts = "", []
    for number, line in block:
        starts.append((len(text), number, line))
        text += line + " "
    return text, starts


def find_logbook(source: str, name: str = "<snippet>") -> list[str]:
    """'name:line: [form] text' for every dated run, clock time, issue number, "this VM" or core count in the
    comments and docstrings of `source`."""
    found = []
    for block in text_blocks(source):
        text, starts = _joined(block)
        for form, pattern in FORMS.items():
            for m in pattern.finditer(text):
                _, number, line = [s for s in starts if s[0] <= m.start()][-1]
                found.append(f"{name}:{number}: [{form}: {m.group(0)!r}] {line}")
    return found


def test_product_comments_cite_sources_not_runs():
    found = []
    for path in product_files():
        found += find_logbook(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not found, ("comments and docstrings of product code name a run, a date, an issue or this machine; "
                       "keep the reason and cite benchmarks/results/ instead:\n" + "\n".join(found))


def test_the_checker_finds_each_form_and_skips_user_messages():
    snippet = '''"""Module doc: measured in the fidelity run of 2026-12-04."""
# the 08:31 run showed it
# 4 ranks on 2 cores, a 2-core host
MESSAGE = "printed to users: 2026-12-05 at 23:18 on 2 cores, issue 16, this VM"


class C:
    """Fixed for issue #16."""

    def f(self):
        """Timed on this
        VM."""
        return "at 07:10"  # at 23:18
'''
    found = find_logbook(snippet)
    text = "\n".join(found)
    for form in FORMS:
        assert f"[{form}:" in text, (form, found)
    assert any(f.startswith("<snippet>:1: [a date") for f in found)
    assert any(f.startswith("<snippet>:2: [a clock time: '08:31']") for f in found)
    assert sum("[a core count" in f for f in found) == 2
    assert any(f.startswith("<snippet>:8: [an issue number") for f in found)
    assert any(f.startswith("<snippet>:11: [this VM") for f in found)  # broken over two lines
    assert any(f.startswith("<snippet>:13: [a clock time: '23:18']") for f in found)
    # the message printed to users (line 4) and the returned string (line 13's code) are not comments
    assert not any(f.startswith("<snippet>:4:") for f in found)
    assert "07:10" not in text
    # slices, host:port and version numbers are not clock times
    assert find_logbook('# x[0:2], y[:, 1:3], HOST:29500, torch 2.13, ratio 1.5:1\n') == []


def test_cited_measurement_sections_exist():
    headings = {re.sub(r"\s*\(.*$", "", h) for h in re.findall(r"^## (.+)$", MEASUREMENTS.read_text(), re.M)}
    missing = []
    for path in product_files():
        for block in text_blocks(path.read_text(encoding="utf-8")):
            text, _ = _joined(block)
            missing += [f"{path.relative_to(ROOT)}:{block[0][0]}: {m}" for m in CITATION.findall(text)
                        if m not in headings]
    assert not missing, "cited sections missing from benchmarks/results/measurements.md:\n" + "\n".join(missing)
