"""docs/console.md shows a screenshot of each page: every picture it names exists, and each
stays small enough to commit (the browser tests refresh them: AGENTOPS_DOC_SCREENSHOTS=1)."""

from __future__ import annotations

import re
from pathlib import Path

from django.conf import settings

DOCS = Path(settings.BASE_DIR) / "docs"
MAX_BYTES = 200 * 1024
PAGES = ("dashboard", "runs", "run-detail", "unknown", "approvals", "questions")


def test_every_picture_in_the_console_guide_exists_and_is_small():
    text = (DOCS / "console.md").read_text()
    pictures = re.findall(r"!\[[^\]]*\]\((img/[^)]+\.png)\)", text)

    for page in PAGES:
        assert f"img/console-{page}.png" in pictures, f"docs/console.md shows no {page} page"
    for picture in pictures:
        path = DOCS / picture
        assert path.is_file(), f"{picture} is missing"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{picture} is not a PNG"
        assert path.stat().st_size < MAX_BYTES, f"{picture} is {path.stat().st_size} bytes"
