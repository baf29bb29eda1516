"""Which cores each process runs on: every choice of cores, and its edge cases, in one place.

A core here is a Linux CPU id (a logical CPU: each hyperthread is one). The cores a process may
use are its affinity (`available_cores`: what `taskset`, a container's cpuset or the node's
`ray start` gave it), never the machine's count. A core list (`0-3,8-11`: `parse_core_list`,
`format_core_list`) such as `vllm-aot serve --cores` names some of them; a core outside the
affinity is refused, naming the allowed ones (`requested_cores`).

Topology (`Topology`, from /sys/devices/system/cpu: no lscpu): each CPU's socket and its
hyperthread siblings. Every split hands out physical cores (a CPU with its siblings among the
cores given) whole, in socket order, so a group stays on one socket where the sizes allow and two
groups never share a core's execution units (`Topology.units`). Where there are fewer physical
cores than groups, or a group of whole cores would have fewer CPUs than it needs, the split hands
out CPUs instead, siblings apart (one core with two hyperthreads, TP=2: a hyperthread each).

The splits, each of equal, contiguous groups (`split`); what an uneven split leaves stays unused,
so every group runs as many threads:

- replicas (`replica_groups`, `vllm-aot serve --data-parallel-size D --tensor-parallel-size T`):
  D groups of at least T CPUs each, else refused before anything starts;
- tensor-parallel ranks (`rank_cores`: vLLM's workers, `runtime/ranks.py`'s processes): a
  machine's cores among the ranks there, by local rank. Fewer cores than ranks: serving refuses
  it at start-up (`shared_cores_problem`: ranks sharing cores wait in every collective for one
  another's descheduled threads; SmolLM2 at TP=3 on 2 cores served 2 s a token). Where that is
  not known early (Ray places its ranks once the engine runs) and in the tools that check
  outputs rather than serve (`validate`, `tensors`, `demo`, tests), rank i runs on core i mod n,
  one thread each;
- the front end (`split_front_end`): `VLLM_CPU_NUM_OF_RESERVED_CPU` (vLLM's CPU backend's knob,
  with its meaning: CPUs kept from the model's threads for everything else) takes the last
  physical cores holding at least that many CPUs, or the last CPUs where whole cores would leave
  none to compute on; none when even that leaves none (a warning: the front end shares them).
  Unset, one from `MIN_CORES_TO_RESERVE` cores on where the front end is lowered
  (`plugin/front_end.py`, as `vllm-aot serve` has it), else none: a library user's process is
  not pinned unless asked.

Applying a choice: `pin_process`, `pin_threads`, and `thread_env` for a child's OpenMP threads.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"  # vLLM's own name and meaning (its CPU backend)
# Below this many cores the front end shares them with the step's threads (at its nice value);
# from here on one is its own: a core is worth the front end's share of the work only where it
# is a small share of the cores (docs/benchmarks.md#front-end-core).
MIN_CORES_TO_RESERVE = 8
SYS_CPUS = Path("/sys/devices/system/cpu")
_UNKNOWN = sys.maxsize  # the socket of a CPU the topology does not know: after every known one

Cores = tuple[int, ...]


def parse_core_list(text: str) -> Cores:
    """`"0-3,8,10-11"` -> (0, 1, 2, 3, 8, 10, 11), sorted; refuses duplicates and bad ranges."""
    cores: list[int] = []
    for part in text.replace(" ", "").strip().split(","):
        if not part:
            continue
        first, sep, last = part.partition("-")
        try:
            low, high = int(first), int(last) if sep else int(first)
        except ValueError:
            raise ValueError(
                f"bad core list {text!r}: {part!r} is not a core id or a range like 0-3"
            ) from None
        if low < 0 or high < low:
            raise ValueError(
                f"bad core list {text!r}: {part!r} is not a range low-high, low <= high"
            )
        cores.extend(range(low, high + 1))
    if not cores:
        raise ValueError(f"bad core list {text!r}: no cores")
    duplicates = sorted({c for c in cores if cores.count(c) > 1})
    if duplicates:
        raise ValueError(f"bad core list {text!r}: cores {duplicates} listed more than once")
    return tuple(sorted(cores))


def format_core_list(cores: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8) -> "0-3,8": the compact form `parse_core_list` reads back."""
    ranges: list[list[int]] = []
    for core in sorted(cores):
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in ranges)


