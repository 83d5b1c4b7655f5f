"""`sluice generate PROMPT`: send one prompt through the client SDK and stream the answer to stdout."""

from __future__ import annotations

import argparse
import os
import sys

from sluice.config import DEFAULT_API_KEY

EXAMPLES = """\
examples:
  sluice generate "Once upon a time" --target 127.0.0.1:50051
  sluice generate "Hello" --max-tokens 64 --temperature 0.8 --seed 7 --api-key sk-acme-1
  SLUICE_TARGET=127.0.0.1:50051 sluice generate "Hello" --ids

The answer streams to stdout; the request id, status and token counts go to stderr. Exit status 1
with the gRPC code and message (e.g. RESOURCE_EXHAUSTED, UNAVAILABLE) when the server refuses.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of `sluice generate`."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--target", default=os.environ.get("SLUICE_TARGET", "localhost:50051"),
                        help="admission HOST:PORT, as `sluice up` prints it (default: $SLUICE_TARGET, "
                             "else localhost:50051)")
    parser.add_argument("--api-key", default=os.environ.get("SLUICE_API_KEY", DEFAULT_API_KEY),
                        help=f"API key (default: $SLUICE_API_KEY, else {DEFAULT_API_KEY}, the key of a "
                             "deployment without a config file)")
    parser.add_argument("--max-tokens", type=_int32, default=32, help="tokens to generate at most (default: 32)")
    parser.add_argument("--priority", type=_int32, default=0, help="larger runs first (default: 0)")
    parser.add_argument("--model", default="", help="model name (default: the deployment's)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest; 0 = all (default)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed, for repeatable output")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline in seconds (default: 60)")
    parser.add_argument("--ids", action="store_true", help="print token ids instead of text")
    parser.add_argument("--tls-ca", default=os.environ.get("SLUICE_TLS_CA"),
                        help="CA certificate (PEM) of a TLS admission endpoint (default: $SLUICE_TLS_CA, else plaintext)")


def _int32(text: str) -> int:
    """argparse type: an integer that fits the wire's int32 (the message names the value and the range)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not -(2**31) <= value < 2**31:
        raise argparse.ArgumentTypeError(f"{value} is outside the 32-bit range [-2147483648, 2147483647]")
    return value


def run(args: argparse.Namespace) -> int:
    """Stream one generation; returns 0, or 1 with the error's code and message on stderr."""
    from sluice.client import Client, SluiceError

    last = None
    try:
        with Client(args.target, api_key=args.api_key, tls_ca=args.tls_ca) as client:
            for chunk in client.generate(args.prompt, max_tokens=args.max_tokens, priority=args.priority,
                                         model=args.model, temperature=args.temperature, top_p=args.top_p,
                                         top_k=args.top_k, seed=args.seed, stop=args.stop, timeout=args.timeout):
                out = " ".join(map(str, chunk.token_ids)) + (" " if chunk.token_ids else "") if args.ids \
                    else chunk.text
                sys.stdout.write(out)
                sys.stdout.flush()
                last = chunk
    except SluiceError as exc:
        print(f"\nerror: {exc.code.name}: {exc.message}"
              + (f" (retry after {exc.retry_delay_s:.2f}s)" if exc.retry_delay_s else ""), file=sys.stderr)
        return 1
    if last is not None and last.usage is not None:
        u = last.usage
        print(f"\n[{last.request_id}] {last.status.lower()} ({last.finish_reason}): {u.input_tokens} input, "
              f"{u.output_tokens} output tokens", file=sys.stderr)
    return 0
