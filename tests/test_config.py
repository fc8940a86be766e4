import json
import logging
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from memrt.config import Budget, load_config, parse_size
from memrt.errors import ConfigError

MALFORMED = [
    ("MEMRT", "maybe"), ("MEMRT", "2"), ("MEMRT", "onn"), ("MEMRT_STRICT", "y"), ("MEMRT_STRICT", "-1"),
    ("MEMRT_BUDGET", "12parsecs"), ("MEMRT_BUDGET", "-5"), ("MEMRT_BUDGET", "0"), ("MEMRT_BUDGET", "3 GiBs"),
    ("MEMRT_BUDGET", "1.5"), ("MEMRT_BUDGET", "150%"), ("MEMRT_BUDGET", "0%"), ("MEMRT_BUDGET", "%"),
    ("MEMRT_BUDGET", "GiB"), ("MEMRT_BUDGET", "1e9"), ("MEMRT_BUDGET", "3GiB extra"), ("MEMRT_BUDGET", "0x100"),
    ("MEMRT_OFFLOAD", "gpu"), ("MEMRT_OFFLOAD", "nvme"), ("MEMRT_COMM", "ring"), ("MEMRT_COMM", "hierarchical2"),
    ("MEMRT_COMPRESS", "int4"), ("MEMRT_COMPRESS", "fp8"), ("MEMRT_TOPOLOGY", "0,1;1,2"),
    ("MEMRT_TOPOLOGY", "0,1;;2"), ("MEMRT_TOPOLOGY", "a,b"), ("MEMRT_TOPOLOGY", "0,2"), ("MEMRT_TOPOLOGY", "1,2"),
    ("MEMRT_TOPOLOGY", "0,-1"), ("MEMRT_LOG_LEVEL", "verbose"), ("MEMRT_LOG_LEVEL", "trace"),
    ("MEMRT_OFFLOAD_DIR", "\x00bad"), ("MEMRT_REPORT_DIR", "  "),
    # digits are ASCII only (str.isdigit accepts '²', int() then fails; '١' would even parse as 1)
    ("MEMRT_TOPOLOGY", "²,0"), ("MEMRT_TOPOLOGY", "0,١"), ("MEMRT_BUDGET", "١GiB"), ("MEMRT_BUDGET", "٥٠%"),
    # shares from 0.001% to 100% (smaller ones printed as 1e-05% and were dropped in a run)
    ("MEMRT_BUDGET", "0.00001%"), ("MEMRT_BUDGET", "0.0009%"), ("MEMRT_BUDGET", "100.0001%"),
]


@pytest.mark.parametrize("var,value", MALFORMED)
def test_malformed_values_name_the_variable(var, value):
    if not value.strip():
        # An empty value means "unset" (default) for every variable.
        assert load_config({var: value}).sources[var] == "default"
        return
    with pytest.raises(ConfigError) as info:
        load_config({var: value})
    msg = str(info.value)
    assert var in msg and "expected" in msg and "\n" not in msg


def test_malformed_count():
    assert len({(v, x) for v, x in MALFORMED}) >= 30


@pytest.mark.parametrize("text,expected", [
    ("123", 123), ("1KB", 1000), ("1kb", 1000), ("1KiB", 1024), ("3GiB", 3 * 2**30), ("500MB", 500 * 10**6),
    ("1.5GiB", int(1.5 * 2**30)), ("2 mib", 2 * 2**20), ("1TB", 10**12), ("7b", 7),
])
def test_sizes(text, expected):
    assert parse_size("MEMRT_BUDGET", text) == expected


@given(st.integers(min_value=1, max_value=2**50), st.sampled_from(["", "KB", "MiB", "gib", "Tb"]))
@settings(max_examples=200, deadline=None)
def test_size_roundtrip_property(n, unit):
    scale = {"": 1, "kb": 10**3, "mib": 2**20, "gib": 2**30, "tb": 10**12}[unit.lower()]
    assert parse_size("X", f"{n}{unit}") == n * scale


@given(st.text(alphabet=st.characters(blacklist_categories=("Nd",)), min_size=1, max_size=8))
@settings(max_examples=200, deadline=None)
def test_budget_without_digits_is_rejected(text):
    if not text.strip() or text.strip().lower() in ("none", "unlimited"):
        return
    with pytest.raises(ConfigError, match="MEMRT_BUDGET"):
        load_config({"MEMRT_BUDGET": text})


