"""A real Slurm cluster on this machine, for tests, CI and ``make slurm-up``: no systemd, no cgroups.

``python -m slurm.testbed.cluster start [--nodes N] [--state DIR] [--rate 1gbit]``, then ``status``,
``env`` (the ``export SLURM_CONF=...`` that points clients at it) and ``stop``.

Every daemon runs in the foreground under our own Popen, so its PID is known exactly; PID
and kernel start time are recorded in ``STATE/cluster.json`` as each one starts, and ``stop``
signals only those processes (a recycled PID has another start time). In start order:

1. munged, as the munge user, with a key and socket of its own under STATE (generated
   on first start), so a system munged, or none, does not matter;
2. mariadbd, as mysql, on a private data directory, bound to 127.0.0.1 on a free port,
   with a fresh ``slurm_acct_db`` at every start: without accounting ``sacct`` fails and
   submitit's job states stay UNKNOWN;
3. slurmdbd, then the cluster is registered with ``sacctmgr``;
4. slurmctld in the root namespace;
5. slurmd: one for this host (``--nodes 1``), or one per node of a cluster of 2 to 8 nodes made of
   network namespaces (``slurm.testbed.netns``, subnet 10.77.1.0/24, controller on the bridge at
   10.77.1.254). Each node runs in its own UTS and mount namespace, with its own hostname,
   its own /etc/hosts and a private /tmp (PMIx directories collide otherwise).

Every node declares ``--gpus`` GPUs (4 by default) as the generic resource ``gpu``, backed by stand-in
device files ``STATE/dev/gpu0`` ... (gres.conf's ``File=``): character devices of a major number no
driver owns. slurmd only stats them (no cgroup enforces them), but refuses a plain file ("is not a valid
character or block device") and then sets no ``CUDA_VISIBLE_DEVICES``. With them, ``srun
--gpus-per-task``, ``--gpus-per-node`` and ``--gpu-bind`` give each task its ``CUDA_VISIBLE_DEVICES``,
``SLURM_STEP_GPUS`` and ``SLURMD_TRES_BIND`` as on a GPU node.

``start`` returns when ``sinfo`` shows every node idle. It is idempotent: on a running
cluster it says so and does nothing; after a stop it starts a fresh cluster in the same
directory (logs of the previous run are overwritten). ``stop`` cancels the jobs, stops the
daemons newest first (SIGTERM, SIGKILL after 10 s) and removes the namespaces.
Standard library only: it runs before anything else is installed and never imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import stat
import string
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from hpc.errors import HpcError
from hpc.rundir import write_json
from hpc.runtime.bootstrap import free_port
from slurm.testbed import netns, run_command

DEFAULT_STATE = Path("/tmp/hpc-slurm")
CHECKOUT = Path(__file__).resolve().parents[2]
CLUSTER_NAME = "hpc"
CPUS_PER_NODE = 8
GPUS_PER_NODE = 4  # stand-ins: see the module docs
# Character devices of a major number Linux leaves to local, experimental use (no driver: opening one
# fails with ENXIO); slurmd refuses a gres.conf File= that is a plain file.
STAND_IN_GPU_MAJOR = 240
CRED_EXPIRE_S = 5
NODE_PREFIX = "hpcnode"
NODE_SUBNET = "10.77.1"
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
# Subdirectories start wipes; the munge key and the database files (slow to make) are kept.
MAX_NODES = 8  # namespace nodes; each declares the same CPUs, so more only slices 2 cores thinner
OWNED = ("etc", "run", "log", "munge", "ctld", "spool", "nodes", "dev")

# The command each daemon needs, and the Debian package that brings it.
COMMANDS = {
    "munged": "munge",
    "mariadbd": "mariadb-server",
    "mariadb-install-db": "mariadb-server",
    "slurmdbd": "slurmdbd",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "sacctmgr": "slurm-client",
    "sinfo": "slurm-client",
    "setpriv": "util-linux",
    "nsenter": "util-linux",
    "tc": "iproute2",
}

SLURM_CONF = string.Template("""\
# Written by `python -m slurm.testbed.cluster start`; rewritten at every start.
ClusterName=$cluster
SlurmctldHost=$ctld_host($ctld_addr)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
# Our own munged. A short credential lifetime lets a requeued job start again within
# seconds instead of about two minutes.
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$munge_socket,cred_expire=$cred_expire
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool/%n
SlurmctldPidFile=$state/run/slurmctld.pid
SlurmdPidFile=$state/run/slurmd-%n.pid
SlurmdLogFile=$state/log/slurmd-%n.log
# No cgroups, no systemd.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Debian's Open MPI starts under srun only through PMIx (pmi2 and none fail).
MpiDefault=pmix
# Schedule within a second (the defaults wait up to a minute).
SchedulerParameters=bf_interval=1,sched_interval=1
# A task that outlives SIGTERM (a hung rank: its handler only records the signal) gets SIGKILL 5 s later, not
# Slurm's default 30: each restart after a hang waits this long for the step to end.
KillWait=5
# Reject impossible requests at submission instead of leaving them pending.
EnforcePartLimits=ALL
ReturnToService=2
# Nodes declare $cpus CPUs whatever this machine has, so that 8 tasks fit.
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$ctld_addr
AccountingStoragePort=$dbd_port
# With slurmdbd this "password" is the munge socket used to talk to it.
AccountingStoragePass=$munge_socket
JobCompType=jobcomp/none
MailProg=/bin/true
# GPUs as generic resources, backed by the stand-in files of gres.conf.
GresTypes=gpu
$node_lines
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

