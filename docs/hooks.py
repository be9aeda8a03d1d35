"""MkDocs hooks (mkdocs.yml's ``hooks``): the home page is the repository's README, with its
links made the site's. A link into ``docs/`` becomes a link to that page; a link to another
file of the repository (an example, the changelog) is named as code, since the site does not
carry it. One source for the front page, checked by ``mkdocs build --strict`` like the rest."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _link(m: re.Match) -> str:
    label, target = m.group(1), m.group(2)
    if target.startswith(("http://", "https://", "#")):
        return m.group(0)
    if target.startswith("docs/"):
        return f"[{label}]({target[len('docs/'):]})"
    return label if label.startswith("`") else f"`{label}`"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    return re.sub(r"\[([^\]]+)\]\(([^)]+)\)", _link, README.read_text())
