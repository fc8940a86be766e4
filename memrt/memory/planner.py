"""Plan: per unit call, keep / recompute / offload, least added time with the step's peak under a budget.

Memory model (bytes; all figures from :class:`memrt.memory.profile.Profile`). Unit calls run in
order 0..n-1; the option ``a_k`` of call ``k`` leaves ``R_k(a_k)`` resident bytes from its forward to
its backward and ``F_k(a_k)`` in flight around its neighbour. Every peak of the step is a constraint on
the prefix sum ``P_k = R_0 + ... + R_{k-1}``:

- forward of unit k:   ``P_k + F_{k-1} + A_k + fwd_k(a_k) <= budget``
- backward of unit k:  ``P_k + F_{k-1} + Ab_k + R_k(a_k) + bwd_k(a_k) <= budget``
- any peak outside the units with k units resident (forward, head and loss, between backward units,
  optimizer): ``P_k + F_{k-1} + C <= budget``

(``A_k``, ``Ab_k``, ``C`` measured in step 1 with every unit recomputed, less the inputs those units
held; plus the state step 1 created, e.g. optimizer moments, for phases before the optimizer step.)
The exact solution is a dynamic programme over units whose state is the resident prefix in bytes (and
the in-flight bytes of the last option): for every reachable prefix it keeps the least added time
(a Pareto front, thinned to ``resolution`` points per front when it grows larger). The same programme
with ``max`` instead of ``+`` gives the smallest feasible budget. Options are :class:`UnitOption`s:
keep and recompute from here, offload ones from :func:`memrt.memory.offload.offload_options`; any
option kind plugs in without changes here.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from memrt.errors import BudgetError
from memrt.memory.options import UnitOption, option_sources
from memrt.memory.profile import Profile, UnitProfile

if TYPE_CHECKING:
    from memrt.config import MemrtConfig

__all__ = ["UnitOption", "UnitPlan", "Plan", "plan", "base_options", "min_feasible_budget"]

logger = logging.getLogger(__name__)
_INF = np.iinfo(np.int64).max // 4


@dataclass(kw_only=True, slots=True)
class UnitPlan:
    """The decision for one unit call."""

    name: str
    """Qualified module name."""
    action: str
    call: int = 0
    """Which call of the module within a step."""
    bytes_kept: int = 0
    """Bytes resident from the unit's forward to its backward."""
    bytes_freed: int = 0
    """Bytes the action frees compared with keeping (saved bytes less bytes kept)."""
    bytes_moved: int = 0
    """Bytes sent to host or disk per step."""
    added_seconds: float = 0.0
    """Predicted time the action adds to a step."""


