"""Nodes in network namespaces, so a drill can cut links between them (root only).

Layout: a bridge ``cmq<tag>br`` in the drill's namespace with address ``10.A.B.254/24``; node
``i`` lives in namespace ``cmq<tag>n<i>`` behind a veth pair (``cmq<tag>v<i>`` on the bridge,
``eth0`` inside) with address ``10.A.B.<i+1>``. The drill itself talks to every node over the
bridge, as a client on the network would. A cut is a pair of nftables drop rules (input from
and output to a peer) in the node's own namespace; healing deletes the node's table.
:meth:`Network.teardown` deletes the namespaces (which removes their veths and rules) and the
bridge; it runs on normal exit, on failure and on Ctrl-C, and is safe to call twice.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable

TABLE = "chronomq_drill"


def available() -> tuple[bool, str]:
    """Whether namespaces and nftables can be used here, and why not if not."""
    if os.geteuid() != 0:
        return False, "partition faults need root (network namespaces and nftables)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return False, f"partition faults need the {tool!r} command (apt-get install nftables)"
    return True, ""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=10)


class Network:
    def __init__(self, nodes: int, tag: str | None = None) -> None:
        pid = os.getpid()
        self.tag = tag or str(pid % 100000)
        self.n = nodes
        self.subnet = f"10.{200 + pid % 50}.{(pid // 50) % 250}"
        self.bridge = f"cmq{self.tag}br"
        self.hosts = [f"{self.subnet}.{i + 1}" for i in range(nodes)]
        self._up = False

    def ns(self, i: int) -> str:
        return f"cmq{self.tag}n{i}"

    def prefix(self, i: int) -> list[str]:
        """Command prefix that runs a process inside node ``i``'s namespace."""
        return ["ip", "netns", "exec", self.ns(i)]

    def setup(self) -> None:
        self.teardown()  # leftovers of a killed drill with the same tag
        self._up = True
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i in range(self.n):
            ns, veth = self.ns(i), self.veth(i)
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", veth, "master", self.bridge)
            _run("ip", "link", "set", veth, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.hosts[i]}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def cut(self, i: int, peers: Iterable[int]) -> None:
        """Drop traffic between node ``i`` and each of ``peers`` (both ways, in ``i``'s namespace)."""
        ns = self.ns(i)
        base = ["ip", "netns", "exec", ns, "nft"]
        _run(*base, "add", "table", "inet", TABLE)
        for chain, hook in (("in", "input"), ("out", "output")):
            _run(
                *base,
                "add",
                "chain",
                "inet",
                TABLE,
                chain,
                f"{{ type filter hook {hook} priority 0 ; policy accept ; }}",
            )
        for j in peers:
            _run(*base, "add", "rule", "inet", TABLE, "in", "ip", "saddr", self.hosts[j], "drop")
            _run(*base, "add", "rule", "inet", TABLE, "out", "ip", "daddr", self.hosts[j], "drop")

    def heal(self, i: int) -> None:
        _run(
            "ip", "netns", "exec", self.ns(i), "nft", "delete", "table", "inet", TABLE, check=False
        )

    def heal_all(self) -> None:
        for i in range(self.n):
            self.heal(i)

    def veth(self, i: int) -> str:
        return f"cmq{self.tag}v{i}"

    def teardown(self) -> None:
        # The veth pairs first: a namespace whose processes were just killed can outlive its
        # name for seconds (the kernel frees it once their sockets are gone), and its veth
        # pair with it; deleting our end removes both now.
        for i in range(self.n):
            _run("ip", "link", "del", self.veth(i), check=False)
            _run("ip", "netns", "del", self.ns(i), check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        self._up = False

    def leftovers(self) -> list[str]:
        """Namespaces and links of this network that still exist (for tests)."""
        out = _run("ip", "netns", "list", check=False).stdout
        names = [line.split()[0] for line in out.splitlines() if line.strip()]
        left = [n for n in names if n.startswith(f"cmq{self.tag}n")]
        links = _run("ip", "-o", "link", "show", check=False).stdout
        devices = {
            line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if ":" in line
        }
        left += [x for x in (self.bridge, *map(self.veth, range(self.n))) if x in devices]
        return left
