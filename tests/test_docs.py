"""Docs a newcomer can trust: the README and docs/RESULTS.md within their lengths, every pointer from the code or
the docs into RESULTS or DESIGN naming a section that exists, and DESIGN's walk of one gradient ("One gradient,
from compress to the link and back") pointing at the lines that hold what it names."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README, DESIGN, RESULTS = REPO / "README.md", REPO / "docs" / "DESIGN.md", REPO / "docs" / "RESULTS.md"
SOURCES = [p for d in ("safebits_hvd", "bench", "tests", "mpi_tests", "ddp_tests", "trainer_tests")
           for p in sorted((REPO / d).rglob("*")) if p.suffix in (".py", ".c", ".h", ".cu", ".sh")]
DOCS = [README, DESIGN, RESULTS, REPO / "bench" / "README.md"]

NUMBERED = re.compile(r"RESULTS\.md,?\s+(?:section\s+)?(\d+(?:\.\d+)?[a-z]?)\b")
TITLED = re.compile(r"(RESULTS|DESIGN)\.md,\s+\"([^\"]+)\"")
WALK = re.compile(r"`(safebits_hvd/[\w/]+\.(?:py|c)):(\d+)` `([\w.]+)`")


def headings(path: Path) -> list[str]:
    """Its sections' titles: the headings, and the bold words that open a paragraph (``**Where the budget goes**``)."""
    lines = path.read_text().splitlines()
    return ([line.lstrip("#").strip() for line in lines if line.startswith("#")]
            + [m.group(1) for line in lines if (m := re.match(r"\*\*([^*]+)\*\*", line))])


def plain(title: str) -> str:
    return re.sub(r"[`'\"]", "", title).lower()


def section_numbers() -> set[str]:
    return {m.group(1) for h in headings(RESULTS) if (m := re.match(r"(\d+(?:\.\d+)?[a-z]?)\.?\s", h))}


def references() -> list[tuple[str, str, str]]:
    """(file, kind, target) of every pointer into RESULTS (by number or title) or DESIGN (by title)."""
    found = []
    for path in SOURCES + DOCS:
        text = re.sub(r"\s+", " ", path.read_text(errors="replace"))      # pointers may wrap across lines
        relative = str(path.relative_to(REPO))
        found += [(relative, "RESULTS", m.group(1)) for m in NUMBERED.finditer(text)]
        found += [(relative, m.group(1), m.group(2)) for m in TITLED.finditer(text)]
    return found


def test_the_readme_and_results_keep_their_lengths() -> None:
    assert len(README.read_text().splitlines()) <= 100
    assert len(RESULTS.read_text().splitlines()) <= 500


def test_every_pointer_into_results_or_design_names_a_section() -> None:
    numbers = section_numbers()
    titles = {"RESULTS": headings(RESULTS), "DESIGN": headings(DESIGN)}
    refs = references()
    assert len(refs) > 40, refs                   # the checker sees the pointers
    missing = [(where, kind, target) for where, kind, target in refs
               if not (target in numbers if kind == "RESULTS" and target[0].isdigit()
                       else any(plain(target) in plain(h) for h in titles[kind]))]
    assert not missing, missing


def test_the_checker_finds_a_dangling_pointer() -> None:
    numbers = section_numbers()
    assert "5.4" in numbers and "2.1b" in numbers and "11.9" not in numbers


def walk() -> list[tuple[str, int, str]]:
    start = DESIGN.read_text().index("## One gradient, from compress to the link and back")
    section = DESIGN.read_text()[start:].split("\n## ", 1)[0]
    return [(m.group(1), int(m.group(2)), m.group(3)) for m in WALK.finditer(section)]


def defines(name: str) -> re.Pattern[str]:
    """A line that defines ``name``: ``def name(``, ``class name``, or a C function's ``type name(``."""
    return re.compile(rf"(def |class |^\w[\w *]*\b){re.escape(name.split('.')[-1])}\b")


def relocated(file: str, line: int, name: str) -> int:
    """The line nearest ``line`` of ``file`` that defines ``name``."""
    pattern = defines(name)
    lines = (REPO / file).read_text().splitlines()
    found = [k for k, text in enumerate(lines, 1) if pattern.search(text)]
    return min(found, key=lambda k: abs(k - line)) if found else line


def fix_walk() -> None:
    """``python tests/test_docs.py``: move each line number of the walk to the nearest definition of its name."""
    text = DESIGN.read_text()
    for file, line, name in walk():
        text = text.replace(f"`{file}:{line}` `{name}`", f"`{file}:{relocated(file, line, name)}` `{name}`")
    DESIGN.write_text(text)


def test_designs_walk_of_one_gradient_points_at_what_it_names() -> None:
    steps = walk()
    assert len(steps) >= 15, steps
    wrong = []
    for file, line, name in steps:
        lines = (REPO / file).read_text().splitlines()
        if not (0 < line <= len(lines) and defines(name).search(lines[line - 1])):
            wrong.append((file, line, name))
    assert not wrong, f"docs/DESIGN.md's walk points elsewhere (python tests/test_docs.py moves them): {wrong}"


if __name__ == "__main__":
    fix_walk()
