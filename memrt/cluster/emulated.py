"""A two-node cluster on one machine: two network namespaces joined by a rate-limited veth pair.

Ranks inside one namespace talk over the local stack (fast); ranks in different namespaces go through
the veth, limited by ``tc qdisc ... tbf`` on both ends. Addresses come from 198.18.0.0/15 (RFC 2544
benchmarking range) and exist only inside these namespaces. Needs root; :func:`can_emulate` says why not.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from typing import Mapping, Sequence

from memrt.config import environ

__all__ = ["EmulatedCluster", "can_emulate", "parse_rate"]

_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(k|m|g)?bit\s*$", re.IGNORECASE)


def parse_rate(rate: str) -> float:
    """``"1gbit"`` -> bits per second (decimal units, as tc uses)."""
    m = _RATE_RE.match(rate)
    if not m:
        raise ValueError(f"rate={rate!r} is not valid: expected e.g. 100mbit, 1gbit, 10gbit")
    scale = {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[(m.group(2) or "").lower() or None]
    return float(m.group(1)) * scale


def can_emulate() -> tuple[bool, str]:
    """(True, "") when this process can build namespaces, else (False, reason)."""
    if os.geteuid() != 0:
        return False, "needs root (ip netns, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"{tool} not found (apt-get install iproute2)"
    return True, ""


def _sh(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


class EmulatedCluster:
    """Two namespaces ``nodes[0]``, ``nodes[1]`` with addresses ``addrs[i]`` joined at ``rate``.

    Use as a context manager; everything is removed on exit (also after an exception).
    ``burst`` is tbf's bucket in bytes: small buckets make the limit exact, large ones smooth it.
    """

    def __init__(self, rate: str = "1gbit", *, burst_bytes: int = 256 * 1024, latency_ms: int = 50) -> None:
        self.rate = rate
        self.rate_bps = parse_rate(rate)
        self.burst_bytes = burst_bytes
        self.latency_ms = latency_ms
        tag = uuid.uuid4().hex[:6]
        self.nodes = (f"memrt-a-{tag}", f"memrt-b-{tag}")
        self.ifaces = (f"mra{tag}", f"mrb{tag}")
        # A /30 from 198.18.0.0/15 chosen from the tag so parallel clusters do not overlap.
        block = int(tag, 16) % 16000
        base = (198 << 24) | (18 << 16) | (block * 4)
        self.addrs = tuple(".".join(str((base + k >> s) & 255) for s in (24, 16, 8, 0)) for k in (1, 2))
        self._up = False

    def __enter__(self) -> "EmulatedCluster":
        ok, why = can_emulate()
        if not ok:
            raise RuntimeError(f"cannot build an emulated cluster: {why}")
        try:
            for ns in self.nodes:
                _sh("ip", "netns", "add", ns)
            self._up = True
            _sh("ip", "link", "add", self.ifaces[0], "type", "veth", "peer", "name", self.ifaces[1])
            for ns, iface, addr in zip(self.nodes, self.ifaces, self.addrs):
                _sh("ip", "link", "set", iface, "netns", ns)
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", iface)
                _sh("ip", "-n", ns, "link", "set", iface, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", iface, "root", "tbf",
                    "rate", self.rate, "burst", str(self.burst_bytes), "latency", f"{self.latency_ms}ms")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if not self._up:
            return
        for ns in self.nodes:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._up = False

    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        """argv wrapped to run inside namespace ``node`` (0 or 1)."""
        return ["ip", "netns", "exec", self.nodes[node], *argv]

    def popen(self, node: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start ``argv`` inside namespace ``node``; GLOO_SOCKET_IFNAME is set to that node's link."""
        full_env = environ()
        full_env.update(env or {})
        full_env.setdefault("GLOO_SOCKET_IFNAME", self.ifaces[node])
        argv = [sys.executable if a == "python" else a for a in argv]
        return subprocess.Popen(self.command(node, argv), env=full_env, **kw)

    def mpiexec_command(self, mpiexec: str, ranks_per_node: int, argv: Sequence[str], script_dir: str) -> list[str]:
        """An MPICH (Hydra) command line that places ``ranks_per_node`` ranks in each namespace.

        mpiexec itself runs in node 0; Hydra's ssh launcher is pointed at a small script (written to
        ``script_dir``) that starts each host's proxy inside that host's namespace instead of over ssh,
        so the two hosts are two nodes to MPICH. UCX is held to TCP (``UCX_TLS=tcp,self``) on the node's
        link: left alone it sees one machine and moves the "inter-node" messages through shared memory.
        """
        script = os.path.join(script_dir, "memrt-netns-launch.sh")
        cases = "\n".join(f"  {a}) ns={ns}; ifc={i} ;;" for a, ns, i in zip(self.addrs, self.nodes, self.ifaces))
        with open(script, "w") as f:
            f.write(f"""#!/bin/sh
# Hydra's ssh launcher calls: <this> [ssh options] <host> <command...>; run the command in <host>'s namespace.
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in
{cases}
  *) echo "memrt emulated cluster: unknown host $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" env UCX_TLS=tcp,self UCX_NET_DEVICES="$ifc" FI_TCP_IFACE="$ifc" FI_PROVIDER=tcp sh -c "$*"
""")
        os.chmod(script, 0o755)
        hosts = ",".join(f"{a}:{ranks_per_node}" for a in self.addrs)
        argv = [sys.executable if a == "python" else a for a in argv]
        return self.command(0, [mpiexec, "-launcher", "ssh", "-launcher-exec", script, "-hosts", hosts,
                                "-n", str(2 * ranks_per_node), *argv])

    def measure_rate(self, seconds: float = 2.0) -> float:
        """Measured bits per second from node 1 to node 0 over a TCP stream (bounded in time)."""
        port = 29411
        server = self.popen(0, ["python", "-m", "memrt.cluster._rate_probe", "serve", self.addrs[0], str(port)],
                            stdout=subprocess.PIPE, text=True)
        try:
            client = self.popen(1, ["python", "-m", "memrt.cluster._rate_probe", "send", self.addrs[0], str(port),
                                    str(seconds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            out, err = client.communicate(timeout=seconds + 30)
            if client.returncode != 0:
                raise RuntimeError(f"rate probe failed: {err.strip()}")
            return float(out.strip())
        finally:
            server.kill()
            server.wait()
