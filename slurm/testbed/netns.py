"""Virtual hosts on one machine: network namespaces joined by a bridge, links rate-limited with tc.

``python -m slurm.testbed.netns create N [--rate 1gbit] [--nics G] [--prefix hpcnet] [--subnet 10.77.0]``
makes, for a prefix P and a /24 subnet S:

- namespaces ``P0 .. P(N-1)``, each with loopback up and one interface ``eth0`` = ``S.(i+1)/24``;
- a bridge ``Pbr`` in the root namespace with address ``S.254``: the hosts reach each other
  through it, and daemons in the root namespace (slurmctld) are reachable from every host;
- a veth pair per host, ``Pv<i>`` (root side, on the bridge) to ``eth0`` (inside);
- with ``--nics G``, G such links a host, as a GPU node has a NIC per GPU: ``eth<k>`` on the subnet whose
  third octet is S's plus k (``Pv<i>n<k>`` its root side), so traffic to a host's k-th address leaves by the
  k-th link and G rank pairs talking address to address each have a link of their own;
- with ``--rate``, a tbf qdisc on *both* ends of every veth: tbf shapes only egress, so the
  root side limits what enters a host and ``eth0`` what leaves it. (This kernel has no netem:
  rates only, no delay or loss.)

``destroy`` removes exactly what ``create`` made: every object is recorded in
``/run/hpc-netns/P.json`` before it is made, so a create that failed halfway is undone too.
Processes still inside a namespace at destroy time were started through it (``exec``, the
testbed, a node's slurmd) and are stopped by PID first, or the namespace would outlive us.
``exec I -- CMD`` runs CMD in host I with ``nsenter --net`` (not ``ip netns exec``, which
remounts /sys and hides /sys/fs/cgroup) and ``GLOO_SOCKET_IFNAME=eth0`` (``exec --nic K I``: ``eth<k>``).
``throughput`` sends bytes over TCP between two hosts (or the root namespace) and prints the rate it measured.

Hand-written on iproute2 and ctypes' setns rather than pyroute2: a few ``ip``/``tc`` commands
do not justify a dependency, and ``slurm`` stays standard-library only.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from hpc.errors import HpcError
from hpc.rundir import write_json
from slurm.testbed import run_command

STATE_DIR = Path("/run/hpc-netns")
NETNS_DIR = Path("/run/netns")
INTERFACE = "eth{nic}"
BRIDGE_HOST = 254
CLONE_NEWNET = 0x40000000
RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


class TestbedError(HpcError):
    """A namespace, link or qdisc could not be made, found or removed."""


@dataclass(frozen=True)
class Testbed:
    """What ``create`` was asked for; every name and address derives from it."""

    prefix: str
    hosts: int
    subnet: str
    rate: str | None
    nics: int = 1

    def namespace(self, index: int) -> str:
        return f"{self.prefix}{index}"

    def nic_subnet(self, nic: int) -> str:
        first, second, third = self.subnet.split(".")
        return f"{first}.{second}.{int(third) + nic}"

    def address(self, index: int, nic: int = 0) -> str:
        return f"{self.nic_subnet(nic)}.{index + 1}"

    def root_link(self, index: int, nic: int = 0) -> str:
        return f"{self.prefix}v{index}" + (f"n{nic}" if nic else "")

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    def bridge_address(self, nic: int = 0) -> str:
        return f"{self.nic_subnet(nic)}.{BRIDGE_HOST}"

    @property
    def names(self) -> list[str]:
        return [self.namespace(i) for i in range(self.hosts)]


def rate_bits(rate: str) -> int:
    """``1gbit`` -> 10**9; only tc's decimal bit units, so the number means what tc does."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", rate.strip().lower())
    if not match or float(match[1]) <= 0:
        raise TestbedError(f"rate {rate!r} is not like 100mbit or 1gbit")
    return int(float(match[1]) * RATE_UNITS[match[2]])