SLURMDBD_CONF = string.Template("""\
# Written by `python -m slurm.testbed.cluster start`; rewritten at every start.
AuthType=auth/munge
AuthInfo=socket=$munge_socket
DbdHost=localhost
DbdAddr=$ctld_addr
DbdPort=$dbd_port
SlurmUser=root
PidFile=$state/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$db_port
StorageUser=slurm
StoragePass=$db_password
StorageLoc=slurm_acct_db
""")


class ClusterError(HpcError):
    """A daemon of the local cluster could not be started, reached or stopped."""


@dataclass(frozen=True)
class Daemon:
    """A process we started: ``ticks`` is its kernel start time, so a recycled PID is never ours."""

    name: str
    pid: int
    ticks: int
    log: str

    def alive(self) -> bool:
        return _start_ticks(self.pid) == self.ticks


@dataclass(frozen=True)
class Layout:
    """Where everything of one cluster lives; all paths derive from the state directory."""

    state: Path

    @property
    def record(self) -> Path:
        return self.state / "cluster.json"

    @property
    def slurm_conf(self) -> Path:
        return self.state / "etc" / "slurm.conf"

    @property
    def gres_conf(self) -> Path:
        return self.state / "etc" / "gres.conf"

    def gpu_file(self, index: int) -> Path:
        """The stand-in device file of GPU ``index`` (every node shares them: see the module docs)."""
        return self.state / "dev" / f"gpu{index}"

    @property
    def munge_socket(self) -> Path:
        return self.state / "munge" / "munge.socket"

    @property
    def db_dir(self) -> Path:
        return self.state / "mysql"

    @property
    def db_socket(self) -> Path:
        return self.state / "run" / "mariadb" / "mariadb.sock"

    def output(self, name: str) -> Path:
        """A daemon's stdout and stderr (in the foreground, Slurm daemons copy their log there)."""
        return self.state / "log" / f"{name}.out"


def unavailable() -> str | None:
    """Why this machine cannot run the cluster, or None when it can."""
    if os.geteuid() != 0:
        return "the local cluster needs root (daemons switch users, namespaces need CAP_SYS_ADMIN)"
    missing = {cmd: pkg for cmd, pkg in COMMANDS.items() if shutil.which(cmd) is None}
    if missing:
        packages = " ".join(sorted(set(missing.values())))
        return f"missing {', '.join(missing)}; install them with: apt-get install {packages}"
    return None


def client_env(state: Path = DEFAULT_STATE) -> dict[str, str]:
    """What a client (sbatch, srun, sacct, submitit) needs in its environment to use this cluster.

    Open MPI busy-polls under srun when more CPUs are declared than exist; yielding when
    idle makes small messages 10x faster.
    """
    return {"SLURM_CONF": str(Layout(state.resolve()).slurm_conf), "OMPI_MCA_mpi_yield_when_idle": "1"}


def _start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] == "Z" else int(fields[19])


def read_record(state: Path = DEFAULT_STATE) -> dict | None:
    """What start recorded: ``nodes``, ``node_names``, ``rate``, ``netns`` and ``daemons``; None when stopped."""
    record = Layout(state.resolve()).record
    return json.loads(record.read_text()) if record.exists() else None


