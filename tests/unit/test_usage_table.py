"""docs/usage.md's parameter table covers every field the OpenAI edge knows (read, or refused by name)."""

from __future__ import annotations

import re
from pathlib import Path

from admission_svc import openai_convert, openai_tools

ROOT = Path(__file__).resolve().parents[2]


def _table_text() -> str:
    text = (ROOT / "docs" / "usage.md").read_text()
    start = text.index("| parameter | endpoint | Sluice |")
    return text[start:text.index("\n\n", start)]


def _fields_read(source: str) -> set[str]:
    return set(re.findall(r'(?:body\.get\(|body\[|_number\(body, |_flag\(body, |_in_range\(body, )"([a-z_]+)"',
                          source))


def test_the_field_list_names_every_field_the_converters_read() -> None:
    """Each body field openai_convert and openai_tools read for completions and chat is in KNOWN_FIELDS."""
    convert = Path(openai_convert.__file__).read_text()
    convert = convert[:convert.index("def tokenize_request")]  # /tokenize's own fields are documented with it
    read = _fields_read(convert) | _fields_read(Path(openai_tools.__file__).read_text())
    assert read and read <= openai_convert.KNOWN_FIELDS, read - openai_convert.KNOWN_FIELDS


def test_the_usage_table_lists_every_known_field() -> None:
    """Every known field appears as `name` in docs/usage.md's parameter table."""
    table = _table_text()
    missing = sorted(f for f in openai_convert.KNOWN_FIELDS if f"`{f}`" not in table and f"`{f}." not in table)
    assert not missing, f"docs/usage.md's parameter table lacks {missing}"