def check_testbed(testbed: Testbed) -> None:
    if not re.fullmatch(r"[a-z][a-z0-9]*", testbed.prefix):
        raise TestbedError(f"prefix {testbed.prefix!r} must be lower-case letters and digits, starting with a letter")
    if not 1 <= testbed.hosts < BRIDGE_HOST:
        raise TestbedError(f"host count {testbed.hosts} must be between 1 and {BRIDGE_HOST - 1}")
    if not 1 <= testbed.nics <= 8:
        raise TestbedError(f"NIC count {testbed.nics} must be between 1 and 8")
    if len(testbed.root_link(testbed.hosts - 1, testbed.nics - 1)) > 15:
        raise TestbedError(f"prefix {testbed.prefix!r} is too long for interface names (15 characters)")
    octets = testbed.subnet.split(".")
    if len(octets) != 3 or not all(o.isdigit() and int(o) < 256 for o in octets):
        raise TestbedError(f"subnet {testbed.subnet!r} must be the first three octets of a /24, e.g. 10.77.0")
    if int(octets[2]) + testbed.nics > 256:
        raise TestbedError(f"subnet {testbed.subnet!r} leaves no room for {testbed.nics} NICs' subnets after it")
    if testbed.rate is not None:
        rate_bits(testbed.rate)


def state_path(prefix: str) -> Path:
    return STATE_DIR / f"{prefix}.json"


def load(prefix: str) -> Testbed | None:
    """The testbed recorded under this prefix, or None."""
    path = state_path(prefix)
    if not path.exists():
        return None
    return Testbed(**json.loads(path.read_text())["testbed"])


def _made(prefix: str) -> list[list[str]]:
    path = state_path(prefix)
    return json.loads(path.read_text())["made"] if path.exists() else []


def _record(testbed: Testbed, made: list[list[str]]) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    write_json(state_path(testbed.prefix), {"testbed": asdict(testbed), "made": made})


def _run(*argv: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise TestbedError(f"{' '.join(argv)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", "dev", name], capture_output=True).returncode == 0


def _exists(kind: str, name: str) -> bool:
    return (NETNS_DIR / name).exists() if kind == "netns" else _link_exists(name)


def _tbf(rate: str) -> list[str]:
    """tbf arguments: a burst of 4 ms at the rate (at least 64 KiB, so GSO packets pass whole)."""
    burst = max(rate_bits(rate) // 8 // 250, 64 * 1024)
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]


def _plan(testbed: Testbed) -> Iterator[tuple[list[str], list[list[str]]]]:
    """(object, commands that make it) in creation order; the object is recorded before its commands run."""
    ns = ["ip", "-n"]
    yield ["link", testbed.bridge], [
        ["ip", "link", "add", testbed.bridge, "type", "bridge"],
        *(["ip", "addr", "add", f"{testbed.bridge_address(k)}/24", "dev", testbed.bridge] for k in range(testbed.nics)),
        ["ip", "link", "set", testbed.bridge, "up"],
    ]
    for i, name in enumerate(testbed.names):
        # A host answers ARP for any of its addresses on any link: with several NICs on one bridge, the k-th
        # address must be reached by the k-th link only (arp_ignore 1, arp_announce 2: each link speaks for itself).
        arp = [["ip", "netns", "exec", name, "sysctl", "-q", "-w", f"net.ipv4.conf.all.{key}={value}"]
               for key, value in (("arp_ignore", 1), ("arp_announce", 2))] if testbed.nics > 1 else []
        yield ["netns", name], [["ip", "netns", "add", name], [*ns, name, "link", "set", "lo", "up"], *arp]
        for k in range(testbed.nics):
            link, inside = testbed.root_link(i, k), INTERFACE.format(nic=k)
            steps = [
                ["ip", "link", "add", link, "type", "veth", "peer", "name", inside, "netns", name],
                ["ip", "link", "set", link, "master", testbed.bridge, "up"],
                [*ns, name, "addr", "add", f"{testbed.address(i, k)}/24", "dev", inside],
                [*ns, name, "link", "set", inside, "up"],
            ]
            if testbed.rate is not None:
                steps += [
                    ["tc", "qdisc", "add", "dev", link, "root", *_tbf(testbed.rate)],
                    ["tc", "-n", name, "qdisc", "add", "dev", inside, "root", *_tbf(testbed.rate)],
                ]
            yield ["link", link], steps


