"""The one place memrt reads its environment.

Every ``MEMRT_*`` variable is parsed here into a typed :class:`MemrtConfig`, and each value remembers
where it came from (``default``, ``environment`` or ``argument``). Launcher variables (torchrun, MPI,
SLURM) are read by :mod:`memrt.launcher` through :func:`environ`, never from ``os.environ`` directly.

Precedence: argument > environment > default. ``MEMRT=0`` switches everything off.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from fractions import Fraction
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

from memrt.errors import ConfigError
from memrt.sizes import format_bytes

__all__ = [
    "AGREED_VARIABLES",
    "Budget",
    "MAX_BUDGET_FACTOR",
    "MIN_SHARE",
    "MemrtConfig",
    "SETTINGS",
    "Setting",
    "TEST_ONLY_VARIABLES",
    "NOT_USER_VARIABLES",
    "VARIABLES",
    "budget_capacity_error",
    "cache_dir",
    "environ",
    "load_config",
    "parse_bool",
    "parse_budget",
    "parse_size",
    "parse_topology",
]

logger = logging.getLogger(__name__)

_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}
_BOOL_FORMS = "one of 1/0, true/false, on/off, yes/no"
_SIZE_FORMS = (
    "a size: bare integer bytes, or a number with KB/MB/GB/TB (decimal) or KiB/MiB/GiB/TiB (binary) "
    "such as 500MB or 3GiB"
)
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# re.ASCII: digits are 0-9 only ('²' or '١' are not numbers a launcher or a user types on purpose)
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$", re.ASCII)
_SHARE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$", re.ASCII)
_RANK_RE = re.compile(r"[0-9]+", re.ASCII)

_MIN_SHARE_EXACT = Fraction(1, 100_000)
MIN_SHARE = float(_MIN_SHARE_EXACT)
"""Smallest budget share accepted (0.001% of the device): below it no training step fits anywhere."""
MAX_BUDGET_FACTOR = 1000
"""An absolute budget may be at most this many times the device's capacity (beyond it, it is a typo)."""

OFFLOAD_CHOICES = ("auto", "none", "host", "disk")
COMM_CHOICES = ("auto", "flat", "hier", "off")
COMPRESS_CHOICES = ("none", "auto", "bf16", "fp16", "int8")
LOG_LEVELS = ("debug", "info", "warning", "error")
BALANCE_CHOICES = ("auto", "on", "off")
SYNC_CHOICES = ("exact", "diloco")


def environ() -> dict[str, str]:
    """A copy of the process environment: the only read of ``os.environ`` in memrt."""
    return dict(os.environ)


def cache_dir(env: Mapping[str, str] | None = None) -> str:
    """Where memrt keeps what it measured once per machine (link and copy bandwidths):
    ``$XDG_CACHE_HOME/memrt``, else ``~/.cache/memrt``."""
    env = environ() if env is None else env
    base = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
    return os.path.join(base, "memrt")


def _torch_debug(env: Mapping[str, str]) -> str:
    return (env.get("TORCH_DISTRIBUTED_DEBUG") or "OFF").strip().upper()


