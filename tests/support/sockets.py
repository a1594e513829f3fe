"""The TCP ports a tree of processes listens on, and whether an address is loopback."""

from __future__ import annotations

import ipaddress

import psutil

__all__ = ["is_loopback", "listening", "process_tree"]


def process_tree(root: int) -> dict[int, str]:
    """pid -> command line (a Ray worker's is its title) of ``root`` and every process under it."""
    found = {}
    top = psutil.Process(root)
    for proc in [top, *top.children(recursive=True)]:
        try:
            found[proc.pid] = " ".join(proc.cmdline())
        except psutil.Error:  # gone meanwhile
            continue
    return found


def listening(pids: dict[int, str]) -> list[tuple[str, str, int]]:
    """(command line, address, port) of every TCP socket that one of ``pids`` listens on."""
    return [
        (pids[c.pid], c.laddr.ip, c.laddr.port)
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    ]


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped loopback address."""
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)