@dataclass(kw_only=True, slots=True)
class Plan:
    """A plan for one (model, input shapes, device, budget); prints as a table, round-trips JSON."""

    units: list[UnitPlan] = field(default_factory=list)
    budget_bytes: int | None = None
    """The budget (None: no limit)."""
    predicted_peak_bytes: int = 0
    """Peak of one step under this plan, from the memory model."""
    measured_peak_bytes: int | None = None
    """Peak measured on the step after the plan came into force (None until measured)."""
    keep_all_peak_bytes: int = 0
    """Predicted peak with every unit kept (no memrt)."""
    min_feasible_bytes: int = 0
    """Smallest budget any plan fits."""
    margin_bytes: int = 0
    """Bytes held back from the budget when planning (grows after an overshoot)."""
    planning_seconds: float = 0.0
    tries: int = 1
    """Plans made for this key (re-plans after an overshoot count)."""
    untracked_bytes: int | None = None
    """CPU: resident bytes the process gained since ``memrt.auto`` beyond its tensors' growth, at the
    certified step's end (code and allocator memory loaded by the first steps, buffers outside torch);
    a peak RSS measured from outside exceeds the tensor peak by about this much. None: not measured."""
    resident_peak_bytes: int | None = None
    """CPU: the certified step's peak as the process's resident memory showed it (tensors live at the
    step's start + the rise of the kernel's high-water mark over the step); certification compares the
    higher of this and the tensor count with the budget. None: not measured, or the mark did not rise
    (an earlier moment of the process was higher), so the tensor count alone decided."""
    outside_over_budget_bytes: int | None = None
    """CPU: bytes by which the step's resident peak exceeded the budget while its tensors fitted, when no
    plan removed that excess (memory outside torch's tensors: library scratch, allocator memory); the plan
    was kept with a warning. None: the resident peak fitted, or was not read."""
    compiled_budget: float | None = None
    """A compiled graph's plan made by torch's partitioner: every unit called as it is, the whole
    graph partitioned under this ``activation_memory_budget`` (memrt.memory.compiled). None: the units'
    actions are the plan."""
    floor_trial: bool = False
    """True for every unit recomputed, put in force for a compiled step although the eager profile's model
    predicts it over the budget: its measured compiled step decides (memrt.memory.auto)."""
    shape_scale: float = 1.0
    """Factor the profile's activation bytes were scaled by, so that the plan holds for the largest input
    shape of its shape bucket (1.0: planned for the profiled shape)."""
    structure: str = ""
    signature: str = ""
    device: str = "cpu"

    def action_for(self, name: str, call: int = 0) -> str:
        for u in self.units:
            if u.name == name and u.call == call:
                return u.action
        return "keep"

    @property
    def added_seconds(self) -> float:
        return sum(u.added_seconds for u in self.units)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, text: str | dict) -> "Plan":
        d = json.loads(text) if isinstance(text, str) else dict(text)
        d["units"] = [UnitPlan(**u) for u in d.get("units", [])]
        return cls(**d)

    def __str__(self) -> str:
        mb = lambda n: f"{n / 2**20:.2f}"  # noqa: E731
        rows = [f"{'unit':<26} {'action':<22} {'kept MiB':>9} {'freed MiB':>9} {'moved MiB':>9} {'added ms':>9}"]
        for u in self.units:
            name = u.name + (f"#{u.call}" if u.call else "")
            rows.append(f"{name:<26} {u.action:<22} {mb(u.bytes_kept):>9} {mb(u.bytes_freed):>9} "
                        f"{mb(u.bytes_moved):>9} {u.added_seconds * 1e3:>9.2f}")
        budget = "none" if self.budget_bytes is None else f"{mb(self.budget_bytes)} MiB"
        measured = "-" if self.measured_peak_bytes is None else f"{mb(self.measured_peak_bytes)} MiB"
        if self.compiled_budget is not None:
            rows.append(f"compiled graph partitioned by torch under activation_memory_budget {self.compiled_budget}")
        rows.append(f"budget {budget}; peak predicted {mb(self.predicted_peak_bytes)} MiB, measured {measured}; "
                    f"keep-all {mb(self.keep_all_peak_bytes)} MiB; min feasible {mb(self.min_feasible_bytes)} MiB")
        return "\n".join(rows)


# ---------------------------------------------------------------------------------------------------
def base_options(u: UnitProfile) -> list[UnitOption]:
    """keep and recompute for one unit call."""
    keep = UnitOption(action="keep", resident_bytes=u.saved_bytes, added_seconds=0.0,
                      backward_transient_bytes=max(0, u.backward_transient_bytes - u.saved_not_input_bytes),
                      forward_transient_bytes=u.forward_keep_transient_bytes)
    if not u.has_backward:
        return [keep]
    rec = UnitOption(action="recompute", resident_bytes=u.input_bytes, added_seconds=u.forward_seconds,
                     backward_transient_bytes=max(u.backward_recompute_transient_bytes, u.backward_transient_bytes),
                     forward_transient_bytes=u.forward_recompute_transient_bytes)
    return [keep, rec]


OptionsFn = Callable[[UnitProfile], Sequence[UnitOption]]


@dataclass(slots=True)
class _Model:
    """Arrays of the memory model: per unit its options and constants; per prefix its constraint."""

    R: list[np.ndarray]
    T: list[np.ndarray]
    G: list[np.ndarray]
    F: list[np.ndarray]
    options: list[list[UnitOption]]
    C: np.ndarray  # (n + 1,) constraint on prefix k (excluding in-flight)
    fixed: int  # constraints independent of the plan (optimizer phase)


_TIE_SECONDS_PER_BYTE = 1e-15
"""Added to the cost of an ``offload_<tier>`` option per byte it moves (1 ns per MB): when the cost
model calls its transfers fully hidden (0 s, a bound rather than a measurement: the I/O still takes
memory bandwidth and, on CPU, a core), keeping the unit, which costs nothing, wins the tie; offload
is chosen where the budget needs it."""