def test_shares_and_resolution():
    cfg = load_config({"MEMRT_BUDGET": "60%"})
    assert cfg.budget == Budget(share=0.6)
    assert cfg.budget.resolve(1000) == 600
    with pytest.raises(ConfigError, match="MEMRT_BUDGET"):
        cfg.budget.resolve(None)


@given(st.decimals(min_value="0.001", max_value="100", places=3))
@settings(max_examples=200, deadline=None)
def test_every_accepted_share_prints_in_a_form_that_parses_back(pct):
    budget = load_config({"MEMRT_BUDGET": f"{pct}%"}).budget
    text = str(budget)
    assert "e" not in text.lower() and load_config({"MEMRT_BUDGET": text}).budget == budget, (pct, text)


def test_budget_above_a_thousand_times_the_device_is_named():
    from memrt.config import budget_capacity_error

    assert budget_capacity_error(Budget(bytes=1000 * 2**30), 2**30, "cpu") is None
    err = budget_capacity_error(Budget(bytes=1000 * 2**30 + 1), 2**30, "cuda:0 (H100)")
    assert "MEMRT_BUDGET=" in str(err) and "at most 1000 x the capacity of cuda:0 (H100)" in str(err)
    assert budget_capacity_error(Budget(share=1.0), 2**30, "cpu") is None


def test_precedence_argument_over_environment_over_default():
    env = {"MEMRT_COMM": "flat", "MEMRT_BUDGET": "1GB"}
    cfg = load_config(env, comm="hier")
    assert cfg.comm == "hier" and cfg.sources["MEMRT_COMM"] == "argument"
    assert cfg.budget == Budget(bytes=10**9) and cfg.sources["MEMRT_BUDGET"] == "environment"
    assert cfg.compress == "none" and cfg.sources["MEMRT_COMPRESS"] == "default"
    cfg = load_config({}, budget=4096)
    assert cfg.budget.bytes == 4096


def test_bad_argument_names_the_variable():
    with pytest.raises(ConfigError, match="MEMRT_COMM"):
        load_config({}, comm="ring")
    with pytest.raises(TypeError, match="unknown setting"):
        load_config({}, bugdet="1GB")


def test_booleans():
    for raw, val in [("1", True), ("on", True), ("YES", True), ("true", True), ("0", False), ("off", False),
                     ("no", False), ("False", False)]:
        assert load_config({"MEMRT": raw}).enabled is val


def test_topology():
    assert load_config({"MEMRT_TOPOLOGY": "0,1;2,3"}).topology == ((0, 1), (2, 3))
    assert load_config({"MEMRT_TOPOLOGY": " 0,1,2 ; 3 "}).topology == ((0, 1, 2), (3,))


def test_unknown_variable_warns_with_closest(caplog):
    with caplog.at_level(logging.WARNING, logger="memrt.config"):
        load_config({"MEMRT_BUDGT": "1GB"})
    assert "MEMRT_BUDGT" in caplog.text and "MEMRT_BUDGET" in caplog.text


def _cli(*args, env_extra=None):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRT")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "memrt", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_cli_bad_budget_exits_2_with_one_line():
    proc = _cli("info", env_extra={"MEMRT_BUDGET": "12parsecs"})
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "MEMRT_BUDGET" in lines[0] and "Traceback" not in proc.stderr


def test_cli_info_json():
    proc = _cli("info", "--json", env_extra={"MEMRT_BUDGET": "3GiB", "RANK": "1", "WORLD_SIZE": "4",
                                               "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    for key in ("version", "torch", "launcher", "rank", "world_size", "local_rank", "local_world_size",
                "devices", "config"):
        assert key in info
    assert info["launcher"] == "torchrun" and info["rank"] == 1 and info["world_size"] == 4
    assert info["config"]["MEMRT_BUDGET"] == {"value": "3.00 GiB", "source": "environment"}
    assert info["config"]["MEMRT_COMM"]["source"] == "default"
    assert info["devices"][0]["capacity_bytes"] > 0
