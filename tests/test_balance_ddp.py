"""Speed-weighted DDP in real processes: same parameters as stock DDP, uneven shares never deadlock.

One spawn runs every scenario (process start-up dominates on 2 cores); each test checks one part.
Tolerance: float32 parameters after 6-12 SGD+momentum steps agree with stock DDP and with
single-process full-batch training within rtol=1e-5, atol=1e-6 (only the summation order differs).
"""

from dataclasses import asdict, replace

import numpy as np
import pytest

from memrt.testing.balance import Spec, epochs_run, reference_params, side_by_side
from memrt.testing import run_processes

RTOL, ATOL = 1e-5, 1e-6

# rank 1 sleeps 1.5 ms per sample in forward: a slow rank without root
EQUAL = Spec(global_batch=16, phase_steps=3, phases=2, width=64, depth=2, in_features=32,
             delay_s_per_sample={1: 0.0015}, rebalance_every=2)
SEVEN_ONE = Spec(global_batch=8, phase_steps=3, phases=1, width=32, depth=2, in_features=16, modes=("memrt",),
                 shares=(7, 1), adaptive=False)
ODD = replace(SEVEN_ONE, global_batch=23, shares=(20, 3))  # speeds 7:1 -> decide_shares(23, [7, 1]) == (20, 3)
ODD_ADAPTIVE = replace(SEVEN_ONE, global_batch=23, shares=None, adaptive=True, rebalance_every=2,
                       delay_s_per_sample={1: 0.0015})
MEMRT_COMM = replace(ODD, use_memrt_comm=True)  # through memrt.comm's topology-aware hook, 2 nodes (MEMRT_TOPOLOGY)
EPOCHS = 2


def _scenarios(rank, world):
    return {
        "equal": side_by_side(rank, world, asdict(EQUAL)),
        "seven_one": epochs_run(rank, world, asdict(SEVEN_ONE), EPOCHS),
        "odd": epochs_run(rank, world, asdict(ODD), EPOCHS),
        "odd_adaptive": epochs_run(rank, world, asdict(ODD_ADAPTIVE), EPOCHS),
        "memrt_comm": epochs_run(rank, world, asdict(MEMRT_COMM), EPOCHS),
    }


@pytest.fixture(scope="module")
def results():
    return run_processes(_scenarios, 2, env={"MEMRT_TOPOLOGY": "0;1"}, timeout=240, pg_timeout_s=120)


def _close(a, b):
    return all(np.allclose(x, y, rtol=RTOL, atol=ATOL) for x, y in zip(a, b))


@pytest.mark.slow
def test_speed_weighted_equals_stock_ddp(results):
    r0, r1 = results[0]["equal"], results[1]["equal"]
    ref = reference_params(EQUAL)
    assert _close(r0["params"]["memrt"], r0["params"]["stock"])
    assert _close(r0["params"]["memrt"], ref) and _close(r0["params"]["stock"], ref)
    assert all(np.array_equal(a, b) for a, b in zip(r0["params"]["memrt"], r1["params"]["memrt"]))
    # the shares really were uneven: the slowed rank 1 ended with fewer samples than rank 0
    assert r0["shares"][0] > r1["shares"][1]
    steps = zip(r0["local_samples"]["memrt"], r1["local_samples"]["memrt"])
    assert all(a + b == EQUAL.global_batch for a, b in steps)


@pytest.mark.slow
def test_every_rank_takes_the_same_decisions(results):
    d0, d1 = results[0]["equal"]["decisions"], results[1]["equal"]["decisions"]
    assert d0 == d1 and any(d["changed"] for d in d0)


@pytest.mark.slow
@pytest.mark.parametrize("name,spec", [("seven_one", SEVEN_ONE), ("odd", ODD), ("odd_adaptive", ODD_ADAPTIVE),
                                       ("memrt_comm", MEMRT_COMM)])
def test_uneven_shares_run_whole_epochs_without_deadlock(results, name, spec):
    r0, r1 = results[0][name], results[1][name]
    steps = spec.total_steps  # the dataset holds total_steps global batches
    assert r0["steps_per_epoch"] == r1["steps_per_epoch"] == [steps] * EPOCHS
    if not spec.adaptive:
        assert set(zip(r0["local_samples"], r1["local_samples"])) == {spec.shares}
    assert all(a + b == spec.global_batch for a, b in zip(r0["local_samples"], r1["local_samples"]))
    ref = reference_params(spec, epochs=EPOCHS)
    assert _close(r0["params"], ref) and _close(r1["params"], ref)
    assert r0["comm"] == ("memrt" if spec.use_memrt_comm else "torch")
