"""Forward one vLLM engine's KV-event PUB socket to a loopback TCP port (run with any Python that has pyzmq).

    python sluice_tools/bench_peers_kvproxy.py ipc:///tmp/kv0.sock tcp://127.0.0.1:5557

Why: vllm-router's kv_aware connects its SUB socket to `tcp://HOST:PORT` and refuses wildcards, while vLLM's
publisher binds only for `*`/`::`/ipc endpoints (a `tcp://127.0.0.1:P` endpoint makes it connect instead). The
only loopback-only arrangement is this forwarder: XSUB connects to the engine's ipc socket, XPUB binds the
loopback port the router connects to. It passes multipart messages unchanged (topic, seq, payload).
"""

from __future__ import annotations

import sys

import zmq


def main(argv: list[str]) -> int:
    """Forward argv[0] (an endpoint to connect to) to argv[1] (a loopback endpoint to bind) until killed."""
    if len(argv) != 2:
        print("usage: bench_peers_kvproxy.py CONNECT_ENDPOINT BIND_ENDPOINT", file=sys.stderr)
        return 2
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    upstream = context.socket(zmq.XSUB)
    upstream.connect(argv[0])
    downstream = context.socket(zmq.XPUB)
    downstream.bind(argv[1])
    zmq.proxy(upstream, downstream)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
