"""Ports on 127.0.0.1 for the store of a group of rank workers (``testing.run_on_ranks``), and the error a taken one
gives.

Contract: :func:`free_port` returns a port nothing listened on when it was drawn, below the kernel's ephemeral range
where the machine leaves room there (so that no outgoing connection, gloo's among them, takes it before the store
listens); :func:`port_taken` says whether an exception is the store's ``EADDRINUSE``.
"""

from __future__ import annotations

import random
import socket
from typing import Tuple

LOOPBACK = "127.0.0.1"

__all__ = ["LOOPBACK", "free_port", "port_taken"]


def port_taken(exc: BaseException) -> bool:
    """Whether rank 0 could not listen on its store's port because another socket holds it (``EADDRINUSE``)."""
    return "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower()


def ephemeral_ports() -> Tuple[int, int]:
    """The range the kernel takes the local ports of outgoing connections from (Linux's setting, else its default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as settings:
            low, high = (int(value) for value in settings.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port free to listen on, for rank 0's store: below the ephemeral range where it can be.

    gloo opens many connections between ranks (of this pool and of any other run on the machine), each on a local port
    from the ephemeral range; a port found free there can be taken by one of them before rank 0 listens on it
    (``EADDRINUSE``). Below that range only another listener can take it.
    """
    low, _ = ephemeral_ports()
    draw = random.SystemRandom()  # not the random module's state, which a test may have seeded alike in every process
    if low > 2048:
        for _ in range(64):
            port = draw.randrange(max(1024, low - 16384), low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((LOOPBACK, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])
