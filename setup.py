"""Build hook: generate the protobuf modules (sluice/v1) from protos/ before setuptools collects packages.

All metadata lives in pyproject.toml. Generated code is never committed; a wheel built from a clean
clone carries it because this runs first (grpcio-tools is a build requirement).
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "scripts"))

from gen_protos import main as generate_protos  # noqa: E402

if generate_protos() != 0:
    raise SystemExit("generating the protobuf modules from protos/ failed")

setup()
