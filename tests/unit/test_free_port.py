"""`free_port` (sluice/redis_server.py) hands out ports an outgoing connection cannot take before the listener binds
them: below the kernel's ephemeral range, free when handed out, and not handed out twice in a row."""

from __future__ import annotations

import socket
from pathlib import Path

from sluice.redis_server import free_port


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= port < low for port in ports), (low, sorted(ports)[-3:])
    for port in ports[:20]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))

