"""When the activation swaps the script's backend for memrt's process group, and what runs underneath."""

from __future__ import annotations

import pytest

from memrt.comm import backend as b


@pytest.fixture(autouse=True)
def _restore_spec():
    saved = b.inner_spec()
    yield
    b._inner.clear()
    b._inner.update(saved)


@pytest.mark.parametrize("args,kwargs,mode,switched", [
    (("gloo",), {}, "auto", True),
    ((), {"backend": "nccl"}, "hier", True),
    ((), {}, "auto", True),  # torch's default backend
    ((), {"backend": "cpu:gloo,cuda:nccl"}, "auto", True),
    (("gloo",), {}, "off", False),  # MEMRT_COMM=off keeps torch's backend
    ((), {"backend": "mpi"}, "auto", False),
    ((), {"backend": "ucc"}, "auto", False),
    ((), {"backend": "nccl", "pg_options": object()}, "auto", False),  # backend-specific options
])
def test_activation_switches_only_what_it_can_carry(args, kwargs, mode, switched):
    new_args, new_kwargs, did = b.activation_kwargs(args, dict(kwargs), mode)
    assert did is switched
    backend = new_args[0] if new_args else new_kwargs.get("backend")
    assert (backend == b.BACKEND_NAME) is switched
    if not switched:
        assert new_args == args and new_kwargs == kwargs


@pytest.mark.parametrize("args,kwargs", [(("nccl",), {}), ((), {"backend": "cpu:gloo,cuda:nccl"})])
def test_process_group_auto_leaves_nccl_jobs_on_torchs_group(args, kwargs):
    # MEMRT_PROCESS_GROUP=auto: a job whose CUDA tensors would run on NCCL keeps torch's group; on: switched
    new_args, new_kwargs, did = b.activation_kwargs(args, dict(kwargs), "auto", when="auto")
    assert not did and new_args == args and new_kwargs == kwargs
    assert b.activation_kwargs(args, dict(kwargs), "auto", when="on")[2]
    assert b.activation_kwargs(("gloo",), {}, "auto", when="auto")[2]


def test_process_group_setting_reads_auto_or_a_boolean():
    from memrt.config import ConfigError, load_config

    assert load_config({}).process_group == "auto"
    assert [load_config({"MEMRT_PROCESS_GROUP": v}).process_group for v in ("1", "off", "AUTO", "yes")] == \
        ["on", "off", "auto", "on"]
    with pytest.raises(ConfigError, match="MEMRT_PROCESS_GROUP"):
        load_config({"MEMRT_PROCESS_GROUP": "sometimes"})


def test_inner_spec_follows_the_requested_backend():
    b.set_inner_spec("gloo")
    assert b.inner_spec()["cpu"] == "gloo"
    b.set_inner_spec("nccl")
    assert b.inner_spec() == {"cpu": "gloo", "cuda": "nccl"}
    b.set_inner_spec("cpu:gloo,cuda:nccl")
    assert b.inner_spec() == {"cpu": "gloo", "cuda": "nccl"}
    with pytest.raises(ValueError, match="MEMRT_COMM=off"):
        b.set_inner_spec("mpi")


def test_passthrough_and_internal_nest_per_thread():
    assert not b._busy()
    with b.passthrough():
        with b.passthrough():
            assert b._busy()
        assert b._busy()
    assert not b._busy()
