"""Write the README's command synopsis from the CLI's own parsers (`python scripts/gen_readme_usage.py`).

The block between the two `usage` markers in README.md is the usage text of every `sluice` command, so it
lists every flag the code has; tests/unit/test_readme_usage.py fails when the two differ.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sluice_tools.cli import usage  # noqa: E402

BEGIN = "<!-- usage: generated from the parsers by scripts/gen_readme_usage.py; tests/unit/test_readme_usage.py -->"
END = "<!-- usage end -->"
COMMANDS = (("up",), ("generate",), ("bench",), ("sim",), ("model", "init"), ("redis-acl",))


def synopsis() -> str:
    """Return the README block: the markers around a code block of every command's usage."""
    body = "\n".join(usage(*command) for command in COMMANDS)
    return f"{BEGIN}\n```\n{body}\n```\n{END}"


def with_synopsis(readme: str) -> str:
    """Return `readme` with its usage block replaced by the current one; raises ValueError without markers."""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(readme):
        raise ValueError("README.md has no usage markers")
    return pattern.sub(lambda _: synopsis(), readme)


if __name__ == "__main__":
    path = ROOT / "README.md"
    path.write_text(with_synopsis(path.read_text()))
    print(f"wrote the usage of {len(COMMANDS)} commands into {path}")
