"""Client-supplied text in errors and logs: short, quoted, control characters escaped."""

from __future__ import annotations

import io
import logging

from sluice.safe_text import EscapingFormatter, escape_controls, shown


def test_shown_quotes_short_values_whole_and_cuts_long_ones_with_their_length() -> None:
    """A short value is quoted whole; a long one is cut to the limit and says how long it was."""
    assert shown("req-1") == "'req-1'"
    cut = shown("x" * 20_000)
    assert cut == "'" + "x" * 64 + "'... (20000 chars)"


def test_control_characters_are_escaped_and_printable_text_is_kept() -> None:
    """Newlines, carriage returns, escape sequences, DEL and line separators become visible escapes;
    ordinary and non-ASCII printable text is unchanged."""
    assert escape_controls("héllo wörld €") == "héllo wörld €"
    assert escape_controls("a\nb\r\x1b[2J\x7f\u2028") == "a\\nb\\r\\x1b[2J\\x7f\\u2028"


def test_log_lines_cannot_be_forged_through_a_message_argument() -> None:
    """A logged caller value with a newline stays on one line, escaped."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(EscapingFormatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("test_safe_text")
    logger.addHandler(handler)
    try:
        logger.warning("replica %s registered", "r1\nERROR forged")
    finally:
        logger.removeHandler(handler)
    assert stream.getvalue() == "WARNING replica r1\\nERROR forged registered\n"


def test_services_log_through_the_escaping_formatter() -> None:
    """`serve.configure_logging` (what every `python -m <service>` runs) escapes control characters."""
    import subprocess
    import sys

    code = ("import logging; from sluice.serve import configure_logging; configure_logging('INFO'); "
            "logging.getLogger('svc').warning('unknown replica %s', 'r9\\nERROR forged')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].endswith("svc WARNING unknown replica r9\\nERROR forged")
