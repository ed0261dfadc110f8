"""A small internet in Linux network namespaces: a public segment, and hosts behind home routers that masquerade.

::

    public namespace (bridge, 198.18.0.1/24): the bootstrap and the public peers
        |-- router 0 (wan 198.18.0.10) -- masquerades --  private host 0 (10.1.0.2/24, via 10.1.0.1)
        |-- router 1 (wan 198.18.0.11) -- masquerades --  private host 1 (10.2.0.2/24, via 10.2.0.1)

Each private host sits behind a router of its own (two volunteers at two homes, not two machines on one LAN that
could dial each other). A router forwards what its host dials out, rewritten to the router's public address, and
the answers to it; a connection opened from the public side is dropped, and the public side has no route to a
private subnet at all. That is a home router without port forwarding.

Where the kernel cannot masquerade (:func:`masquerade_supported` says why), :class:`NatLab` falls back to routed
addresses (198.18.<i+1>.2) whose router drops every connection opened from outside (conntrack state NEW): the same
"dials out, cannot be dialled" host, without address translation.

Every name carries a per-lab random tag, so labs of parallel or crashed runs never collide, and :meth:`NatLab.close`
deletes whatever was created (namespaces take their veths and rules with them) even after a failed setup.
"""

from __future__ import annotations

import enum
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Self

PUBLIC_NET = "198.18.0"  # the "internet" segment (RFC 2544 benchmark range: never a real route)
PUBLIC_IP = f"{PUBLIC_NET}.1"


class LabMode(enum.Enum):
    """How the private hosts are kept from being dialled."""

    MASQUERADE = "masquerade"  # private addresses, translated on the way out: a real home NAT
    DROP_INBOUND = "drop-inbound"  # routed addresses; the router drops connections opened from outside


@dataclass(frozen=True)
class Host:
    """One namespace that runs peers: its name and the address its peers listen on."""

    namespace: str
    address: str
    public: bool

    def program(self, *argv: str) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def listen(self, port: int = 0) -> str:
        """The multiaddr a peer on this host listens on."""
        return f"/ip4/{self.address}/tcp/{port}"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def _in(ns: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", ns, *argv], check=True, capture_output=True, text=True, timeout=10)


def netns_unavailable() -> str | None:
    """Why this machine cannot build a lab (a skip reason), or None when it can."""
    if os.name != "posix" or not shutil.which("ip"):
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if not shutil.which("iptables"):
        return "iptables is not installed (`make setup` installs it as root on Debian/Ubuntu)"
    probe = f"hlbp-probe-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` failed: {getattr(exc, 'stderr', '') or exc}".strip()
    finally:
        subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True, timeout=10)
    return None


def masquerade_supported() -> str | None:
    """None if the kernel takes a MASQUERADE rule; else the error of the command that shows it cannot."""
    probe = f"hlbp-probe-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
        _in(probe, "iptables", "-t", "nat", "-A", "POSTROUTING", "-s", "10.0.0.0/8", "-j", "MASQUERADE")
        return None
    except subprocess.CalledProcessError as exc:
        return f"`iptables -t nat -A POSTROUTING -j MASQUERADE` failed: {exc.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True, timeout=10)


@dataclass
class NatLab:
    """The topology of the module docstring with ``n_private`` hosts behind NAT; a context manager."""

    n_private: int
    mode: LabMode | None = None  # None: MASQUERADE where the kernel supports it, else DROP_INBOUND
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    public: Host = field(init=False)
    private: list[Host] = field(init=False, default_factory=list)
    fallback_reason: str | None = field(init=False, default=None)  # why masquerade was not used
    _namespaces: list[str] = field(init=False, default_factory=list)

    def __enter__(self) -> Self:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ns(self, role: str) -> str:
        name = f"hlbp-{self.tag}-{role}"
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _in(name, "ip", "link", "set", "lo", "up")
        return name

    def _veth(self, a_ns: str, a_name: str, b_ns: str, b_name: str) -> None:
        """A veth pair from ``a_ns`` (named ``a_name`` there) to ``b_ns`` (``b_name``), both up."""
        tmp_a, tmp_b = f"hv{self.tag}{secrets.token_hex(2)}", f"hv{self.tag}{secrets.token_hex(2)}"
        _ip("link", "add", tmp_a, "type", "veth", "peer", "name", tmp_b)
        for tmp, ns, name in ((tmp_a, a_ns, a_name), (tmp_b, b_ns, b_name)):
            _ip("link", "set", tmp, "netns", ns)
            _in(ns, "ip", "link", "set", tmp, "name", name)
            _in(ns, "ip", "link", "set", name, "up")

    def _build(self) -> None:
        if self.mode is None:
            self.fallback_reason = masquerade_supported()
            self.mode = LabMode.MASQUERADE if self.fallback_reason is None else LabMode.DROP_INBOUND
        pub = self._ns("pub")
        _in(pub, "ip", "link", "add", "br0", "type", "bridge")
        _in(pub, "ip", "addr", "add", f"{PUBLIC_IP}/24", "dev", "br0")
        _in(pub, "ip", "link", "set", "br0", "up")
        self.public = Host(pub, PUBLIC_IP, public=True)
        for i in range(self.n_private):
            router, home = self._ns(f"r{i}"), self._ns(f"h{i}")
            self._veth(pub, f"up{i}", router, "wan")
            _in(pub, "ip", "link", "set", f"up{i}", "master", "br0")
            wan_ip = f"{PUBLIC_NET}.{10 + i}"
            _in(router, "ip", "addr", "add", f"{wan_ip}/24", "dev", "wan")
            subnet = f"10.{i + 1}.0" if self.mode is LabMode.MASQUERADE else f"198.18.{i + 1}"
            self._veth(router, "lan", home, "eth0")
            _in(router, "ip", "addr", "add", f"{subnet}.1/24", "dev", "lan")
            _in(home, "ip", "addr", "add", f"{subnet}.2/24", "dev", "eth0")
            _in(home, "ip", "route", "add", "default", "via", f"{subnet}.1")
            _in(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            # what the home dialled may answer; nothing else comes in
            _in(router, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack", "--ctstate",
                "ESTABLISHED,RELATED", "-j", "ACCEPT")
            _in(router, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-j", "DROP")
            if self.mode is LabMode.MASQUERADE:
                _in(router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-s", f"{subnet}.0/24", "-o", "wan",
                    "-j", "MASQUERADE")
            else:  # routed: the public side knows the way in, and the router's FORWARD rules refuse it
                _in(pub, "ip", "route", "add", f"{subnet}.0/24", "via", wan_ip)
            self.private.append(Host(home, f"{subnet}.2", public=False))

    def close(self) -> None:
        """Delete every namespace this lab created (their veths, bridge and rules go with them)."""
        for name in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True, timeout=10)
        self._namespaces.clear()
