"""The documentation's links hold: every relative file link in README.md, docs/, config/ and bench/ pages names a
file that exists, and every `#anchor` names a heading of the page it points at (GitHub's heading ids)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

PAGES = sorted(
    [REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("config/**/*.md"), *REPO.glob("bench/**/*.md")]
)
FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", flags=re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)[^)\n]*\)")  # [text](target "title"), images too
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", flags=re.M)


def prose(text: str) -> str:
    """The page without code blocks (their brackets are code, not links)."""
    return FENCE.sub("", text)


def anchors(page: Path) -> set[str]:
    """The heading ids GitHub gives a page: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    ids = set()
    for title in HEADING.findall(prose(page.read_text())):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link in a heading keeps its text
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids


def links(page: Path) -> list[str]:
    text = INLINE_CODE.sub("", prose(page.read_text()))
    return LINK.findall(text)


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(REPO)})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_links_resolve(page: Path) -> None:
    assert not broken_links(page), f"{page.relative_to(REPO)}: broken links {broken_links(page)}"


def test_the_front_page_is_short_and_links_every_docs_page() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 160, "README.md is the front page: move a subject to its docs/ page"
    linked = {(REPO / t.partition("#")[0]).resolve() for t in links(REPO / "README.md") if not t.startswith("#")}
    unlinked = [str(p.relative_to(REPO)) for p in REPO.glob("docs/*.md") if p.resolve() not in linked]
    assert not unlinked, f"README.md links no entry to {unlinked}"


def test_the_checker_finds_a_broken_file_and_anchor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "a.md").write_text(
        "# Title: one `thing`\n## Repeat\n## Repeat\n[ok](b.md#the-b-page) [self](#title-one-thing) [two](#repeat-1)\n"
        "[gone](c.md) [bad](#nowhere) `[code](x.md)`\n```\n[fenced](y.md)\n```\n[web](https://example.org/#x)\n"
    )
    (tmp_path / "b.md").write_text("# The B page\n")
    assert broken_links(tmp_path / "a.md") == [
        "c.md (no file c.md)",
        "#nowhere (no heading #nowhere in a.md)",
    ]