def _moved(o: UnitOption) -> int:
    if not o.action.startswith("offload_"):
        return 0
    return int(o.moved_bytes) if o.moved_bytes is not None else max(0, int(o.backward_transient_bytes))


def _build(profile: Profile, options_fn: OptionsFn) -> _Model:
    shift = max(0, profile.end_live_bytes - profile.start_live_bytes)
    n = len(profile.units)
    C = np.full(n + 1, -_INF, dtype=np.int64)
    fixed = 0
    for c in profile.constraints:
        v = c.bytes + (shift if c.shifted else 0)
        if c.prefix == 0 and not c.shifted:
            fixed = max(fixed, v)
        C[min(c.prefix, n)] = max(C[min(c.prefix, n)], v)
    R, T, G, F, opts = [], [], [], [], []
    for u in profile.units:
        o = [x for x in options_fn(u)]
        if not o:
            raise ValueError(f"no options for unit {u.name!r}")
        r = np.array([x.resident_bytes for x in o], dtype=np.int64)
        fwd = np.array([x.forward_transient_bytes if x.forward_transient_bytes is not None else
                        u.forward_recompute_transient_bytes + x.inflight_bytes + max(0, x.resident_bytes - u.input_bytes)
                        for x in o], dtype=np.int64)
        g = u.forward_start_bytes + shift + fwd
        if u.has_backward:
            bwd = np.array([x.backward_transient_bytes for x in o], dtype=np.int64)
            g = np.maximum(g, u.backward_start_bytes + shift + r + bwd)
        R.append(r.copy())
        T.append(np.array([x.added_seconds + _TIE_SECONDS_PER_BYTE * _moved(x) for x in o], dtype=np.float64))
        G.append(g.astype(np.int64))
        F.append(np.array([x.inflight_bytes for x in o], dtype=np.int64))
        opts.append(o)
    # A storage that call k-1 saves (its output) and call k holds too (saved by its keep option, held as
    # input by recompute) is live once: the prefix counts it with call k, call k-1's own backward keeps it.
    for k in range(1, n):
        ov = profile.units[k].shared_with_previous_bytes
        if ov > 0 and all(o.action in ("keep", "recompute") for o in opts[k]):
            for j, o in enumerate(opts[k - 1]):
                if o.action == "keep":
                    R[k - 1][j] = max(0, R[k - 1][j] - ov)
    return _Model(R, T, G, F, opts, C, fixed)


def _prune(b: np.ndarray, cost: np.ndarray, inf: np.ndarray, resolution: int, span: int) -> np.ndarray:
    """Indices of the Pareto-optimal points (lower bytes, lower cost) per in-flight value, thinned."""
    if inf.size and inf.min() == inf.max():
        return _front(np.arange(len(b)), b, cost, resolution, span)
    return np.concatenate([_front(np.nonzero(inf == v)[0], b, cost, resolution, span) for v in np.unique(inf)])


def _front(idx: np.ndarray, b: np.ndarray, cost: np.ndarray, resolution: int, span: int) -> np.ndarray:
    order = idx[np.lexsort((cost[idx], b[idx]))]
    c = cost[order]
    run_min = np.minimum.accumulate(c)
    keep = np.empty(len(c), dtype=bool)
    keep[0] = True
    keep[1:] = c[1:] < run_min[:-1]
    order = order[keep]
    if len(order) > resolution:
        cell = (b[order] - b[order[0]]) * resolution // max(1, span)
        # within a cell keep the cheapest (the last one: cost falls as bytes grow along the front)
        last = np.nonzero(np.diff(np.append(cell, cell[-1] + 1)))[0]
        order = order[last]
    return order