def create(testbed: Testbed) -> bool:
    """Make the testbed; False when exactly this one already exists (idempotent)."""
    check_testbed(testbed)
    existing = load(testbed.prefix)
    if existing is not None:
        if existing != testbed:
            raise TestbedError(f"testbed {testbed.prefix!r} exists as {existing}; destroy it first")
        if all(_exists(kind, name) for kind, name in _made(testbed.prefix)):
            return False
        destroy(testbed.prefix)
    plan = list(_plan(testbed))
    taken = [name for (kind, name), _ in plan if _exists(kind, name)]
    if taken:
        raise TestbedError(f"{', '.join(taken)} already exist but were not made by this testbed", prefix=testbed.prefix)
    made: list[list[str]] = []
    try:
        for thing, commands in plan:
            made.append(thing)
            _record(testbed, made)
            for command in commands:
                _run(*command)
    except TestbedError:
        destroy(testbed.prefix)
        raise
    return True


def pids_inside(name: str) -> list[int]:
    proc = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _stop_pids(pids: Sequence[int], grace_s: float = 5.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.05)


def destroy(prefix: str) -> bool:
    """Remove what the testbed recorded, newest first; False when there was nothing (idempotent)."""
    made = _made(prefix)
    if not made and not state_path(prefix).exists():
        return False
    for kind, name in reversed(made):
        if kind == "netns" and _exists(kind, name):
            _stop_pids(pids_inside(name))
            _run("ip", "netns", "del", name)
        elif kind == "link" and _exists(kind, name):
            _run("ip", "link", "del", name)  # a veth's peer goes with it
    state_path(prefix).unlink(missing_ok=True)
    return True


def require(prefix: str) -> Testbed:
    testbed = load(prefix)
    if testbed is None:
        raise TestbedError(f"no testbed {prefix!r}; run: python -m slurm.testbed.netns create N --prefix {prefix}")
    return testbed


def exec_argv(testbed: Testbed, index: int, argv: Sequence[str]) -> list[str]:
    """The command line that runs argv with host ``index``'s network (pair with :func:`host_env`)."""
    if not 0 <= index < testbed.hosts:
        raise TestbedError(f"host {index} is not in 0..{testbed.hosts - 1}", prefix=testbed.prefix)
    return ["nsenter", f"--net={NETNS_DIR / testbed.namespace(index)}", "--", *argv]


def host_env(environ: dict[str, str] | None = None, nic: int = 0) -> dict[str, str]:
    """Gloo picks its interface from the hostname otherwise, which names no namespace."""
    return {**(os.environ if environ is None else environ), "GLOO_SOCKET_IFNAME": INTERFACE.format(nic=nic)}


