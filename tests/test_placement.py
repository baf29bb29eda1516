"""vllm_aot/placement.py: core lists, the machine's topology, and every split of the cores, on
fake topologies (pure: nothing is pinned but in `test_pinning_applies_the_choice`)."""

from __future__ import annotations

import os

import pytest

from vllm_aot.placement import (
    MIN_CORES_TO_RESERVE,
    RESERVED_ENV,
    Topology,
    compute_cores,
    format_core_list,
    parse_core_list,
    pin_threads,
    rank_cores,
    replica_groups,
    requested_cores,
    shared_cores_problem,
    split,
    split_front_end,
    thread_env,
)

pytestmark = pytest.mark.unit

FLAT = Topology()  # every CPU a core of its own
# Two sockets of four cores, two hyperthreads each: CPU c and c + 8 are siblings, 0-3 and 8-11
# on socket 0, 4-7 and 12-15 on socket 1.
TWO_SOCKETS = Topology.uniform(sockets=2, cores_per_socket=4, threads_per_core=2)


@pytest.mark.parametrize(
    ("text", "cores"),
    [
        ("0-3,8-11", (0, 1, 2, 3, 8, 9, 10, 11)),
        ("5", (5,)),
        ("3,1, 2", (1, 2, 3)),
        ("0-1,", (0, 1)),
        ("0,16\n", (0, 16)),  # as sysfs writes a sibling list
    ],
)
def test_core_lists_parse_and_format_back(text, cores):
    assert parse_core_list(text) == cores
    assert parse_core_list(format_core_list(cores)) == cores


def test_core_lists_format_compactly():
    assert format_core_list([8, 0, 1, 2, 3, 10]) == "0-3,8,10"
    assert format_core_list([]) == ""


@pytest.mark.parametrize("text", ["", "a", "3-1", "0-2,2", "-1", "1-"])
def test_bad_core_lists_are_refused_naming_the_input(text):
    with pytest.raises(ValueError, match="bad core list"):
        parse_core_list(text)


def test_a_core_list_names_cores_of_the_affinity_only():
    assert requested_cores(None, allowed={3, 0, 1, 2}) == (0, 1, 2, 3)
    assert requested_cores(" ", allowed={0, 1}) == (0, 1)
    assert requested_cores("1-2", allowed=range(4)) == (1, 2)
    with pytest.raises(ValueError, match=r"cores 4-5,9 are outside .* \(0-3: its affinity"):
        requested_cores("2-5,9", allowed=range(4))
    assert requested_cores(None) == tuple(sorted(os.sched_getaffinity(0)))


def test_the_topology_is_read_from_sysfs(tmp_path):
    for cpu, socket, siblings in [(0, 0, "0,2"), (1, 1, "1,3"), (2, 0, "0,2"), (3, 1, "1,3")]:
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{socket}\n")
        (topology / "thread_siblings_list").write_text(f"{siblings}\n")
    (tmp_path / "cpu4").mkdir()  # offline: no topology, a core of its own
    (tmp_path / "cpufreq").mkdir()
    read = Topology.read(tmp_path)
    assert read.places == {0: (0, 0), 1: (1, 1), 2: (0, 0), 3: (1, 1)}
    assert read.units(range(5)) == ((0, 2), (1, 3), (4,))
    assert Topology.read(tmp_path / "missing").units([1, 0]) == ((0,), (1,))


def test_physical_cores_come_socket_by_socket_with_their_siblings():
    assert TWO_SOCKETS.units(range(16))[:5] == ((0, 8), (1, 9), (2, 10), (3, 11), (4, 12))
    assert TWO_SOCKETS.units([4, 0, 8]) == ((0, 8), (4,))  # only the siblings given
    assert FLAT.units([2, 0, 1]) == ((0,), (1,), (2,))


def test_replicas_get_equal_groups_and_leftovers_stay_unused():
    cores = parse_core_list("0-3,8-11")
    assert replica_groups(cores, data_parallel_size=2, topology=FLAT) == (
        (0, 1, 2, 3),
        (8, 9, 10, 11),
    )
    assert replica_groups((0, 1, 2), data_parallel_size=2, topology=FLAT) == ((0,), (1,))
    assert replica_groups((0, 1), data_parallel_size=1, topology=FLAT) == ((0, 1),)


def test_too_few_cores_for_the_replicas_ranks_are_refused():
    with pytest.raises(ValueError, match=r"2 replica\(s\) x tensor parallel 2 need at least 4"):
        replica_groups((0, 1, 2), data_parallel_size=2, tensor_parallel_size=2, topology=FLAT)
    with pytest.raises(ValueError, match=r"need at least 3 cores; only 2 given \(0-1\)"):
        replica_groups((0, 1), data_parallel_size=3, topology=FLAT)
    with pytest.raises(ValueError, match="must be >= 1"):
        replica_groups((0, 1), data_parallel_size=0, topology=FLAT)
    with pytest.raises(ValueError, match=r"3 cores \(0-2\) do not make 2 groups of 2 or more"):
        split((0, 1, 2), 2, min_cpus=2, topology=FLAT)
    with pytest.raises(ValueError, match="0 groups: expected 1 or more"):
        split((0, 1), 0, topology=FLAT)