def daemons(record: dict) -> list[Daemon]:
    return [Daemon(**d) for d in record["daemons"]]


def _run(argv: Sequence[str], env: dict[str, str] | None = None, input_text: str | None = None) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, input=input_text)
    if proc.returncode != 0:
        raise ClusterError(f"{shlex.join(argv)} failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def _succeeds(argv: Sequence[str], env: dict[str, str] | None = None) -> bool:
    return subprocess.run(argv, capture_output=True, env=env).returncode == 0


def _listening(addr: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((addr, port), timeout=1):
        return True
    return False


def _log_tail(path: str, lines: int = 8) -> str:
    try:
        tail = Path(path).read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "(no log)"
    return "\n  ".join(tail) or "(empty log)"


def _check_reachable(state: Path) -> None:
    """munged and mariadbd run as their own users, so every directory above STATE must let them pass."""
    for parent in state.parents:
        if parent.exists() and not parent.stat().st_mode & 0o001:
            raise ClusterError(
                f"{parent} is not searchable by other users (mode {parent.stat().st_mode & 0o777:o}); "
                "munged and mariadbd run as munge and mysql: choose a state directory they can reach",
                state=state,
            )


class Starter:
    """Starts daemons one by one, recording each as soon as it exists, so a failure can be undone."""

    def __init__(self, layout: Layout, record: dict) -> None:
        self.layout = layout
        self.record = record
        self.env = {**os.environ, "SLURM_CONF": str(layout.slurm_conf)}

    def spawn(self, name: str, argv: Sequence[str]) -> Daemon:
        log = self.layout.output(name)
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=self.env, start_new_session=True)
        ticks = _start_ticks(proc.pid)  # Popen returns once the program runs, so /proc/PID is there
        if ticks is None:
            raise ClusterError(f"{name} exited at once (code {proc.poll()}):\n  {_log_tail(str(log))}")
        daemon = Daemon(name, proc.pid, ticks, str(log))
        self.record["daemons"].append(asdict(daemon))
        write_json(self.layout.record, self.record)
        return daemon

    def wait(self, daemon: Daemon, what: str, ready: Callable[[], bool], timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if not daemon.alive():
                raise ClusterError(f"{daemon.name} died before {what}; its log {daemon.log} ends:\n  "
                                   f"{_log_tail(daemon.log)}")
            if time.monotonic() > deadline:
                raise ClusterError(f"{daemon.name} not {what} after {timeout_s:g} s; its log {daemon.log} ends:\n  "
                                   f"{_log_tail(daemon.log)}")
            time.sleep(0.1)


def _prepare_dirs(layout: Layout) -> None:
    for sub in OWNED:
        shutil.rmtree(layout.state / sub, ignore_errors=True)
    for sub in ("etc", "run", "log", "munge", "ctld", "spool", "dev"):
        (layout.state / sub).mkdir(parents=True)
    layout.state.chmod(0o755)
    (layout.state / "munge").chmod(0o755)  # munged wants its socket's directory searchable by all
    shutil.chown(layout.state / "munge", "munge", "munge")
    db_run = layout.db_socket.parent
    db_run.mkdir()
    shutil.chown(db_run, "mysql", "mysql")


def _start_munge(starter: Starter, key: Path) -> None:
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True)
        _run(["mungekey", "--create", f"--keyfile={key}"])
    shutil.chown(key, "munge", "munge")
    key.chmod(0o600)
    munge_dir = starter.layout.munge_socket.parent
    daemon = starter.spawn("munged", [
        "setpriv", "--reuid=munge", "--regid=munge", "--init-groups", "munged", "--foreground",
        f"--socket={starter.layout.munge_socket}", f"--key-file={key}", f"--pid-file={munge_dir / 'munged.pid'}",
        f"--seed-file={munge_dir / 'munged.seed'}", f"--log-file={munge_dir / 'munged.log'}",
    ])
    probe = ["munge", "-n", "-S", str(starter.layout.munge_socket)]
    starter.wait(daemon, "accepting credentials", lambda: _succeeds(probe))


def _start_mariadb(starter: Starter, port: int, password: str) -> None:
    layout = starter.layout
    if not (layout.db_dir / "mysql").is_dir():
        shutil.rmtree(layout.db_dir, ignore_errors=True)
        _run(["mariadb-install-db", "--no-defaults", f"--datadir={layout.db_dir}", "--user=mysql",
              "--auth-root-authentication-method=socket", "--skip-test-db", "--skip-name-resolve"])
    daemon = starter.spawn("mariadbd", [
        "mariadbd", "--no-defaults", f"--datadir={layout.db_dir}", "--user=mysql", f"--socket={layout.db_socket}",
        "--bind-address=127.0.0.1", f"--port={port}", "--skip-name-resolve", "--innodb-buffer-pool-size=32M",
        "--innodb-lock-wait-timeout=900",
        f"--pid-file={layout.db_socket.with_suffix('.pid')}",
    ])
    socket_arg = f"--socket={layout.db_socket}"
    starter.wait(daemon, "answering", lambda: _succeeds(["mariadb-admin", socket_arg, "ping"]))
    _run(["mariadb", socket_arg], input_text=(
        "DROP DATABASE IF EXISTS slurm_acct_db; CREATE DATABASE slurm_acct_db;"
        "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1';"
        f"ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';"
        "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
    ))


def _node_files(layout: Layout, testbed: netns.Testbed, controller: str) -> None:
    """Each node's /etc/hosts names every node and the controller by their bridge addresses."""
    hosts = ["127.0.0.1 localhost", *(f"{testbed.address(i)} {n}" for i, n in enumerate(testbed.names)),
             f"{testbed.bridge_address()} {controller}"]
    for name in testbed.names:
        node_dir = layout.state / "nodes" / name
        (node_dir / "tmp").mkdir(parents=True)
        (node_dir / "tmp").chmod(0o1777)
        (node_dir / "hosts").write_text("\n".join(hosts) + "\n")


def _node_argv(layout: Layout, testbed: netns.Testbed, index: int) -> list[str]:
    """slurmd for one namespace node: own hostname, own /etc/hosts, private /tmp.

    When STATE (configuration, spool, sockets) or this checkout (the code every task
    imports: a fresh clone under /tmp in CI) lives under /tmp, the private /tmp would
    hide it, so it is first bound into the node's /tmp at the same place and the node's
    /tmp is bound recursively over /tmp.
    """
    name = testbed.namespace(index)
    node_dir = layout.state / "nodes" / name
    private_tmp = node_dir / "tmp"
    script = [f"hostname {name}", f"mount --bind {shlex.quote(str(node_dir / 'hosts'))} /etc/hosts"]
    for shared in dict.fromkeys((layout.state, CHECKOUT)):
        if shared.is_relative_to("/tmp"):
            inner = private_tmp / shared.relative_to("/tmp")
            inner.mkdir(parents=True, exist_ok=True)
            script.append(f"mount --bind {shlex.quote(str(shared))} {shlex.quote(str(inner))}")
    script += [f"mount --rbind {shlex.quote(str(private_tmp))} /tmp", f"exec slurmd -D -N {name}"]
    inner_argv = ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-ec", "; ".join(script)]
    return netns.exec_argv(testbed, index, inner_argv)


def _nodes_idle(env: dict[str, str], count: int) -> bool:
    proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, env=env)
    states = [line.split()[1] for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode == 0 and len(states) == count and all(s == "idle" for s in states)


def start(state: Path = DEFAULT_STATE, nodes: int = 1, rate: str | None = None, gpus: int = GPUS_PER_NODE) -> bool:
    """Start the cluster (``gpus`` stand-in GPUs per node) and wait until every node is idle; False when it
    was already running."""
    reason = unavailable()
    if reason:
        raise ClusterError(reason)
    if not 1 <= nodes <= MAX_NODES:
        raise ClusterError(f"--nodes must be 1 to {MAX_NODES}, got {nodes}")
    if gpus < 0:
        raise ClusterError(f"--gpus must be 0 or more, got {gpus}")
    layout = Layout(state.resolve())
    record = read_record(layout.state)
    if record is not None:
        if all(d.alive() for d in daemons(record)):
            running = (record["nodes"], record["rate"], record.get("gpus", 0))
            if running != (nodes, rate, gpus):
                raise ClusterError(f"a cluster with {running[0]} node(s), rate {running[1]}, {running[2]} GPU(s) "
                                   "per node is running; stop it first", state=layout.state)
            return False
        stop(layout.state)
    _check_reachable(layout.state)
    layout.state.mkdir(parents=True, exist_ok=True)
    _prepare_dirs(layout)
    record = {"nodes": nodes, "node_names": [], "rate": rate, "gpus": gpus, "netns": None, "daemons": []}
    write_json(layout.record, record)
    starter = Starter(layout, record)
    try:
        _start_all(starter, nodes, rate, gpus)
    except BaseException:
        stop(layout.state)
        raise
    return True


def _write_gres(layout: Layout, gpus: int) -> str:
    """gres.conf and the stand-in device files; returns the ``Gres=`` of every node's line (empty: no GPUs)."""
    files = [layout.gpu_file(i) for i in range(gpus)]
    for index, path in enumerate(files):
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(STAND_IN_GPU_MAJOR, index))
    lines = [f"Name=gpu File={path}" for path in files]
    layout.gres_conf.write_text("# Written by `python -m slurm.testbed.cluster start`: stand-in GPUs.\n"
                                + "".join(f"{line}\n" for line in lines))
    return f" Gres=gpu:{gpus}" if gpus else ""


