"""MkDocs hook: the site's home page is the README (one source), its links made relative to docs/.

mkdocs.yml names this file under `hooks:`; docs/index.md holds only the marker below. A README link into docs/
(`docs/quickstart.md`) becomes the page's (`quickstart.md`); a link to a file outside docs/ becomes its name in
the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- the README, put here by scripts/mkdocs_readme.py -->"


def site_home(readme: str) -> str:
    """The README as the site's home page."""
    text = re.sub(r"\]\(docs/", "](", readme)
    text = re.sub(r"\[([^\]]+)\]\((?!https?://|#)([^)/]+\.md)\)", r"`\2` in the repository", text)
    return text.replace("read the pages in `docs/`", "read the pages in `docs/` of the repository")


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "index.md":
        if markdown.strip() != MARKER:
            raise ValueError(f"docs/index.md must hold only {MARKER!r}: the home page is README.md")
        return site_home(README.read_text())
    return markdown
