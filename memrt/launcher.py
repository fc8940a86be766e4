"""Which launcher started this process, and this process's place in the job.

Discovery reads the environment only (no process group is started). One launcher's variables are
taken whole, never mixed: torchrun first (its ``RANK`` wins inside a SLURM allocation), then Open MPI,
MVAPICH, MPICH/Intel MPI (PMI), SLURM srun, else a single process.

An MPI launch without ``MASTER_ADDR`` reaches torch.distributed through :func:`mpi_rendezvous`, which
broadcasts rank 0's address and a free port over mpi4py; an srun step through :func:`slurm_master` (the
first host of the step's node list, a port every rank derives from the job id).
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import asdict, dataclass
from typing import Mapping
from urllib.parse import urlparse

from memrt.config import environ
from memrt.errors import ConfigError

__all__ = ["LaunchInfo", "attempt_prefix", "discover_launch", "first_host", "free_port", "import_mpi4py",
           "master_address", "mpi_rendezvous", "pid_alive", "slurm_master"]


@dataclass(frozen=True, slots=True)
class LaunchInfo:
    """This process's place in the job, as its launcher described it."""

    launcher: str
    """'torchrun', 'openmpi', 'mvapich', 'mpich', 'slurm' or 'single'."""
    rank: int
    """Global rank, 0..world_size-1."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank among the processes on this node."""
    local_world_size: int
    """Number of processes on this node."""
    master_addr: str | None = None
    """Rendezvous address from MASTER_ADDR, if the launcher set one."""
    master_port: int | None = None
    """Rendezvous port from MASTER_PORT, if set."""

    @property
    def is_mpi(self) -> bool:
        return self.launcher in ("openmpi", "mvapich", "mpich")

    def to_dict(self) -> dict:
        return asdict(self)


