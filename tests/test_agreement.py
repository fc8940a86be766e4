"""memrt.agreement: the verdict on every rank's settings (pure functions), and the store exchange timed in real
gloo processes (how long a mismatch and a silent peer take to be reported, without launcher start-up noise)."""

from __future__ import annotations

import time

import pytest

from memrt import agreement
from memrt.config import AGREED_VARIABLES, SETTINGS, load_config
from memrt.errors import AgreementError
from _faults import record_time
from memrt.testing import run_processes


def _entry(env: dict[str, str], error: str | None = None) -> dict:
    config = load_config(env, warn_unknown=False)
    return agreement._entry(config, error)  # noqa: SLF001 - what a rank writes


def test_agreed_settings_are_declared_in_the_table():
    assert AGREED_VARIABLES == tuple(s.var for s in SETTINGS if s.agree)
    assert {"MEMRT", "MEMRT_TOPOLOGY", "MEMRT_COMM", "MEMRT_COMPRESS", "MEMRT_OFFLOAD"} <= set(AGREED_VARIABLES)
    assert "MEMRT_BUDGET" not in AGREED_VARIABLES, "budgets are per rank (a share follows each rank's device)"
    assert set(load_config({}).agreed()) == set(AGREED_VARIABLES)


@pytest.mark.parametrize("var,a,b,shown_a,shown_b", [
    ("MEMRT", "1", "0", "1", "0"),
    ("MEMRT_TOPOLOGY", "0,1", "0;1", "'0,1'", "'0;1'"),
    ("MEMRT_COMM", "hier", "flat", "'hier'", "'flat'"),
    ("MEMRT_COMPRESS", "int8", "bf16", "'int8'", "'bf16'"),
    ("MEMRT_OFFLOAD", "disk", "none", "'disk'", "'none'"),
])
def test_each_kind_of_mismatch_is_named_with_ranks_and_values(var, a, b, shown_a, shown_b):
    verdict = agreement.decide({0: _entry({var: a}), 1: _entry({var: b}), 2: _entry({var: a})}, 3, 0.1)
    line = agreement.rank_message(verdict, 2)
    assert line == agreement.rank_message(verdict, 0), "every rank prints the same line"
    assert f"{var}: {shown_a} on ranks 0,2, {shown_b} on rank 1" in line and "\n" not in line


def test_equal_values_written_differently_agree():
    entries = {0: _entry({"MEMRT_COMM": "HIER", "MEMRT_TOPOLOGY": " 0,1 "}),
               1: _entry({"MEMRT_COMM": "hier", "MEMRT_TOPOLOGY": "0,1"})}
    assert agreement.rank_message(agreement.decide(entries, 2, 0.0), 1) is None
    # a value set explicitly equal to the default is the same value
    assert agreement.rank_message(agreement.decide({0: _entry({"MEMRT_COMM": "auto"}), 1: _entry({})}, 2, 0), 0) is None


def test_a_silent_rank_is_named_as_memrt_off_there():
    verdict = agreement.decide({0: _entry({"MEMRT": "1"}), 2: _entry({"MEMRT": "1"})}, 4, 10.0)
    line = agreement.rank_message(verdict, 0)
    assert "MEMRT: 1 on ranks 0,2, no memrt settings from ranks 1,3 within 10 s" in line


def test_a_rank_with_a_start_up_error_is_reported_to_the_others():
    verdict = agreement.decide({0: _entry({}), 1: _entry({}, "MEMRT_TOPOLOGY='0,1,2' is not valid: x")}, 2, 0.0)
    assert agreement.rank_message(verdict, 1) == "MEMRT_TOPOLOGY='0,1,2' is not valid: x (rank 1)"
    assert agreement.rank_message(verdict, 0) == "rank 1 stopped at start-up: MEMRT_TOPOLOGY='0,1,2' is not valid: x"


def test_topology_must_cover_the_world():
    assert agreement.topology_error(load_config({"MEMRT_TOPOLOGY": "0,1;2,3"}), 4) is None
    err = agreement.topology_error(load_config({"MEMRT_TOPOLOGY": "0,1,2"}), 2)
    assert "MEMRT_TOPOLOGY='0,1,2'" in str(err) and "exactly the 2 ranks" in str(err) and "names 3" in str(err)
    assert "e.g. 0,1;2,3" in str(agreement.topology_error(load_config({"MEMRT_TOPOLOGY": "0,1"}), 4))


