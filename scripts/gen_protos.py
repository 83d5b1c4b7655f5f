"""Generate the Python protobuf and gRPC modules from protos/ into sluice/v1/ (never edited by hand)."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    proto_dir = ROOT / "protos"
    sources = sorted(str(p.relative_to(proto_dir)) for p in (proto_dir / "sluice" / "v1").glob("*.proto"))
    include = Path(protoc.__file__).resolve().parent / "_proto"
    out = ROOT / "sluice" / "v1"
    out.mkdir(parents=True, exist_ok=True)
    (out / "__init__.py").write_text('"""Generated protobuf modules (scripts/gen_protos.py); do not edit."""\n')
    args = ["protoc", f"-I{proto_dir}", f"-I{include}", f"--python_out={ROOT}", f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}", *sources]
    code = protoc.main(args)
    if code != 0:
        print(f"protoc failed with exit code {code}", file=sys.stderr)
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
