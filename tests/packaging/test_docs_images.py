"""Every image a page of the docs names exists in the repository and is embedded there
(a Markdown image whose target resolves to that file), so a reader sees it."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NAMED = re.compile(r"(?:docs/)?img/[\w./-]+\.(?:png|svg|jpg)")
EMBEDDED = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def _named(page: pathlib.Path) -> set[pathlib.Path]:
    """Image files the page names, as repository paths."""
    names = set()
    for match in NAMED.findall(page.read_text()):
        rel = match if match.startswith("docs/") else f"docs/{match}"
        names.add(REPO / rel)
    return names


def _embedded(page: pathlib.Path) -> set[pathlib.Path]:
    return {(page.parent / target).resolve() for target in EMBEDDED.findall(page.read_text())
            if not target.startswith("http")}


def test_docs_name_images():
    """The check below has something to check: the performance page promises plots."""
    assert _named(REPO / "docs" / "performance.md")


def test_every_named_image_exists_and_is_embedded_where_named():
    for page in PAGES:
        named = _named(page)
        missing = sorted(str(p.relative_to(REPO)) for p in named if not p.is_file())
        assert not missing, f"{page.name} names images that are not in the repository: {missing}"
        embedded = _embedded(page)
        unembedded = sorted(str(p.relative_to(REPO)) for p in named if p.resolve() not in embedded)
        assert not unembedded, f"{page.name} names but does not embed: {unembedded}"
        broken = sorted(str(p) for p in embedded if not p.is_file())
        assert not broken, f"{page.name} embeds images that do not exist: {broken}"
