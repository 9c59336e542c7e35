"""The ACL users docs/security.md recommends, read from the doc itself, so a test runs exactly
what an operator copies."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

SECURITY_MD = Path(__file__).resolve().parents[2] / "docs" / "security.md"


def documented_tier_rules() -> list[str]:
    """The tier user's rules as docs/security.md gives them (its password left out)."""
    for line in SECURITY_MD.read_text().splitlines():
        match = re.fullmatch(r"ACL SETUSER hma-tier (.+)", line.strip())
        if match:
            return [r for r in shlex.split(match.group(1)) if not r.startswith(">")]
    raise AssertionError("docs/security.md gives no hma-tier user")