# launcher -> (rank, world size, local rank, local world size) variable names; None = not provided.
_SOURCES: tuple[tuple[str, tuple[str, str, str | None, str | None]], ...] = (
    ("torchrun", ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")),
    ("openmpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")),
    ("mvapich", ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE")),
    ("mpich", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")),
    ("slurm", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")),
)


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(name, raw, "a non-negative integer (set by the launcher)") from None
    if value < 0:
        raise ConfigError(name, raw, "a non-negative integer (set by the launcher)")
    return value


def _slurm_local_size(env: Mapping[str, str]) -> int | None:
    # SLURM_TASKS_PER_NODE looks like "2(x3),1": this node's count is not knowable without the node
    # index, so prefer SLURM_NTASKS_PER_NODE when uniform, else SLURM_STEP_TASKS_PER_NODE per SLURM_NODEID.
    for name in ("SLURM_NTASKS_PER_NODE",):
        if name in env and env[name].strip().isdigit():
            return int(env[name])
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if spec is None:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if "(x" in part:
            n, rep = part.rstrip(")").split("(x")
            counts += [int(n)] * int(rep)
        elif part.isdigit():
            counts.append(int(part))
    node = int(env.get("SLURM_NODEID", "0") or 0)
    return counts[node] if node < len(counts) else None


def discover_launch(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Rank, world size, local rank/size and launcher name from ``env`` (default: the process's)."""
    env = environ() if env is None else env
    for launcher, (r, w, lr, lw) in _SOURCES:
        if r not in env or w not in env:
            continue
        rank, world = _int(env, r), _int(env, w)
        if world < 1 or rank >= world:
            raise ConfigError(r, env[r], f"a rank below {w}={env[w]}")
        local_rank = _int(env, lr) if lr and lr in env else (rank if world == 1 else 0)
        if launcher == "slurm":
            local_world = _slurm_local_size(env)
        else:
            local_world = _int(env, lw) if lw and lw in env else None
        if local_world is None:
            local_world = world if launcher != "slurm" or world == 1 else max(local_rank + 1, 1)
        if local_rank >= local_world:
            raise ConfigError(lr or r, env.get(lr or r), f"a local rank below the local world size {local_world}")
        port = env.get("MASTER_PORT")
        return LaunchInfo(
            launcher=launcher,
            rank=rank,
            world_size=world,
            local_rank=local_rank,
            local_world_size=local_world,
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=int(port) if port and port.isdigit() else None,
        )
    return LaunchInfo(launcher="single", rank=0, world_size=1, local_rank=0, local_world_size=1,
                      master_addr=env.get("MASTER_ADDR") or None,
                      master_port=int(env["MASTER_PORT"]) if env.get("MASTER_PORT", "").isdigit() else None)


def import_mpi4py():
    """mpi4py's MPI module, or an ImportError that says how to install it."""
    try:
        from mpi4py import MPI  # noqa: PLC0415 - optional dependency, imported lazily
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "memrt's MPI support needs mpi4py and an MPI library: pip install \"memrt[mpi]\" mpich "
            f"(or use a system MPI such as Open MPI) — {exc}"
        ) from exc
    return MPI


def _routable_address() -> str:
    """This host's address as peers would reach it (no traffic is sent)."""
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        addr = "127.0.0.1"
    return addr


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port free on ``addr`` now (the kernel's pick): the project's one rule for rendezvous ports."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr if addr != "0.0.0.0" else "", 0))
        return s.getsockname()[1]


SLURM_PORT_BASE = 20000
"""srun steps without MASTER_PORT use 20000 + (job id mod 20000): the same on every rank, rarely shared by two jobs."""


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``gpu[07-09,12],cpu1`` -> ``gpu07``."""
    m = re.match(r"\s*([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        raise ValueError(f"cannot read a host from SLURM node list {nodelist!r}")
    prefix, ranges = m.group(1).strip(), m.group(2)
    if not ranges:
        return prefix
    return prefix + re.split(r"[-,]", ranges)[0]


def slurm_master(env: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """(MASTER_ADDR, MASTER_PORT) of an srun step: the first host of its node list and ``MASTER_PORT`` when
    set, else a port from the job id. None when SLURM's variables do not say (no node list or no job id)."""
    env = environ() if env is None else env
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or ""
    port = env.get("MASTER_PORT", "")
    if not nodes or not (port.isdigit() or job.isdigit()):
        return None
    return first_host(nodes), int(port) if port.isdigit() else SLURM_PORT_BASE + int(job) % 20000


def mpi_rendezvous(addr: str | None = None) -> str:
    """An ``init_method`` URL for torch.distributed agreed over MPI: rank 0's address and a free port.

    Every rank of the MPI job must call it (it is a collective over COMM_WORLD).
    """
    MPI = import_mpi4py()
    comm = MPI.COMM_WORLD
    url = None
    if comm.Get_rank() == 0:
        host = addr or _routable_address()
        url = f"tcp://{host}:{free_port(host)}"
    return comm.bcast(url, root=0)


def _mpi_world_is(world: int) -> bool:
    try:
        return import_mpi4py().COMM_WORLD.Get_size() == world
    except Exception:  # noqa: BLE001 - no usable MPI under this srun
        return False


def master_address(launch: LaunchInfo, env: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """(MASTER_ADDR, MASTER_PORT) for a job whose launcher did not set them; None when it did.

    ``launch`` is :func:`discover_launch`'s (``env``: SLURM's variables, default the process's). torchrun,
    or ``MASTER_ADDR`` and ``MASTER_PORT`` both set: None (torch's ``env://`` reads them). MPI
    launchers, and srun over an MPI whose world is the step's: rank 0's address and a free port agreed over
    mpi4py (collective: every rank calls it). srun otherwise: :func:`slurm_master`, or a ConfigError naming
    MASTER_ADDR when SLURM's variables do not say. A single process: loopback and a free port.
    """
    if launch.launcher == "torchrun" or (launch.master_addr and launch.master_port):
        return None
    if launch.is_mpi or (launch.launcher == "slurm" and _mpi_world_is(launch.world_size)):
        url = urlparse(mpi_rendezvous())
        return url.hostname or "127.0.0.1", int(url.port)
    if launch.launcher == "slurm":
        found = slurm_master(env)  # reads the environment when env is None
        if found is None:
            raise ConfigError("MASTER_ADDR", None, "the rendezvous host: srun did not set SLURM_*NODELIST and "
                                                   "SLURM_JOB_ID; export MASTER_ADDR and MASTER_PORT")
        return found
    return "127.0.0.1", free_port()


def pid_alive(pid: int) -> bool:
    """True when a process ``pid`` exists on this host (or may: another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def attempt_prefix(env: Mapping[str, str] | None = None) -> str:
    """The store-key prefix of this launch attempt: ``""`` on the first, ``"attempt<N>/"`` after torchrun
    restarted the workers N times (``TORCHELASTIC_RESTART_COUNT``).

    torchrun's agent keeps one key-value store across restarts, and a process group's keys do not name the
    attempt: the keys a dead attempt wrote stay, and a restarted gloo rank may read a dead peer's address
    (then fail to connect, or connect to whatever now listens on that port). memrt's groups and exchanges put
    their keys under this prefix, so each attempt starts from an empty key space."""
    env = environ() if env is None else env
    count = env.get("TORCHELASTIC_RESTART_COUNT", "0").strip()
    return "" if count in ("", "0") else f"attempt{count}/"
