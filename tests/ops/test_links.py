"""The repository's Markdown stands alone: every relative link resolves to a file inside the
repository (and a link to a heading, to a heading that exists), README.md stays a landing
page, and no user doc cites an issue number, which means nothing to a reader who has only
the repository. Each check is a function over text, proved on planted violations."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from rtrl.ops import docgen

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200
USER_DOCS = ("README.md", "CONTRIBUTING.md", "SECURITY.md", "CHANGELOG.md", "docs/**/*.md")
"""What users read: none of it may cite an issue number."""

CODE = re.compile(r"^(`{3,}|~{3,}).*?^\1", flags=re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]+`")
INLINE_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", flags=re.MULTILINE)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
ISSUE = re.compile(
    r"\b(?:issues?|pull requests?|PRs?)\s+#?\d+|(?<![\w#&])#\d+\b", flags=re.IGNORECASE
)


def prose(text: str) -> str:
    """``text`` without its code (fenced blocks, inline spans), where a link or a ``#12``
    is an example, not a reference. Lines keep their numbers."""
    return INLINE_CODE.sub("", CODE.sub(lambda block: "\n" * block.group(0).count("\n"), text))


def markdown_files(repo: Path) -> list[Path]:
    """Every Markdown file git tracks or would add (ignored files and node_modules aside)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "*.md"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sorted(
        {
            repo / name
            for name in listed.split("\0")
            if name and "node_modules" not in Path(name).parts and (repo / name).is_file()
        }
    )


def headings(path: Path) -> set[str]:
    text = CODE.sub("", path.read_text(encoding="utf-8"))
    return {
        docgen.anchor(heading.replace("`", ""))
        for heading in re.findall(r"^#+ (.+?)\s*$", text, flags=re.MULTILINE)
    }


def broken_links(repo: Path, files: list[Path]) -> list[str]:
    """Each relative link in ``files`` that leaves ``repo``, names no file there, or names a
    heading its Markdown target does not have. Links with a scheme (https:, mailto:) are
    not followed."""
    repo = repo.resolve()
    broken = []
    for path in files:
        text = prose(path.read_text(encoding="utf-8"))
        for link in INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text):
            if SCHEME.match(link):
                continue
            target, _, fragment = link.partition("#")
            resolved = (path.parent / target).resolve() if target else path.resolve()
            where = f"{path.relative_to(repo)} -> {link}"
            if not resolved.is_relative_to(repo):
                broken.append(f"{where}: outside the repository")
            elif not resolved.exists():
                broken.append(f"{where}: no such file")
            elif fragment and resolved.suffix == ".md" and fragment not in headings(resolved):
                broken.append(f"{where}: no such heading")
    return broken


def issue_citations(path: Path) -> list[str]:
    text = prose(path.read_text(encoding="utf-8"))
    text = INLINE_LINK.sub("", text)  # a link's target (#0-summary) is no citation
    return [
        f"{path.name}:{text.count(chr(10), 0, found.start()) + 1}: {found.group(0)!r}"
        for found in ISSUE.finditer(text)
    ]


def user_docs(repo: Path) -> list[Path]:
    return sorted({path for pattern in USER_DOCS for path in repo.glob(pattern)})


def test_every_relative_link_resolves_inside_the_repository():
    files = markdown_files(REPO)
    assert REPO / "README.md" in files and REPO / "docs" / "architecture.md" in files
    assert broken_links(REPO, files) == []


def test_a_link_out_of_the_repository_or_to_nothing_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Its section\n")
    planted = tmp_path / "README.md"
    planted.write_text(
        "# Planted\n\n"
        "[fine](docs/a.md) [fine too](docs/a.md#its-section) [here](#planted) "
        "[web](https://example.org/x.md) ![image](docs/a.md)\n"
        "[up](../outside.md) [missing](docs/b.md) [no heading](docs/a.md#nowhere)\n"
        "[ref]: docs/gone.md\n\n"
        "```\n[in code](../ignored.md)\n```\n`[inline](../ignored.md)`\n"
    )
    assert broken_links(tmp_path, [planted]) == [
        "README.md -> ../outside.md: outside the repository",
        "README.md -> docs/b.md: no such file",
        "README.md -> docs/a.md#nowhere: no such heading",
        "README.md -> docs/gone.md: no such file",
    ]


def test_the_readme_is_a_landing_page():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move detail to docs/"


def test_no_user_doc_cites_an_issue_number():
    docs = user_docs(REPO)
    assert REPO / "SECURITY.md" in docs and REPO / "docs" / "design" in {p.parent for p in docs}
    assert [found for path in docs for found in issue_citations(path)] == []


def test_issue_citations_are_found_and_code_and_colours_are_not(tmp_path):
    planted = tmp_path / "page.md"
    planted.write_text(
        "Fixed in issue 25, see issues 17 and 24, PR #3 and #27.\n"
        "Not these: `#27` in code, a colour #1f2a3b, [a heading](#0-summary), &#39;, C#.\n"
        "```\nsee #99\n```\n"
    )
    assert issue_citations(planted) == [
        "page.md:1: 'issue 25'",
        "page.md:1: 'issues 17'",
        "page.md:1: 'PR #3'",
        "page.md:1: '#27'",
    ]