def available_cores() -> Cores:
    """The cores this process may run on (its affinity, not the machine's core count)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def requested_cores(text: str | None, allowed: Collection[int] | None = None) -> Cores:
    """The cores a core list names (`allowed`, by default `available_cores()`, when `text` is
    empty); ValueError when it is malformed or names a core outside `allowed`."""
    allowed = available_cores() if allowed is None else tuple(sorted(allowed))
    if not text or not text.strip():
        return allowed
    cores = parse_core_list(text)
    outside = [c for c in cores if c not in allowed]
    if outside:
        raise ValueError(
            f"core list {text!r}: cores {format_core_list(outside)} are outside the cores this "
            f"process may use ({format_core_list(allowed)}: its affinity, as taskset or the "
            "container's cpuset set it)"
        )
    return cores


@dataclass(frozen=True)
class Topology:
    """Each CPU's (socket, physical core) on one machine; a physical core is named by its
    lowest sibling's id. A CPU it does not know is a core of its own, after the known ones."""

    places: Mapping[int, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def read(cls, root: Path = SYS_CPUS) -> Topology:
        """The topology sysfs describes under `root`; the CPUs it does not describe unknown."""
        places = {}
        for path in root.glob("cpu[0-9]*"):
            try:
                cpu = int(path.name.removeprefix("cpu"))
                socket = int((path / "topology/physical_package_id").read_text())
                siblings = parse_core_list((path / "topology/thread_siblings_list").read_text())
            except (OSError, ValueError):
                continue
            places[cpu] = (socket, min(siblings))
        return cls(places)

    @classmethod
    def uniform(cls, sockets: int, cores_per_socket: int, threads_per_core: int) -> Topology:
        """A machine numbered as Linux usually numbers one: the first hyperthread of every core,
        socket by socket, then the second of every core, and so on."""
        num_cores = sockets * cores_per_socket
        places = {}
        for thread in range(threads_per_core):
            for core in range(num_cores):
                places[thread * num_cores + core] = (core // cores_per_socket, core)
        return cls(places)

    def units(self, cores: Iterable[int]) -> tuple[Cores, ...]:
        """`cores` as physical cores (each the tuple of its siblings among `cores`), socket by
        socket, in core order."""
        groups: dict[tuple[int, int], list[int]] = {}
        for cpu in sorted(set(cores)):
            groups.setdefault(self.places.get(cpu, (_UNKNOWN, cpu)), []).append(cpu)
        return tuple(tuple(groups[key]) for key in sorted(groups))


@functools.cache
def machine_topology() -> Topology:
    """This machine's topology (read once)."""
    return Topology.read()


def split(
    cores: Iterable[int], parts: int, *, min_cpus: int = 1, topology: Topology | None = None
) -> tuple[Cores, ...]:
    """`cores` as `parts` equal, contiguous groups of physical cores, each of at least
    `min_cpus` CPUs, or else of CPUs (siblings apart); what an uneven split leaves is unused.
    ValueError when there are fewer than `parts` x `min_cpus` CPUs."""
    if parts < 1:
        raise ValueError(f"cores split into {parts} groups: expected 1 or more")
    units = (topology or machine_topology()).units(cores)
    cpus = [cpu for unit in units for cpu in unit]
    if len(cpus) < parts * min_cpus:
        raise ValueError(
            f"{len(cpus)} cores ({format_core_list(cpus)}) do not make {parts} groups of "
            f"{min_cpus} or more"
        )
    groups = _equal_groups(units, parts)
    if groups is None or any(len(group) < min_cpus for group in groups):
        groups = _equal_groups(tuple((cpu,) for cpu in cpus), parts)
    return tuple(tuple(sorted(group)) for group in groups)


def _equal_groups(units: tuple[Cores, ...], parts: int) -> list[list[int]] | None:
    size = len(units) // parts
    if size == 0:
        return None
    return [
        [cpu for unit in units[i * size : (i + 1) * size] for cpu in unit] for i in range(parts)
    ]


def replica_groups(
    cores: Iterable[int],
    *,
    data_parallel_size: int,
    tensor_parallel_size: int = 1,
    topology: Topology | None = None,
) -> tuple[Cores, ...]:
    """One group of `cores` per replica, each of at least `tensor_parallel_size` CPUs (a core
    per rank); ValueError naming the need and the cores when they do not go round."""
    cores = tuple(sorted(cores))
    if data_parallel_size < 1 or tensor_parallel_size < 1:
        raise ValueError(
            f"data and tensor parallel sizes must be >= 1, got {data_parallel_size} and "
            f"{tensor_parallel_size}"
        )
    needed = data_parallel_size * tensor_parallel_size
    if len(cores) < needed:
        raise ValueError(
            f"{data_parallel_size} replica(s) x tensor parallel {tensor_parallel_size} need at "
            f"least {needed} cores; only {len(cores)} given ({format_core_list(cores)})"
        )
    return split(cores, data_parallel_size, min_cpus=tensor_parallel_size, topology=topology)


def rank_cores(
    cores: Iterable[int], local_rank: int, num_ranks: int, *, topology: Topology | None = None
) -> Cores:
    """Local rank `local_rank`'s share of `cores` among `num_ranks` ranks; with fewer cores
    than ranks, its one core i mod n (the ranks share them, one thread each)."""
    units = (topology or machine_topology()).units(cores)
    cpus = [cpu for unit in units for cpu in unit]
    if not cpus:
        raise ValueError("no cores to run the ranks on")
    if len(cpus) < num_ranks:
        return (cpus[local_rank % len(cpus)],)
    return split(cpus, num_ranks, topology=topology)[local_rank]


def shared_cores_problem(num_ranks: int, cores: Collection[int]) -> str | None:
    """What serving refuses: more ranks on this machine than cores (None when each rank gets
    one of its own)."""
    if len(cores) >= num_ranks:
        return None
    return (
        f"{num_ranks} tensor-parallel ranks on this machine with {len(cores)} cores (supported: "
        f"a core per rank at least; this engine may use cores {format_core_list(cores)})"
    )


def reserved_count(num_cores: int, environ: Mapping[str, str], *, is_lowered: bool) -> int:
    """How many CPUs the front end asks (`RESERVED_ENV`, else the default described above)."""
    value = environ.get(RESERVED_ENV, "").strip()
    if not value:
        return int(num_cores >= MIN_CORES_TO_RESERVE and is_lowered)
    try:
        reserved = int(value)
    except ValueError:
        reserved = -1
    if reserved < 0:
        raise ValueError(f"{RESERVED_ENV}={value!r}: expected a number of cores, 0 or more")
    return reserved


def split_front_end(
    cores: Iterable[int],
    environ: Mapping[str, str] | None = None,
    *,
    is_lowered: bool,
    topology: Topology | None = None,
) -> tuple[Cores, Cores]:
    """(compute cores, front-end cores) of `cores`, as the module's docstring says;
    `is_lowered`: the front end runs below the steps (`VLLM_AOT_FRONT_END_NICE` above 0)."""
    cores = tuple(sorted(cores))
    environ = os.environ if environ is None else environ
    reserved = reserved_count(len(cores), environ, is_lowered=is_lowered)
    if reserved == 0:
        return cores, ()
    if reserved >= len(cores):
        logger.warning(
            "vllm-aot: %s=%d leaves none of the %d cores to compute on; the front end shares them",
            RESERVED_ENV,
            reserved,
            len(cores),
        )
        return cores, ()
    units = list((topology or machine_topology()).units(cores))
    front_end: list[int] = []
    while len(front_end) < reserved:
        front_end[:0] = units.pop()
    if not units:  # whole cores would leave none to compute on: CPUs, siblings apart
        front_end = [cpu for unit in (topology or machine_topology()).units(cores) for cpu in unit]
        front_end = front_end[-reserved:]
    return compute_cores(cores, front_end), tuple(sorted(front_end))


def compute_cores(cores: Iterable[int], front_end: Collection[int]) -> Cores:
    """`cores` but the front end's (all of them when that leaves none)."""
    cores = tuple(sorted(cores))
    return tuple(c for c in cores if c not in front_end) or cores


def pin_process(cores: Collection[int]) -> None:
    """This process (its calling thread, and every thread and child it starts from now on) to
    `cores`."""
    os.sched_setaffinity(0, cores)


def pin_threads(native_ids: Iterable[int], cores: Collection[int]) -> list[int]:
    """Threads `native_ids` to `cores`; the ids pinned (a thread gone meanwhile is skipped)."""
    pinned = []
    for tid in native_ids:
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):
            continue
        pinned.append(tid)
    return pinned


def thread_env(base: Mapping[str, str], num_cores: int) -> dict[str, str]:
    """`base` plus the thread settings for a process pinned to `num_cores` cores."""
    return {
        **base,
        "OMP_NUM_THREADS": str(num_cores),
        # vLLM's own OpenMP binding is for its multiprocess executor; ours pins by affinity.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