def test_rank_lists_are_compact():
    assert agreement.format_ranks([3]) == "rank 3"
    assert agreement.format_ranks([5, 0, 1, 2, 7, 8]) == "ranks 0-2,5,7-8"


# ------------------------------------------------------------------ real processes (gloo, the store)

def _scenarios(rank: int, world: int):
    """Every timed scenario in one pair of processes (spawning is the expensive part): each on its own store
    prefix; a rank given None runs no memrt code and waits in a collective, like DDP's first one."""
    import logging

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    base = distributed_c10d._get_default_store()  # noqa: SLF001
    out = {}

    def timed(name, envs, **kwargs):
        env = envs[rank]
        t0 = time.perf_counter()
        message = None
        if env is None:
            dist.barrier()
        else:
            try:
                agreement.check(load_config(env, warn_unknown=False),
                                store=dist.PrefixStore(name, base) if name != "default-group" else None, **kwargs)
            except AgreementError as exc:
                message = str(exc)
            if any(e is None for e in envs):
                dist.barrier()  # release the silent rank
        out[name] = (message, time.perf_counter() - t0)

    timed("default-group", [{"MEMRT_TOPOLOGY": "0,1"}, {"MEMRT_TOPOLOGY": "0,1"}])
    t0 = time.perf_counter()
    agreement.check(load_config({"MEMRT_COMM": "flat" if rank else "hier"}))  # same group: already checked
    out["again"] = (None, time.perf_counter() - t0)
    timed("mismatch", [{"MEMRT_COMM": "hier"}, {"MEMRT_COMM": "flat"}])
    timed("silent1", [{"MEMRT": "1"}, None])
    timed("silent0", [None, {"MEMRT": "1"}])
    # a lazily connecting backend (NCCL without device_id): rank 0 warns after AGREE_WAIT_S, gives up later
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("memrt.agreement").addHandler(handler)
    agreement.AGREE_WAIT_S = 1.0
    t0 = time.perf_counter()
    if rank == 1:
        dist.barrier()
    else:
        verdict = agreement._exchange(dist.PrefixStore("lazy", base), "1", 0, 2,  # noqa: SLF001
                                      agreement._entry(load_config({"MEMRT": "1"}), None), 3.0, True)  # noqa: SLF001
        out["lazy"] = (agreement.rank_message(verdict, 0), time.perf_counter() - t0, records)
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def timed_scenarios():
    return run_processes(_scenarios, 2, timeout=240)


@pytest.mark.alone
@pytest.mark.slow
def test_agreeing_ranks_pass_in_milliseconds_and_only_once_per_group(timed_scenarios):
    for rank in (0, 1):
        message, seconds = timed_scenarios[rank]["default-group"]
        assert message is None and seconds < 2.0, (rank, message, seconds)
        assert timed_scenarios[rank]["again"][1] < 0.05, "a second check of the same group returns at once"
    record_time("agreement-ok-in-process", max(timed_scenarios[r]["default-group"][1] for r in (0, 1)))


@pytest.mark.alone
@pytest.mark.slow
def test_mismatch_is_reported_on_every_rank_within_seconds(timed_scenarios):
    (m0, t0), (m1, t1) = (timed_scenarios[r]["mismatch"] for r in (0, 1))
    assert m0 == m1 and "MEMRT_COMM: 'hier' on rank 0, 'flat' on rank 1" in m0
    assert max(t0, t1) < 2.0, (t0, t1)
    record_time("agreement-mismatch-in-process", max(t0, t1))


@pytest.mark.alone
@pytest.mark.slow
@pytest.mark.parametrize("silent", [1, 0])
def test_a_silent_rank_is_reported_after_the_wait(timed_scenarios, silent):
    message, seconds = timed_scenarios[1 - silent][f"silent{silent}"]
    assert f"MEMRT: 1 on rank {1 - silent}, no memrt settings from rank {silent} within 10 s" in message
    assert agreement.AGREE_WAIT_S - 0.5 <= seconds <= agreement.AGREE_WAIT_S + 3.0, seconds
    record_time(f"agreement-rank-{silent}-silent-in-process", seconds)


@pytest.mark.alone
@pytest.mark.slow
def test_lazy_backends_wait_longer_and_say_so(timed_scenarios):
    message, seconds, records = timed_scenarios[0]["lazy"]
    assert any("has waited 1 s for the memrt settings of rank 1" in r for r in records), records
    assert "no memrt settings from rank 1 within 3 s" in message and 2.5 <= seconds <= 6.0, (message, seconds)
