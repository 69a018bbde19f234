"""Networking helpers: every internal channel listens on one chosen address, never a wildcard.

On one host that address is loopback. Across hosts (Ray) it is the stage host's own cluster
address, and gloo is told the interface holding it (GLOO_SOCKET_IFNAME), because gloo would
otherwise take whatever the host name resolves to.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address (netdevice(7))


def listening_socket(host: str = LOOPBACK) -> socket.socket:
    """A TCP socket listening on `host` at a free port; its owner hands it to the TCPStore."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen()
    return sock


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on `host` now (it may be taken again before it is used: prefer
    listening_socket where the listener can be handed over)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def interface_of(address: str) -> str:
    """The name of this host's network interface that holds the IPv4 `address`."""
    if ipaddress.ip_address(address).is_loopback:
        return "lo"
    packed = socket.inet_aton(address)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # the interface has no IPv4 address
                continue
            if reply[20:24] == packed:
                return name
    raise OSError(
        f"no network interface of host {socket.gethostname()} holds the address {address}; "
        "set GLOO_SOCKET_IFNAME to the interface its pipeline stages should use"
    )