def _solve(m: _Model, budget: int | None, mode: str, resolution: int) -> tuple[list[int], float] | None:
    """mode 'time': least added seconds under ``budget``; mode 'peak': least peak (budget ignored).

    Returns (option index per unit, objective) or None when infeasible.
    """
    B = _INF if budget is None or mode == "peak" else int(budget)
    n = len(m.R)
    b = np.zeros(1, dtype=np.int64)
    inf = np.zeros(1, dtype=np.int64)
    cost = np.array([float(m.fixed) if mode == "peak" else 0.0])
    span = max(1, int(sum(int(r.max()) for r in m.R)))
    parents: list[np.ndarray] = []
    choices: list[np.ndarray] = []
    for k in range(n):
        base = b + inf
        pre = base + m.C[k]
        ok_pre = pre <= B
        nb, nc, ninf, npar, nch = [], [], [], [], []
        for j in range(len(m.R[k])):
            level = base + m.G[k][j]
            ok = ok_pre & (level <= B)
            if not ok.any():
                continue
            sel = np.nonzero(ok)[0]
            nb.append(b[sel] + m.R[k][j])
            if mode == "peak":
                nc.append(np.maximum(cost[sel], np.maximum(level[sel], pre[sel]).astype(np.float64)))
            else:
                nc.append(cost[sel] + m.T[k][j])
            ninf.append(np.full(len(sel), m.F[k][j], dtype=np.int64))
            npar.append(sel)
            nch.append(np.full(len(sel), j, dtype=np.int64))
        if not nb:
            return None
        b, cost, inf = np.concatenate(nb), np.concatenate(nc), np.concatenate(ninf)
        par, ch = np.concatenate(npar), np.concatenate(nch)
        keep = _prune(b, cost, inf, resolution, span)
        b, cost, inf, par, ch = b[keep], cost[keep], inf[keep], par[keep], ch[keep]
        parents.append(par)
        choices.append(ch)
    final = b + inf + m.C[n]
    if mode == "peak":
        obj = np.maximum(cost, final.astype(np.float64))
        best = int(np.argmin(obj))
    else:
        ok = final <= B
        if m.fixed > B or not ok.any():
            return None
        obj = np.where(ok, cost, np.inf)
        best = int(np.argmin(obj))
    out = [0] * n
    i = best
    for k in range(n - 1, -1, -1):
        out[k] = int(choices[k][i])
        i = int(parents[k][i])
    return out, float(obj[best])


def _peak(m: _Model, pick: Sequence[int]) -> int:
    """Predicted peak of a choice (the timeline maximum of the model)."""
    p, prev_inf, peak = 0, 0, m.fixed
    for k, j in enumerate(pick):
        peak = max(peak, p + prev_inf + int(m.C[k]), p + prev_inf + int(m.G[k][j]))
        p += int(m.R[k][j])
        prev_inf = int(m.F[k][j])
    return int(max(peak, p + prev_inf + int(m.C[len(pick)])))


def _options_fn(profile: Profile, offload: str | None, bandwidths: Any, extra: OptionsFn | None,
                config: MemrtConfig | None = None) -> OptionsFn:
    proposed: list[OptionsFn] = []
    if offload not in (None, "none"):
        sources = option_sources()
        if not sources:
            raise ValueError(f"offload={offload!r}: no offload tiers are registered (import memrt.memory.offload)")
        for source in sources:
            fn_of_unit = source.propose(profile, offload, bandwidths, config)
            if fn_of_unit is not None:
                proposed.append(fn_of_unit)

    def fn(u: UnitProfile) -> list[UnitOption]:
        opts = base_options(u)
        if u.has_backward:
            for more in proposed:
                opts += list(more(u))
        if extra is not None:
            opts += list(extra(u))
        return opts

    return fn


def _expect_profile(api: str, profile: Any) -> None:
    if not isinstance(profile, Profile):
        raise TypeError(f"{api} expects a memrt.Profile (from memrt.profile, or Profile.from_json), "
                        f"got {type(profile).__name__}")


def min_feasible_budget(profile: Profile, *, offload: str | None = None, bandwidths: Any = None,
                        extra_options: OptionsFn | None = None, resolution: int = 2048,
                        config: MemrtConfig | None = None) -> int:
    """The smallest budget (bytes) under which some plan fits, by the memory model."""
    _expect_profile("memrt.memory.min_feasible_budget", profile)
    m = _build(profile, _options_fn(profile, offload, bandwidths, extra_options, config))
    res = _solve(m, None, "peak", resolution)
    assert res is not None
    return _peak(m, res[0])


