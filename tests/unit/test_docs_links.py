"""Every relative link in README.md and docs/*.md reaches a file or heading the project has.

Anchors follow Python-Markdown's ``toc`` slugs (what mkdocs renders); the
team's own notes (design, Celery facts, style) are never named to users.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)


def slug(heading: str) -> str:
    text = re.sub(r"[`*_]", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    body = FENCE.sub("", page.read_text())
    return {slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*$", body, flags=re.M)}


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_team_notes_named(page: Path) -> None:
    text = page.read_text()
    named = [n for n in ("DESIGN.md", "DESIGN", "CELERY_FACTS", "STYLE.md") if n in text]
    assert not named, f"{page.name} names {named}: users do not have these files"


def test_links_are_found() -> None:
    """The checker sees links at all (a regex that matches nothing passes everything)."""
    found = [t for p in PAGES for t in links(p)]
    assert "getting-started.md" in found or any("getting-started.md" in t for t in found)
    assert any("#" in t for t in found)
    assert slug("A ledger with `fencing.guard`") == "a-ledger-with-fencingguard"


def test_a_broken_link_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[x](missing.md) [y](#title) [z](#nope)\n")
    assert links(page) == ["missing.md", "#title", "#nope"]
    assert anchors(page) == {"title"}
