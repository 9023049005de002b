"""This process's TCP connections, from /proc (Linux; elsewhere none are found), and a way
to shut some down: a thread blocked in a library's socket call (torch's store client,
which has no timeout of its own) returns when its connection is shut down."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Iterable, Iterator


def socket_inodes() -> dict[int, int]:
    """Socket inode -> a file descriptor of it, of this process."""
    out: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:["):
                    out[int(target[8:-1])] = int(name)
    return out


def _proc_address(text: str) -> tuple[str, int]:
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
    address = ipaddress.ip_address(words)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address), int(port, 16)


def tcp_connections() -> Iterator[tuple[int, tuple[str, int], tuple[str, int], int]]:
    """(inode, local address, remote address, state) of the TCP sockets of this network
    namespace (state 10: listening)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as file:
                rows = file.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            try:
                local, remote = _proc_address(fields[1]), _proc_address(fields[2])
                inode, state = int(fields[9]), int(fields[3], 16)
            except (ValueError, IndexError):
                continue
            yield inode, local, remote, state


def shutdown_connections(hosts: set[str], port: int, spare: Iterable[int] = ()) -> int:
    """Shut down this process's TCP connections to ``port`` on one of ``hosts``, except
    the sockets of inodes ``spare``: a thread blocked on one returns; how many."""
    hosts = {str(ipaddress.ip_address(h.split("%")[0])) for h in hosts if is_ip(h)}
    spared = set(spare)
    mine = socket_inodes()
    count = 0
    for inode, _, (host, remote_port), _ in list(tcp_connections()):
        if remote_port != port or host not in hosts or inode in spared or inode not in mine:
            continue
        with contextlib.suppress(OSError):
            fd = os.dup(mine[inode])
            try:
                if os.fstat(fd).st_ino == inode:  # still that socket (not a reused number)
                    with socket.socket(fileno=os.dup(fd)) as sock:
                        sock.shutdown(socket.SHUT_RDWR)
                    count += 1
            finally:
                os.close(fd)
    return count


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    return True