def _plan_of(profile: Profile, m: _Model, pick: Sequence[int], budget: int | None, *, keep_all: int,
             min_feasible: int, margin_bytes: int, t0: float) -> Plan:
    """The Plan that takes option ``pick[k]`` for unit call k."""
    units = []
    for k, (u, j) in enumerate(zip(profile.units, pick)):
        o = m.options[k][j]
        moved = o.moved_bytes
        if moved is None:
            moved = max(0, u.saved_bytes - o.resident_bytes) if "offload" in o.action else 0
        units.append(UnitPlan(name=u.name, call=u.call, action=o.action, bytes_kept=int(o.resident_bytes),
                              bytes_freed=int(max(0, u.saved_bytes - o.resident_bytes)), bytes_moved=int(moved),
                              added_seconds=float(o.added_seconds)))
    return Plan(units=units, budget_bytes=None if budget is None else int(budget), predicted_peak_bytes=_peak(m, pick),
                keep_all_peak_bytes=keep_all, min_feasible_bytes=min_feasible, margin_bytes=margin_bytes,
                planning_seconds=time.perf_counter() - t0, structure=profile.structure,
                signature=profile.signature, device=profile.device)


def recompute_all_plan(profile: Profile, budget: int | None = None) -> Plan:
    """Every unit call that has a backward recomputed (the others kept), with the model's predictions."""
    t0 = time.perf_counter()
    m = _build(profile, base_options)
    pick = [len(opts) - 1 for opts in m.options]  # base_options: [keep] or [keep, recompute]
    best = _solve(m, None, "peak", 256)
    assert best is not None
    return _plan_of(profile, m, pick, budget, keep_all=_peak(m, [0] * len(m.R)), min_feasible=_peak(m, best[0]),
                    margin_bytes=0, t0=t0)


def plan(profile: Profile, budget: int | str | None = None, *, margin_bytes: int = 0, offload: str | None = None,
         bandwidths: Any = None, extra_options: OptionsFn | None = None, resolution: int = 512,
         config: MemrtConfig | None = None) -> Plan:
    """Least added time with the predicted peak <= ``budget - margin_bytes``.

    ``budget``: bytes, a size string ("3GiB"), or None (no limit: keep everything). ``offload``: None/"none"
    (keep and recompute only), "auto", "disk" or "host" (needs :mod:`memrt.memory.offload`). ``config``: the
    settings the offload tiers plan with (their folder, strict), default the environment's.
    Raises :class:`memrt.BudgetError` with the smallest feasible budget when none fits.
    """
    t0 = time.perf_counter()
    _expect_profile("memrt.plan", profile)
    if isinstance(budget, str):
        from memrt.config import parse_budget

        parsed = parse_budget("budget", budget)
        budget = None if parsed is None else parsed.resolve(None)
    m = _build(profile, _options_fn(profile, offload, bandwidths, extra_options, config))
    keep_all = _peak(m, [0] * len(m.R))
    # the least peak: a coarse front for the record; the full one only when it decides feasibility
    best_peak = _solve(m, None, "peak", min(resolution, 256))
    assert best_peak is not None
    min_feasible = _peak(m, best_peak[0])
    if budget is None:
        pick = [0] * len(m.R)
    else:
        target = int(budget) - int(margin_bytes)
        res = _solve(m, target, "time", resolution) if keep_all > target else ([0] * len(m.R), 0.0)
        if res is None:
            best_peak = _solve(m, None, "peak", 4 * resolution)
            assert best_peak is not None
            min_feasible = min(min_feasible, _peak(m, best_peak[0]))
        if res is None and min_feasible > target:
            raise BudgetError(int(budget), min_feasible + int(margin_bytes),
                              f"{len(m.R)} unit calls; keep-all peak {keep_all} bytes"
                              + (f"; {margin_bytes} bytes held back after a measured overshoot" if margin_bytes else ""),
                              keep_all_bytes=keep_all + int(margin_bytes))
        pick = res[0] if res is not None else best_peak[0]  # thinning can hide a fit the peak solve found
    result = _plan_of(profile, m, pick, budget, keep_all=keep_all, min_feasible=min_feasible,
                      margin_bytes=int(margin_bytes), t0=t0)
    if offload not in (None, "none") and not all(source.admit(result, config) for source in option_sources()):
        return plan(profile, budget, margin_bytes=margin_bytes, offload=offload, bandwidths=bandwidths,
                    extra_options=extra_options, resolution=resolution, config=config)
    return result
