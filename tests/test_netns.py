"""The namespace testbed (slurm/testbed/netns.py): made and removed exactly, hosts isolated, and the rate
limit measured with real TCP traffic in both directions, between hosts and towards the root namespace."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from slurm.testbed import netns

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(c) for c in ("ip", "tc", "nsenter")),
    reason="network namespaces need root, iproute2 and nsenter",
)

PREFIX = "hpctest"
SUBNET = "10.77.9"
RATE_BITS = 200_000_000


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm.testbed.netns", "--prefix", PREFIX, *argv],
                          capture_output=True, text=True, timeout=60)


def _links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(": ")[1].split("@")[0] for line in out.splitlines()}


def _namespaces() -> set[str]:
    return set(os.listdir(netns.NETNS_DIR)) if netns.NETNS_DIR.exists() else set()


@pytest.fixture
def testbed() -> Iterator[netns.Testbed]:
    """Two hosts at 200 Mbit/s: one second per 25 MB, far below what two shared cores move."""
    bed = netns.Testbed(PREFIX, 2, SUBNET, f"{RATE_BITS // 10**6}mbit")
    assert netns.create(bed)
    try:
        yield bed
    finally:
        netns.destroy(PREFIX)


def test_create_is_idempotent_and_destroy_removes_exactly_what_it_made(testbed) -> None:
    assert netns.create(testbed) is False
    assert {"hpctest0", "hpctest1"} <= _namespaces()
    assert {"hpctestbr", "hpctestv0", "hpctestv1"} <= _links()
    with pytest.raises(netns.TestbedError, match="destroy it first"):
        netns.create(netns.Testbed(PREFIX, 3, SUBNET, None))
    assert netns.destroy(PREFIX) is True
    assert not {n for n in _namespaces() | _links() if n.startswith(PREFIX)}
    assert not netns.state_path(PREFIX).exists()
    assert netns.destroy(PREFIX) is False


def test_names_in_use_are_refused_and_left_alone() -> None:
    foreign = f"{PREFIX}v1"
    subprocess.run(["ip", "link", "add", foreign, "type", "bridge"], check=True)
    try:
        with pytest.raises(netns.TestbedError, match=f"{foreign} already exist"):
            netns.create(netns.Testbed(PREFIX, 2, SUBNET, None))
        assert foreign in _links()
        assert not {n for n in _namespaces() | _links() if n.startswith(PREFIX)} - {foreign}
    finally:
        subprocess.run(["ip", "link", "del", foreign], check=True)
        netns.destroy(PREFIX)


def test_exec_runs_inside_the_host_with_its_gloo_interface(testbed) -> None:
    proc = _cli("exec", "1", "--", "sh", "-c", 'echo "$GLOO_SOCKET_IFNAME"; ip -o -4 addr show')
    assert proc.returncode == 0, proc.stderr
    ifname, *addresses = proc.stdout.splitlines()
    assert ifname == "eth0"
    assert sorted(line.split()[1] + " " + line.split()[3] for line in addresses) == ["eth0 10.77.9.2/24",
                                                                                      "lo 127.0.0.1/8"]


@pytest.mark.parametrize(("source", "target"), [(0, 1), (1, 0), (None, 0), (0, None)])
def test_rate_limit_holds_each_way(testbed, source, target) -> None:
    measured = netns.throughput(testbed, source, target, 25 * 10**6)
    # TCP/IP headers take ~4% of the wire; bursts of 64 KiB allow a little above over a second.
    assert 0.85 * RATE_BITS < measured < 1.02 * RATE_BITS


def test_each_nic_is_a_link_of_its_own() -> None:
    """Two NICs a host: a stream to each of the other host's addresses at once, each at the rate (one shared link
    would halve them), and ``exec --nic 1`` names the second interface to Gloo."""
    import threading

    bed = netns.Testbed(PREFIX, 2, SUBNET, f"{RATE_BITS // 10**6}mbit", nics=2)
    netns.create(bed)
    try:
        assert {"hpctestv0", "hpctestv0n1", "hpctestv1", "hpctestv1n1"} <= _links()
        measured: dict[int, float] = {}
        streams = [threading.Thread(target=lambda k=k: measured.__setitem__(k, netns.throughput(bed, 0, 1, 25 * 10**6,
                                                                                                  nic=k)))
                   for k in (0, 1)]
        for stream in streams:
            stream.start()
        for stream in streams:
            stream.join()
        assert all(0.85 * RATE_BITS < measured[k] < 1.02 * RATE_BITS for k in (0, 1)), measured
        proc = _cli("exec", "--nic", "1", "1", "--", "sh", "-c", 'echo "$GLOO_SOCKET_IFNAME"; ip -o -4 addr show eth1')
        assert proc.returncode == 0, proc.stderr
        ifname, address = proc.stdout.splitlines()
        assert ifname == "eth1" and "10.77.10.2/24" in address
    finally:
        netns.destroy(PREFIX)
    assert not {n for n in _namespaces() | _links() if n.startswith(PREFIX)}


def test_without_a_rate_the_link_is_not_shaped() -> None:
    bed = netns.Testbed(PREFIX, 2, SUBNET, None)
    netns.create(bed)
    try:
        assert netns.throughput(bed, 0, 1, 100 * 10**6) > 3 * RATE_BITS
    finally:
        netns.destroy(PREFIX)


@pytest.mark.parametrize(("argv", "message"), [
    (["create", "2", "--rate", "fast"], "rate 'fast' is not like 100mbit or 1gbit"),
    (["create", "2", "--subnet", "10.300.1"], "subnet '10.300.1' must be the first three octets"),
    (["exec", "0", "--", "true"], "no testbed 'hpctest'"),
    (["create", "2", "--nics", "0"], "NIC count 0 must be between 1 and 8"),
])
def test_bad_input_is_one_line(argv, message) -> None:
    proc = _cli(*argv)
    assert proc.returncode == 1
    assert proc.stderr.startswith("python -m slurm.testbed.netns: error: ") and message in proc.stderr
    assert proc.stderr.count("\n") == 1