def test_replicas_keep_hyperthread_siblings_together_and_a_socket_each():
    groups = replica_groups(range(16), data_parallel_size=2, topology=TWO_SOCKETS)
    assert groups == ((0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15))
    groups = replica_groups(range(16), data_parallel_size=3, topology=TWO_SOCKETS)
    assert groups == ((0, 1, 8, 9), (2, 3, 10, 11), (4, 5, 12, 13))  # cores 6, 7 unused


def test_fewer_physical_cores_than_groups_split_the_hyperthreads():
    one_core = Topology.uniform(sockets=1, cores_per_socket=1, threads_per_core=2)
    assert split((0, 1), 2, topology=one_core) == ((0,), (1,))
    # Whole cores would give a replica fewer CPUs than its ranks: CPUs instead.
    lopsided = Topology({0: (0, 0), 1: (0, 0), 2: (0, 2), 3: (0, 3)})
    groups = replica_groups(
        range(4), data_parallel_size=2, tensor_parallel_size=2, topology=lopsided
    )
    assert groups == ((0, 1), (2, 3))


def test_a_machines_cores_are_split_among_its_ranks():
    assert rank_cores([3, 0, 1, 2], 1, 2, topology=FLAT) == (2, 3)
    assert rank_cores([0, 1], 0, 1, topology=FLAT) == (0, 1)
    assert rank_cores(range(5), 1, 2, topology=FLAT) == (2, 3)  # core 4 unused
    assert [rank_cores(range(16), r, 2, topology=TWO_SOCKETS) for r in (0, 1)] == [
        (0, 1, 2, 3, 8, 9, 10, 11),
        (4, 5, 6, 7, 12, 13, 14, 15),
    ]


def test_fewer_cores_than_ranks_share_them_one_thread_each_and_serving_refuses_it():
    assert [rank_cores([0, 1], r, 3, topology=FLAT) for r in range(3)] == [(0,), (1,), (0,)]
    assert rank_cores([0], 1, 2, topology=FLAT) == (0,)
    assert shared_cores_problem(2, (0, 1)) is None
    problem = shared_cores_problem(3, (0, 1))
    assert problem.startswith("3 tensor-parallel ranks on this machine with 2 cores")
    assert "may use cores 0-1" in problem


def test_the_front_end_gets_the_last_cores_asked_for_and_one_by_default_on_big_machines():
    def front(cores, environ, is_lowered=False, topology=FLAT):
        return split_front_end(cores, environ, is_lowered=is_lowered, topology=topology)

    assert front([3, 1, 2, 0], {RESERVED_ENV: "1"}) == ((0, 1, 2), (3,))
    assert front(range(8), {RESERVED_ENV: "2"}) == ((0, 1, 2, 3, 4, 5), (6, 7))
    assert front(range(8), {RESERVED_ENV: "0"}) == (tuple(range(8)), ())
    small, big = range(MIN_CORES_TO_RESERVE - 1), range(MIN_CORES_TO_RESERVE)
    assert front(small, {}, is_lowered=True) == (tuple(small), ())  # as vllm-aot serve has it
    assert front(big, {}, is_lowered=True) == (tuple(big)[:-1], tuple(big)[-1:])
    assert front(big, {}) == (tuple(big), ())  # a library user's process: unless asked
    # Nothing left to compute on: the front end shares the cores (vLLM warns the same way).
    assert front([0, 1], {RESERVED_ENV: "2"}) == ((0, 1), ())
    for bad in ("-1", "one"):
        with pytest.raises(ValueError, match=rf"{RESERVED_ENV}.*0 or more"):
            front([0, 1], {RESERVED_ENV: bad})


def test_the_front_end_takes_whole_physical_cores_unless_none_would_be_left():
    compute, front_end = split_front_end(
        range(16), {RESERVED_ENV: "1"}, is_lowered=True, topology=TWO_SOCKETS
    )
    assert front_end == (7, 15) and compute == tuple(c for c in range(16) if c not in (7, 15))
    one_core = Topology.uniform(sockets=1, cores_per_socket=1, threads_per_core=2)
    assert split_front_end((0, 1), {RESERVED_ENV: "1"}, is_lowered=True, topology=one_core) == (
        (0,),
        (1,),
    )


def test_compute_cores_are_the_rest_or_all():
    assert compute_cores((0, 1, 2), (2,)) == (0, 1)
    assert compute_cores((0, 1), (0, 1)) == (0, 1)
    assert compute_cores((1, 0), ()) == (0, 1)


def test_pinning_applies_the_choice():
    core = min(os.sched_getaffinity(0))
    assert pin_threads([2**22 + 7], {core}) == []  # a thread that is gone is skipped
    env = thread_env({"PATH": "/bin"}, 3)
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "3", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
