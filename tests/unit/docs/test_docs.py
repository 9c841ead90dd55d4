"""The documentation's links stay inside the repository and point at things that exist.

Scans README.md, docs/*.md and the benchmarks' READMEs: no URL (``http(s)://``, ``www.``,
``mailto:``), no relative path that leaves the repository, no relative link to a missing file,
and no ``#anchor`` that names no heading of its target page (GitHub's heading slugs).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/**/*.md")])

_FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
_HTML = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""", re.I)
_OUTSIDE = re.compile(r"https?://|www\.|mailto:|ftp://", re.I)
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans (their brackets are not links)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    """Every link target of a Markdown page: inline links and images, reference definitions and
    HTML ``href``/``src`` attributes, outside code."""
    prose = _prose(text)
    return [m.group(1) for pattern in (_INLINE_LINK, _REFERENCE, _HTML)
            for m in pattern.finditer(prose)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, links reduced to their text, punctuation other
    than ``-`` and ``_`` dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    result = set()
    for match in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", _FENCE.sub("", text), re.M):
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def problems(page: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the links of ``page``, a page of the repository at ``root``."""
    text = page.read_text()
    found = [f"a URL: {m.group(0)}…" for m in _OUTSIDE.finditer(text)]
    for target in links(text):
        if _SCHEME.match(target):
            found.append(f"leaves the repository: {target}")
            continue
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        try:
            destination.relative_to(root)
        except ValueError:
            found.append(f"leaves the repository: {target}")
            continue
        if not destination.exists():
            found.append(f"no such file: {target}")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(
                destination.read_text()):
            found.append(f"no heading #{anchor} in {destination.relative_to(root)}")
    return found


def test_pages_are_found():
    names = {page.relative_to(ROOT).as_posix() for page in PAGES}
    assert {"README.md", "docs/guide.md", "docs/architecture.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_stay_inside_and_resolve(page):
    assert problems(page) == []


def test_readme_links_the_guide_and_architecture():
    targets = links((ROOT / "README.md").read_text())
    for page in ("docs/guide.md", "docs/architecture.md"):
        assert any(t.partition("#")[0] == page for t in targets), page


def test_checker_catches_bad_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Real heading\n")
    page = tmp_path / "docs" / "a.md"
    page.write_text("[out](https://example.org) [up](../../x.md) [gone](missing.md) "
                    "[anchor](b.md#no-such) [fine](b.md#real-heading) `[code](nowhere.md)`\n"
                    "```\n[block](nowhere.md)\n```\n")
    found = problems(page, tmp_path)
    assert len([f for f in found if f.startswith("a URL")]) == 1
    assert "leaves the repository: https://example.org" in found
    assert "leaves the repository: ../../x.md" in found
    assert "no such file: missing.md" in found
    assert "no heading #no-such in docs/b.md" in found
    assert len(found) == 5