def parse_bool(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(name, raw, _BOOL_FORMS)


def parse_size(name: str, raw: str) -> int:
    """Bytes from ``"123"``, ``"500MB"``, ``"3GiB"``, ``"1.5 GiB"`` (case-insensitive units)."""
    m = _SIZE_RE.match(str(raw))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(name, raw, _SIZE_FORMS)
    number, unit = m.group(1), m.group(2).lower()
    if unit in ("", "b") and "." in number:
        raise ConfigError(name, raw, _SIZE_FORMS + " (bytes must be a whole number)")
    value = int(Fraction(number) * _SIZE_UNITS[unit])  # exact: no float rounding of large sizes
    if value <= 0:
        raise ConfigError(name, raw, _SIZE_FORMS + " greater than zero")
    return value


@dataclass(frozen=True, slots=True)
class Budget:
    """A memory budget: either absolute bytes or a share of the device's capacity."""

    bytes: int | None = None
    """Absolute budget in bytes, or None when the budget is a share."""
    share: float | None = None
    """Fraction of device capacity in (0, 1], or None when the budget is absolute."""

    def resolve(self, capacity_bytes: int | None) -> int:
        """The budget in bytes for a device of ``capacity_bytes``."""
        if self.bytes is not None:
            return self.bytes
        if capacity_bytes is None:
            raise ConfigError("MEMRT_BUDGET", str(self), "an absolute size: this device's capacity is unknown")
        return max(1, int(self.share * capacity_bytes))

    def __str__(self) -> str:
        return format_bytes(self.bytes) if self.bytes is not None else _format_share(self.share)


def _format_share(share: float) -> str:
    """``0.85`` -> ``85%``, ``1e-5`` -> ``0.001%``: plain decimals (never ``1e-05%``) that parse_budget reads back."""
    text = f"{share * 100:.6f}".rstrip("0").rstrip(".")
    return f"{text or '0'}%"


def budget_capacity_error(budget: "Budget | None", capacity_bytes: int | None, device: str) -> ConfigError | None:
    """The error for an absolute budget above MAX_BUDGET_FACTOR x the device's capacity, else None."""
    if budget is None or budget.bytes is None or not capacity_bytes:
        return None
    if budget.bytes <= MAX_BUDGET_FACTOR * capacity_bytes:
        return None
    return ConfigError("MEMRT_BUDGET", f"{budget} ({budget.bytes} bytes)", f"at most {MAX_BUDGET_FACTOR} x the capacity of {device} "
                       f"({format_bytes(capacity_bytes)}); a share such as 85% follows each rank's device")


def parse_budget(name: str, raw: Any) -> Budget | None:
    """Budget from an int (bytes), a size string, a share ``"60%"``, or None/"" (no limit)."""
    if raw is None:
        return None
    if isinstance(raw, Budget):
        return raw
    if isinstance(raw, bool):
        raise ConfigError(name, raw, _SIZE_FORMS + ", or a share such as 60%")
    if isinstance(raw, int):
        if raw <= 0:
            raise ConfigError(name, raw, "a positive number of bytes")
        return Budget(bytes=raw)
    text = str(raw).strip()
    if text == "" or text.lower() in ("none", "unlimited"):
        return None
    m = _SHARE_RE.match(text)
    if m:
        exact = Fraction(m.group(1)) / 100
        if not _MIN_SHARE_EXACT <= exact <= 1:
            raise ConfigError(name, raw, f"a share from {_format_share(MIN_SHARE)} to 100%")
        return Budget(share=float(exact))
    try:
        return Budget(bytes=parse_size(name, text))
    except ConfigError:
        raise ConfigError(name, raw, _SIZE_FORMS + ", or a share such as 60%") from None


def parse_topology(name: str, raw: str) -> tuple[tuple[int, ...], ...]:
    """``"0,1;2,3"`` -> ((0, 1), (2, 3)): nodes as lists of global ranks, each rank once."""
    forms = "nodes separated by ';', ranks by ',', each rank once, e.g. 0,1;2,3"
    text = str(raw).strip()
    if not text:
        raise ConfigError(name, raw, forms)
    nodes: list[tuple[int, ...]] = []
    seen: set[int] = set()
    for part in text.split(";"):
        part = part.strip()
        if not part:
            raise ConfigError(name, raw, forms + " (empty node)")
        ranks = []
        for item in part.split(","):
            item = item.strip()
            if not _RANK_RE.fullmatch(item):
                raise ConfigError(name, raw, forms + f" ({item!r} is not a rank)")
            r = int(item)
            if r in seen:
                raise ConfigError(name, raw, forms + f" (rank {r} appears twice)")
            seen.add(r)
            ranks.append(r)
        nodes.append(tuple(ranks))
    if sorted(seen) != list(range(len(seen))):
        raise ConfigError(name, raw, forms + " (ranks must be 0..N-1 with none missing)")
    return tuple(nodes)


def _choice(choices: tuple[str, ...]):
    def parse(name: str, raw: str) -> str:
        v = str(raw).strip().lower()
        if v not in choices:
            raise ConfigError(name, raw, "one of " + "|".join(choices))
        return v

    return parse


def _auto_or_bool(name: str, raw: str) -> str:
    """``auto``, or a boolean as ``on`` / ``off``."""
    v = str(raw).strip().lower()
    if v == "auto":
        return v
    if v in _TRUE or v in _FALSE:
        return "on" if v in _TRUE else "off"
    raise ConfigError(name, raw, "auto or " + _BOOL_FORMS)


def _positive_int(name: str, raw: Any) -> int:
    """A whole number >= 1 (ASCII digits, or an int that is not a bool)."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    elif isinstance(raw, str) and _RANK_RE.fullmatch(raw.strip()):
        value = int(raw.strip())
    else:
        raise ConfigError(name, raw, "a positive whole number, e.g. 50")
    if value < 1:
        raise ConfigError(name, raw, "a positive whole number, e.g. 50")
    return value


def _path(name: str, raw: str) -> str:
    v = str(raw).strip()
    if not v or "\x00" in v:
        raise ConfigError(name, raw, "a directory path")
    return v


@dataclass(kw_only=True, slots=True)
class MemrtConfig:
    """memrt's effective settings, one field per ``MEMRT_*`` variable."""

    enabled: bool = False
    """MEMRT: switch memrt on in unchanged jobs (env activation). Default off."""
    budget: Budget | None = None
    """MEMRT_BUDGET: peak device bytes per training step; None plans for speed (no limit)."""
    offload: str = "auto"
    """MEMRT_OFFLOAD: auto|none|host|disk — which offload tiers the planner may use."""
    offload_dir: str | None = None
    """MEMRT_OFFLOAD_DIR: directory of the disk tier; None makes a private temp dir (0700)."""
    comm: str = "auto"
    """MEMRT_COMM: auto|flat|hier|off — collective algorithm choice; auto uses the cost model."""
    compress: str = "none"
    """MEMRT_COMPRESS: none|auto|bf16|fp16|int8 — compression of the inter-node hop of gradient reductions (DDP);
    auto = bf16 where the cost model predicts >= 10% gain."""
    topology: tuple[tuple[int, ...], ...] | None = None
    """MEMRT_TOPOLOGY: node grouping override, e.g. 0,1;2,3; None discovers it."""
    report_dir: str | None = None
    """MEMRT_REPORT_DIR: where per-rank reports go; None means ./memrt-report/<run id>/."""
    log_level: str = "warning"
    """MEMRT_LOG_LEVEL: debug|info|warning|error for memrt's loggers."""
    strict: bool = False
    """MEMRT_STRICT: raise instead of warning-and-continue when activation fails."""
    balance: str = "auto"
    """MEMRT_BALANCE: auto|on|off — speed-weighted shares of each global batch in DDP jobs (memrt.balance.auto)."""
    process_group: str = "auto"
    """MEMRT_PROCESS_GROUP: auto|on|off (or a boolean) — under MEMRT=1, run the job's gloo/nccl process group as
    memrt's own (every collective of DDP without a hook, FSDP2, DeviceMesh and plain calls through memrt.comm).
    auto: on unless the job's CUDA tensors would run on NCCL (that path awaits a GPU run); off keeps torch's own
    group (memrt then reaches DDP through its comm hook only)."""
    gc_freeze: bool = True
    """MEMRT_GC_FREEZE: under MEMRT=1, freeze the Python objects of the job's set-up before its first training step
    (:func:`gc.freeze`) so that the collector's full collections scan only newer ones (memrt.activation.collector);
    off leaves the collector alone."""
    sync: str = "exact"
    """MEMRT_SYNC: exact|diloco — exact: gradients averaged over every rank every step (stock DDP, bitwise);
    diloco: averaged within each node every step, and across nodes every MEMRT_SYNC_EVERY steps an outer
    Nesterov step on the nodes' averaged parameter change (memrt.sync; changes the optimization algorithm)."""
    sync_every: int = 50
    """MEMRT_SYNC_EVERY: inner (optimizer) steps between two outer steps under MEMRT_SYNC=diloco; >= 1."""
    sync_fragments: int = 1
    """MEMRT_SYNC_FRAGMENTS: K parameter fragments under MEMRT_SYNC=diloco, their outer steps spread over the round
    and each exchange overlapped with the next inner step (Streaming DiLoCo); >= 1, at most MEMRT_SYNC_EVERY;
    1: the whole model at once, blocking."""
    plan_out: str | None = None
    """MEMRT_PLAN_OUT: set by ``memrt plan``, not a user setting. A folder: each rank writes the memory frontier
    of its model's first profiled step there (memrt.activation.frontier) and the job stops at its next
    training step."""
    test_device_free: int | None = None
    """MEMRT_TEST_DEVICE_FREE: TEST ONLY, not a user setting. Bytes (or a size, 600MB): under MEMRT=1 without
    MEMRT_BUDGET, memrt plans as on a device with this much free memory, on any device (CPU included): the
    fit-the-device budget is this figure less the margin (memrt.memory.fit). None (unset) changes nothing."""
    cache_dir: str = field(default_factory=lambda: cache_dir())
    """Where memrt keeps what it measured once per machine (link and copy bandwidths): ``$XDG_CACHE_HOME/memrt``,
    else ``~/.cache/memrt``. Not a MEMRT_* variable: read from the environment with the settings."""
    torch_debug: str = field(default_factory=lambda: _torch_debug(environ()))
    """TORCH_DISTRIBUTED_DEBUG as torch reads it (OFF, INFO or DETAIL): INFO and DETAIL, like
    ``MEMRT_LOG_LEVEL=debug``, turn on memrt.comm's cross-rank argument check."""
    sources: dict[str, str] = field(default_factory=dict)
    """Variable name -> 'default' | 'environment' | 'argument' for every setting."""

    @property
    def debug(self) -> bool:
        """Debug checks on: ``MEMRT_LOG_LEVEL=debug`` or ``TORCH_DISTRIBUTED_DEBUG`` INFO / DETAIL."""
        return self.log_level == "debug" or self.torch_debug in ("INFO", "DETAIL")

    @property
    def measurement_dir(self) -> str:
        """Where measured link models are cached: ``MEMRT_REPORT_DIR`` when set, else :attr:`cache_dir`."""
        return self.report_dir or self.cache_dir

    def __post_init__(self) -> None:
        for fname, choices in (("offload", OFFLOAD_CHOICES), ("comm", COMM_CHOICES),
                               ("compress", COMPRESS_CHOICES), ("log_level", LOG_LEVELS),
                               ("balance", BALANCE_CHOICES), ("sync", SYNC_CHOICES)):
            if getattr(self, fname) not in choices:
                raise ConfigError(_FIELD_TO_VAR[fname], getattr(self, fname), "one of " + "|".join(choices))
        _positive_int("MEMRT_SYNC_EVERY", self.sync_every)
        _positive_int("MEMRT_SYNC_FRAGMENTS", self.sync_fragments)

    def effective(self) -> dict[str, dict[str, Any]]:
        """Variable name -> {"value": printable value, "source": where it came from}; a test-only setting
        (:data:`TEST_ONLY_VARIABLES`) only when it is set."""
        out = {}
        for var, fname in _VAR_TO_FIELD.items():
            if var in NOT_USER_VARIABLES and self.sources.get(var, "default") == "default":
                continue
            value = getattr(self, fname)
            if isinstance(value, Budget):
                value = str(value)
            elif fname == "topology" and value is not None:
                value = ";".join(",".join(map(str, n)) for n in value)
            out[var] = {"value": value, "source": self.sources.get(var, "default")}
        return out

    def agreed(self) -> dict[str, Any]:
        """Variable -> printable value of every setting all ranks must share (:data:`AGREED_VARIABLES`)."""
        effective = self.effective()
        return {var: effective[var]["value"] for var in AGREED_VARIABLES}


@dataclass(frozen=True, slots=True)
class Setting:
    """One ``MEMRT_*`` variable: the :class:`MemrtConfig` field it fills, its parser, and whether ranks must agree."""

    var: str
    """The environment variable, e.g. ``MEMRT_COMM``."""
    field: str
    """The MemrtConfig field it sets."""
    parse: Callable[[str, Any], Any]
    """``parse(var, raw) -> value``; raises ConfigError naming ``var``."""
    agree: bool = False
    """True when every rank of a job must use the same value (different values run different collectives
    or plans that must match): compared across ranks when the process group starts (:mod:`memrt.agreement`)."""
    test_only: bool = False
    """True for a testing aid that is not a user setting: not in README's settings table; the banner and
    ``memrt info`` show it only when it is set, marked test only."""
    set_by: str = ""
    """The memrt command that sets it (``memrt plan``), for a variable that is not a user setting: shown and
    left out of README's table as a test-only one, marked with the command."""


SETTINGS: tuple[Setting, ...] = (
    Setting("MEMRT", "enabled", parse_bool, agree=True),
    # Per rank on purpose: a share resolves against each rank's own device, and plans never change gradients.
    Setting("MEMRT_BUDGET", "budget", parse_budget),
    Setting("MEMRT_OFFLOAD", "offload", _choice(OFFLOAD_CHOICES), agree=True),
    Setting("MEMRT_OFFLOAD_DIR", "offload_dir", _path),
    Setting("MEMRT_COMM", "comm", _choice(COMM_CHOICES), agree=True),
    Setting("MEMRT_COMPRESS", "compress", _choice(COMPRESS_CHOICES), agree=True),
    Setting("MEMRT_TOPOLOGY", "topology", parse_topology, agree=True),
    Setting("MEMRT_REPORT_DIR", "report_dir", _path),
    Setting("MEMRT_LOG_LEVEL", "log_level", _choice(LOG_LEVELS)),
    Setting("MEMRT_STRICT", "strict", parse_bool),
    Setting("MEMRT_BALANCE", "balance", _choice(BALANCE_CHOICES), agree=True),
    Setting("MEMRT_PROCESS_GROUP", "process_group", _auto_or_bool, agree=True),
    Setting("MEMRT_GC_FREEZE", "gc_freeze", parse_bool),
    Setting("MEMRT_SYNC", "sync", _choice(SYNC_CHOICES), agree=True),
    Setting("MEMRT_SYNC_EVERY", "sync_every", _positive_int, agree=True),
    Setting("MEMRT_SYNC_FRAGMENTS", "sync_fragments", _positive_int, agree=True),
    Setting("MEMRT_PLAN_OUT", "plan_out", _path, set_by="memrt plan"),
    Setting("MEMRT_TEST_DEVICE_FREE", "test_device_free", parse_size, test_only=True),
)
"""Every setting, in the order memrt info and the banner show them. A new setting is one row here plus
its MemrtConfig field; ``agree=True`` makes start-up compare it across ranks."""

_PARSERS = {s.var: (s.field, s.parse) for s in SETTINGS}
_VAR_TO_FIELD = {s.var: s.field for s in SETTINGS}
_FIELD_TO_VAR = {f: var for var, f in _VAR_TO_FIELD.items()}
AGREED_VARIABLES = tuple(s.var for s in SETTINGS if s.agree)
"""Variables every rank of a job must set to the same value."""
TEST_ONLY_VARIABLES = tuple(s.var for s in SETTINGS if s.test_only)
"""Testing aids, not user settings (:attr:`Setting.test_only`)."""
NOT_USER_VARIABLES = {s.var: ("test only" if s.test_only else f"set by {s.set_by}") for s in SETTINGS
                      if s.test_only or s.set_by}
"""Variables that are not user settings (testing aids, or set by a memrt command) -> the mark the banner and
``memrt info`` show them with; both list them only when set."""
VARIABLES = tuple(_PARSERS)
"""Every MEMRT_* variable memrt understands."""

# Variables that are memrt's own but not settings (set by memrt for its child processes).
_INTERNAL = {"MEMRT_RUN_ID", "MEMRT_AUTOLOAD_ACTIVE", "MEMRT_FORCE_DEVICE_KIND", "MEMRT_CPU_CAP"}


def load_config(env: Mapping[str, str] | None = None, *, warn_unknown: bool = True, **overrides: Any) -> MemrtConfig:
    """Read every ``MEMRT_*`` variable from ``env`` (default: the process environment).

    Keyword overrides use field names (``budget="3GiB"``, ``comm="hier"``) and win over the
    environment. A bad value raises :class:`memrt.ConfigError` naming the variable.
    """
    env = environ() if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for var, (fname, parse) in _PARSERS.items():
        sources[var] = "default"
        if fname in overrides and overrides[fname] is not None:
            raw = overrides.pop(fname)
            values[fname] = raw if _already_typed(fname, parse, raw) else parse(var, raw)
            sources[var] = "argument"
        elif var in env and env[var].strip() != "":
            values[fname] = parse(var, env[var])
            sources[var] = "environment"
    values["cache_dir"] = overrides.pop("cache_dir", None) or cache_dir(env)
    values["torch_debug"] = _torch_debug(env)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if overrides:
        valid = [f.name for f in fields(MemrtConfig) if f.name not in ("sources", "torch_debug")]
        bad = next(iter(overrides))
        raise TypeError(f"load_config() got an unknown setting {bad!r}; valid settings: {', '.join(valid)}")
    if warn_unknown:
        for var in env:
            if var.startswith("MEMRT") and var not in _PARSERS and var not in _INTERNAL:
                close = difflib.get_close_matches(var, VARIABLES, n=1)
                hint = f"; did you mean {close[0]}?" if close else f"; known variables: {', '.join(VARIABLES)}"
                logger.warning("unknown memrt variable %s ignored%s", var, hint)
    return MemrtConfig(**values, sources=sources)


def _already_typed(fname: str, parse: Callable[[str, Any], Any], raw: Any) -> bool:
    if isinstance(raw, bool):  # every boolean setting (MEMRT, MEMRT_STRICT, and any added later)
        return parse is parse_bool
    if fname == "budget":
        return isinstance(raw, Budget)
    if fname == "topology":
        return isinstance(raw, tuple)
    if fname == "test_device_free":
        return isinstance(raw, int)
    return False


def internal_setting(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """memrt's own process-to-process variables (run id, forced device kind): not user settings."""
    if name not in _INTERNAL:
        raise KeyError(name)
    env = environ() if env is None else env
    return env.get(name)