def _start_all(starter: Starter, nodes: int, rate: str | None, gpus: int) -> None:
    layout = starter.layout
    ports: dict[str, int] = {}
    for name in ("db_port", "dbd_port", "ctld_port", "slurmd_port"):
        while (port := free_port()) in ports.values():  # each free now, and none twice
            pass
        ports[name] = port
    controller = socket.gethostname().split(".")[0]
    testbed = netns.Testbed(NODE_PREFIX, nodes, NODE_SUBNET, rate) if nodes > 1 else None
    ctld_addr = testbed.bridge_address() if testbed else "127.0.0.1"
    if testbed is None:
        addresses = {controller: "127.0.0.1"}
    else:
        addresses = {name: testbed.address(i) for i, name in enumerate(testbed.names)}
    gres = _write_gres(layout, gpus)
    node_lines = "\n".join(f"NodeName={name} NodeAddr={addr} CPUs={CPUS_PER_NODE}{gres} State=UNKNOWN"
                           for name, addr in addresses.items())
    starter.record["node_names"] = list(addresses)
    values = {**ports, "state": layout.state, "cluster": CLUSTER_NAME, "ctld_host": controller,
              "ctld_addr": ctld_addr, "munge_socket": layout.munge_socket, "cred_expire": CRED_EXPIRE_S,
              "cpus": CPUS_PER_NODE, "node_lines": node_lines, "db_password": secrets.token_hex(16)}
    layout.slurm_conf.write_text(SLURM_CONF.substitute(values))
    dbd_conf = layout.slurm_conf.with_name("slurmdbd.conf")
    dbd_conf.touch(mode=0o600)  # holds the database password
    dbd_conf.write_text(SLURMDBD_CONF.substitute(values))

    if testbed is not None:
        if not netns.create(testbed):
            raise ClusterError(f"namespaces {', '.join(testbed.names)} already exist: is another multi-node "
                               "cluster running? stop it first", prefix=NODE_PREFIX)
        starter.record["netns"] = NODE_PREFIX
        write_json(layout.record, starter.record)
        _node_files(layout, testbed, controller)
    _start_munge(starter, layout.state / "munge-key" / "munge.key")
    _start_mariadb(starter, ports["db_port"], values["db_password"])
    dbd = starter.spawn("slurmdbd", ["slurmdbd", "-D"])
    starter.wait(dbd, "listening", lambda: _listening(ctld_addr, ports["dbd_port"]))
    _run(["sacctmgr", "-i", "add", "cluster", CLUSTER_NAME], env=starter.env)
    ctld = starter.spawn("slurmctld", ["slurmctld", "-D", "-c"])
    starter.wait(ctld, "answering", lambda: _succeeds(["scontrol", "ping"], env=starter.env))
    if testbed is None:
        slurmds = [starter.spawn(f"slurmd-{controller}", ["slurmd", "-D"])]
    else:
        slurmds = [starter.spawn(f"slurmd-{name}", _node_argv(layout, testbed, i))
                   for i, name in enumerate(testbed.names)]
    for slurmd in slurmds:
        starter.wait(slurmd, "idle in sinfo", lambda: _nodes_idle(starter.env, nodes))


