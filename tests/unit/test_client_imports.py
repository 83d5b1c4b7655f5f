"""The SDK's import footprint: `pip install sluice[client]` has no torch, redis or numpy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_client_imports_no_server_dependencies() -> None:
    """Importing sluice.client loads neither torch, redis, numpy nor opentelemetry."""
    code = ("import sys, sluice.client; heavy = [m for m in ('torch', 'redis', 'numpy', 'opentelemetry') "
            "if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
