"""Where a weight-transfer group may reach (InitWeightTransfer, vLLM's /init_weight_transfer_engine): the rendezvous
host's form and the networks security.weight_transfer_hosts allows. Shared by the config's checks and the transfer
group (weights/transfer.py); imports nothing of the service."""
from __future__ import annotations

import ipaddress
import re

# The engines dial master_address:master_port for the group's rendezvous, so an admin token could otherwise make
# them dial anything: a host must be a host name or an IP address (no scheme, no port), and where it resolves must
# be allowed (security.weight_transfer_hosts; by default the caller's own address).
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
MAX_HOST_NAME = 253
CALLER = "caller"                 # in security.weight_transfer_hosts: the calling trainer's own address
LOOPBACK_NETS = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


def host_problem(host: str) -> str | None:
    """What is wrong with a rendezvous host (a host name or an IP address, nothing else), or None."""
    if not host:
        return "required: the host name or IP address where the trainer's rank 0 hosts the group's rendezvous"
    if len(host) > MAX_HOST_NAME:
        return f"at most {MAX_HOST_NAME} characters (a host name or an IP address), got {len(host)}"
    if _ip(host) is not None:
        return None
    shown = repr(host[:80])
    if "://" in host or host.lower().startswith(("http:", "https:", "tcp:", "env:", "file:")):
        return f"{shown} has a scheme; give the host alone (a host name or an IP address)"
    if host.startswith("["):
        return f"{shown}: give an IPv6 address without brackets (and the port in master_port)"
    if ":" in host or "/" in host:
        return (f"{shown} is neither a host name nor an IP address; give the host alone (no port: that is "
                "master_port; no path or prefix length)")
    labels = host.split(".")
    if not all(_LABEL.fullmatch(label) for label in labels):
        return f"{shown} is neither an IP address nor a host name (letters, digits and hyphens, separated by dots)"
    if all(label.isdigit() for label in labels):
        return f"{shown} is not a valid IPv4 address (four numbers 0-255 separated by dots)"
    return None


def _ip(text: str):
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    return ip.ipv4_mapped or ip if ip.version == 6 else ip


def peer_ip(peer: str):
    """The IP address of a gRPC peer ("ipv4:10.0.0.5:53412", "ipv6:[::1]:53412"; "unix:..." is this machine:
    127.0.0.1), or of an HTTP client's host; None when it cannot be told."""
    if peer.startswith(("unix:", "unix-abstract:")):
        return ipaddress.ip_address("127.0.0.1")
    for prefix in ("ipv4:", "ipv6:"):
        if peer.startswith(prefix):
            peer = peer[len(prefix):].rsplit(":", 1)[0].strip("[]")
            break
    return _ip(peer.split("%", 1)[0]) if peer else None


def allowed_entry_problem(entry: str) -> str | None:
    """What is wrong with an entry of security.weight_transfer_hosts ("caller", an IP address, a CIDR block or a
    host name), or None."""
    if entry == CALLER:
        return None
    try:
        ipaddress.ip_network(entry, strict=False)
        return None
    except ValueError:
        pass
    problem = host_problem(entry)
    return None if problem is None else f"{entry!r}: not `caller`, an IP address, a CIDR block or a host name"


def allowed_networks(entries: list[str], caller, resolve) -> list:
    """The networks a group may reach: each entry of security.weight_transfer_hosts ([] = ["caller"]), a host
    name resolved by `resolve(name) -> [ip, ...]`; the caller's address (a loopback caller: every loopback
    address, this machine's trainers). `caller`: peer_ip's answer (None: none is allowed for "caller")."""
    nets = []
    for entry in entries or [CALLER]:
        if entry == CALLER:
            if caller is not None:
                nets += LOOPBACK_NETS if caller.is_loopback else [ipaddress.ip_network(caller)]
            continue
        try:
            nets.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            nets += [ipaddress.ip_network(ip) for ip in resolve(entry)]
    return nets


def outside(addresses: list, nets: list) -> list:
    """The addresses none of `nets` holds."""
    return [a for a in addresses if not any(a.version == n.version and a in n for n in nets)]