def _cancel_jobs(env: dict[str, str]) -> None:
    """Jobs end before the daemons, or their steps outlive slurmd in the root namespace."""
    proc = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True, env=env)
    jobs = proc.stdout.split() if proc.returncode == 0 else []
    if not jobs:
        return
    subprocess.run(["scancel", *jobs], capture_output=True, env=env)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        proc = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not proc.stdout.split():
            return
        time.sleep(0.2)


def _terminate(daemon: Daemon) -> None:
    if not daemon.alive():
        return
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(daemon.pid, sig)
        deadline = time.monotonic() + grace
        while daemon.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not daemon.alive():
            return
    raise ClusterError(f"{daemon.name} (pid {daemon.pid}) survived SIGKILL")


def stop(state: Path = DEFAULT_STATE) -> bool:
    """Stop what start recorded, newest first; False when nothing was recorded (idempotent)."""
    layout = Layout(state.resolve())
    record = read_record(layout.state)
    if record is None:
        return False
    recorded = daemons(record)
    if any(d.name == "slurmctld" and d.alive() for d in recorded):
        _cancel_jobs({**os.environ, "SLURM_CONF": str(layout.slurm_conf)})
    for daemon in reversed(recorded):
        _terminate(daemon)
    if record["netns"]:
        netns.destroy(record["netns"])
    layout.record.unlink()
    return True