@contextlib.contextmanager
def inside(namespace: str | None) -> Iterator[None]:
    """Sockets created in this block belong to ``namespace`` (None: this one) and stay there after it."""
    if namespace is None:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)

    def enter(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise TestbedError(f"cannot enter {path}: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)

    own = f"/proc/self/task/{threading.get_native_id()}/ns/net"
    back = os.open(own, os.O_RDONLY)
    try:
        enter(str(NETNS_DIR / namespace))
        yield
    finally:
        libc.setns(back, CLONE_NEWNET)
        os.close(back)


def throughput(testbed: Testbed, source: int | None, target: int | None, nbytes: int, nic: int = 0) -> float:
    """Bits per second of one TCP stream from host ``source`` to ``target`` (None: the root namespace), to the
    target's ``nic``-th address (which the source reaches through its own ``nic``-th link)."""
    name = {i: testbed.namespace(i) for i in range(testbed.hosts)}
    address = testbed.bridge_address(nic) if target is None else testbed.address(target, nic)
    with inside(name.get(target)):
        server = socket.create_server((address, 0))
    with inside(name.get(source)):
        client = socket.socket()
    port = server.getsockname()[1]
    chunk = bytes(1 << 20)

    def send() -> None:
        with client:
            client.connect((address, port))
            left = nbytes
            while left > 0:
                left -= client.send(chunk[: min(left, len(chunk))])

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    with server:
        server.settimeout(30)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(60)
            received, start = 0, time.perf_counter()
            while data := conn.recv(1 << 20):
                received += len(data)
            elapsed = time.perf_counter() - start
    sender.join()
    if received != nbytes:
        raise TestbedError(f"received {received} of {nbytes} bytes", prefix=testbed.prefix)
    return received * 8 / elapsed


def _host(text: str) -> int | None:
    return None if text == "root" else int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m slurm.testbed.netns", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", default="hpcnet",
                        help="names: PREFIX0.., PREFIXbr, PREFIXv0.. (default %(default)s)")
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("create", help="make N hosts (no-op when they exist)")
    make.add_argument("hosts", type=int)
    make.add_argument("--rate", help="tc rate of every link, both directions, e.g. 1gbit (default: unlimited)")
    make.add_argument("--subnet", default="10.77.0", help="first three octets of the /24 (default %(default)s)")
    make.add_argument("--nics", type=int, default=1,
                      help="links a host, each shaped to the rate, NIC k on the subnet's third octet + k (default 1)")
    commands.add_parser("destroy", help="remove what create made (no-op when nothing)")
    commands.add_parser("show", help="print the testbed as JSON")
    run = commands.add_parser("exec", help="run a command in host I: exec I -- CMD...")
    run.add_argument("index", type=int)
    run.add_argument("--nic", type=int, default=0, help="GLOO_SOCKET_IFNAME=eth<NIC> (default 0)")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    measure = commands.add_parser("throughput", help="TCP throughput from host A to host B ('root': bridge)")
    measure.add_argument("source", type=_host)
    measure.add_argument("target", type=_host)
    measure.add_argument("--mbytes", type=int, default=128, help="bytes to send, in MiB (default %(default)s)")
    measure.add_argument("--nic", type=int, default=0, help="through each host's NIC k (default 0)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()

    def create_command(args: argparse.Namespace) -> None:
        testbed = Testbed(args.prefix, args.hosts, args.subnet, args.rate, args.nics)
        made = create(testbed)
        print(f"{'created' if made else 'already exists:'} {', '.join(testbed.names)} on {testbed.bridge}")

    def destroy_command(args: argparse.Namespace) -> None:
        print(f"destroyed {args.prefix}" if destroy(args.prefix) else f"no testbed {args.prefix}: nothing to do")

    def show_command(args: argparse.Namespace) -> None:
        print(json.dumps({"testbed": asdict(require(args.prefix)), "made": _made(args.prefix)}, indent=1))

    def exec_command(args: argparse.Namespace) -> None:
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not command:
            parser.error("exec needs a command: exec I -- CMD...")
        testbed = require(args.prefix)
        if not 0 <= args.nic < testbed.nics:
            raise TestbedError(f"NIC {args.nic} is not in 0..{testbed.nics - 1}", prefix=args.prefix)
        full = exec_argv(testbed, args.index, command)
        os.execvpe(full[0], full, host_env(nic=args.nic))

    def throughput_command(args: argparse.Namespace) -> None:
        testbed = require(args.prefix)
        bits = throughput(testbed, args.source, args.target, args.mbytes << 20, args.nic)
        ends = ["root" if end is None else testbed.namespace(end) for end in (args.source, args.target)]
        print(f"{bits / 1e6:.0f} Mbit/s from {ends[0]} to {ends[1]} (rate {testbed.rate or 'unlimited'})")

    handlers = {"create": create_command, "destroy": destroy_command, "show": show_command, "exec": exec_command,
                "throughput": throughput_command}
    return run_command(parser, handlers, argv)


if __name__ == "__main__":
    sys.exit(main())
