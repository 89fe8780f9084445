"""The repo stands on its own: rule citations and Markdown links resolve inside it."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "design.md"
RULE_HEADING = re.compile(r"^###\s+Rule\s+(\d+):", re.MULTILINE)
# "rule 9", "rules 5-8", "rules 5 to 8", "rules 5 and 8", "Rules 1, 2, 3 and 7"
JOINER = r"\s*(?:,\s*and\b|,|-|\u2013|\bto\b|\band\b|\bor\b)\s*"
CITATION = re.compile(rf"\brules?\s+(\d+(?:{JOINER}\d+)*)", re.IGNORECASE)
RANGE = re.compile(r"(\d+)\s*(?:-|\u2013|\bto\b)\s*(\d+)", re.IGNORECASE)
# Built from pieces so that this file does not trip its own check.
FORBIDDEN = ("".join(("..", "/shared")), "".join(("DESIGN", ".md")))
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = ("http://", "https://", "mailto:")
BINARY_SUFFIXES = {".jsonl", ".png", ".jpg", ".gif", ".gguf", ".pdf", ".svg"}


def defined_rules() -> set[int]:
    """The rule numbers docs/design.md defines, from its `### Rule N:` headings."""
    return {int(number) for number in RULE_HEADING.findall(DESIGN.read_text())}


def cited_numbers(citation: str) -> set[int]:
    """The numbers one citation names: ranges expanded, lists split."""
    numbers = {int(n) for n in re.findall(r"\d+", RANGE.sub(" ", citation))}
    for low, high in RANGE.findall(citation):
        numbers.update(range(int(low), int(high) + 1))
    return numbers


def citations(text: str) -> Iterator[tuple[int, str, set[int]]]:
    """(line number, citation text, numbers) for every rule citation in ``text``."""
    for line_number, line in enumerate(text.splitlines(), 1):
        for match in CITATION.finditer(line):
            yield line_number, match.group(0), cited_numbers(match.group(1))


def bad_citations(where: str, text: str, defined: set[int]) -> list[str]:
    """One message per citation in ``text`` naming a rule docs/design.md does not define."""
    return [
        f"{where}:{line}: {cited!r} names rule(s) {sorted(numbers - defined)}, which "
        f"docs/design.md does not define (it defines {sorted(defined)})"
        for line, cited, numbers in citations(text)
        if numbers - defined
    ]


def cited_files() -> list[Path]:
    """Every file whose rule citations must resolve: code, tests, benchmarks and docs."""
    files = [path for top in ("src", "tests", "benchmarks") for path in (REPO / top).rglob("*.py")]
    files += (REPO / "docs").rglob("*.md")
    return sorted(files + [REPO / "README.md"])


def tracked_files() -> list[str]:
    """The repo's tracked paths (staged ones included); skip outside a git checkout."""
    try:
        listing = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [name for name in listing.decode().split("\0") if name]


def text_of(name: str) -> str | None:
    """A tracked file's text; None for data, binaries and files gone from the work tree."""
    path = REPO / name
    if "data" in Path(name).parts[:-1] or path.suffix in BINARY_SUFFIXES:
        return None
    try:
        raw = path.read_bytes()
    except OSError:  # tracked, but deleted or renamed in the work tree
        return None
    if b"\0" in raw[:8192]:
        return None
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


def outside_references(where: str, text: str) -> list[str]:
    """One message per line of ``text`` that points at files outside the repo."""
    return [
        f"{where}:{line_number}: {bad!r} in {line.strip()[:120]!r}"
        for line_number, line in enumerate(text.splitlines(), 1)
        for bad in FORBIDDEN
        if bad in line
    ]


def links(text: str) -> Iterator[tuple[int, str]]:
    """(line number, target) of every Markdown link outside fenced code blocks."""
    fenced = False
    for line_number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            for match in LINK.finditer(line):
                yield line_number, match.group(1)


def broken_links(md: Path) -> list[str]:
    """One message per relative link in ``md`` whose target is not a path in the repo."""
    where = md.relative_to(REPO)
    problems = []
    for line_number, target in links(md.read_text()):
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not path or target.startswith(EXTERNAL):
            continue
        resolved = (md.parent / path).resolve()
        if not (resolved.is_relative_to(REPO) and resolved.exists()):
            problems.append(f"{where}:{line_number}: link {target!r} is not a file in the repo")
    return problems


def test_design_defines_the_eleven_rules_in_order() -> None:
    headings = [int(n) for n in RULE_HEADING.findall(DESIGN.read_text())]
    assert headings == list(range(1, 12)), f"docs/design.md rule headings: {headings}"


@pytest.mark.parametrize(
    ("text", "numbers"),
    [
        ("the cap (rule 10)", [{10}]),
        ("Rule 4; rules 5-8", [{4}, {5, 6, 7, 8}]),
        ("rules 2 and 9, rules 5 to 7", [{2, 9}, {5, 6, 7}]),
        ("Rules 1, 2, 3 and 7 are not cited", [{1, 2, 3, 7}]),
        ("a rule of thumb, ruler 3", []),
    ],
)
def test_the_citation_parser_reads_every_form(text: str, numbers: list[set[int]]) -> None:
    assert [found for _, _, found in citations(text)] == numbers


def test_an_undefined_rule_is_reported_with_file_and_line() -> None:
    bogus = max(defined_rules()) + 1
    problems = bad_citations("x.py", f"ok\nsee rules 9 and {bogus}\n", defined_rules())
    assert len(problems) == 1 and problems[0].startswith(f"x.py:2: 'rules 9 and {bogus}'")


def test_every_rule_citation_names_a_defined_rule() -> None:
    defined = defined_rules()
    problems = [
        message
        for path in cited_files()
        for message in bad_citations(str(path.relative_to(REPO)), path.read_text(), defined)
    ]
    assert not problems, "\n".join(problems)


def test_no_tracked_file_points_outside_the_repo() -> None:
    problems = [
        message
        for name in tracked_files()
        for message in outside_references(name, text_of(name) or "")
    ]
    assert not problems, "\n".join(problems)


def test_every_relative_markdown_link_resolves() -> None:
    docs = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
    problems = [message for md in docs for message in broken_links(md)]
    assert not problems, "\n".join(problems)