def status(state: Path = DEFAULT_STATE) -> tuple[bool, str]:
    """(running, a report: each daemon and, when the controller runs, sinfo)."""
    layout = Layout(state.resolve())
    record = read_record(layout.state)
    if record is None:
        return False, f"no cluster in {layout.state}"
    recorded = daemons(record)
    running = all(d.alive() for d in recorded)
    lines = [f"{record['nodes']}-node cluster in {layout.state}: {'running' if running else 'NOT running'}"]
    lines += [f"  {d.name:<18} pid {d.pid:<8} {'up' if d.alive() else 'DEAD'}  {d.log}" for d in recorded]
    if running:
        lines.append(_run(["sinfo", "-N"], env={**os.environ, "SLURM_CONF": str(layout.slurm_conf)}).rstrip())
    return running, "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m slurm.testbed.cluster", description=__doc__.split("\n\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state", type=Path, default=DEFAULT_STATE, help="state directory (default %(default)s)")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("start", parents=[common], help="start the cluster (no-op when running)")
    up.add_argument("--nodes", type=int, choices=range(1, MAX_NODES + 1), default=1, metavar="N",
                    help=f"1: this host; 2 to {MAX_NODES}: namespace nodes (default 1)")
    up.add_argument("--rate", help="several nodes: tc rate of each node's link, e.g. 1gbit (default: unlimited)")
    up.add_argument("--gpus", type=int, default=GPUS_PER_NODE,
                    help="stand-in GPUs per node, generic resource gpu (default %(default)s; 0: none)")
    commands.add_parser("stop", parents=[common], help="stop every daemon started (no-op when stopped)")
    commands.add_parser("status", parents=[common], help="daemons and sinfo; exit status 3 when not running")
    commands.add_parser("env", parents=[common], help="print the exports clients need: eval $(... env)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()

    def start_command(args: argparse.Namespace) -> None:
        if args.rate and args.nodes == 1:
            parser.error("--rate needs --nodes 2 or more (a single node has no links)")
        began = time.monotonic()
        if start(args.state, args.nodes, args.rate, args.gpus):
            print(f"started a {args.nodes}-node cluster in {args.state} ({time.monotonic() - began:.1f} s); "
                  f"use it with: eval $(python -m slurm.testbed.cluster env --state {args.state})")
        else:
            print(f"already running in {args.state}: nothing to do")

    def stop_command(args: argparse.Namespace) -> None:
        stopped = stop(args.state)
        print(f"stopped the cluster in {args.state}" if stopped else f"no cluster in {args.state}: nothing to do")

    def status_command(args: argparse.Namespace) -> int:
        running, report = status(args.state)
        print(report)
        return 0 if running else 3

    def env_command(args: argparse.Namespace) -> None:
        print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in client_env(args.state).items()))

    handlers = {"start": start_command, "stop": stop_command, "status": status_command, "env": env_command}
    return run_command(parser, handlers, argv)


if __name__ == "__main__":
    sys.exit(main())
