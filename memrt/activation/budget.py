"""The budget a model gets under ``MEMRT=1``, and the words the banner and the exit summary say about it.

- ``MEMRT_BUDGET`` set: that budget (a share resolves on the model's device in ``memrt.auto``).
- Unset, the model on a GPU: fit the device (:mod:`memrt.memory.fit`): the free memory when memrt attaches
  plus what this process reserves, less the margin. Measured once per device and session, so that two models
  of one process (a GAN's) plan for the same figure. A step that fits keeps everything (the planner's keep-all
  plan); one that does not gets a plan that fits; one whose floor (every unit recomputed) does not fit gets
  the planner's :class:`memrt.BudgetError`, told where the budget came from (:func:`explain_error`).
- Unset, the model on a CPU: no memory plan (no device capacity to fit); the exit summary says so in one line.
- ``MEMRT_TEST_DEVICE_FREE`` (test only): fit the device as if it had that much free memory, on any device.
"""

from __future__ import annotations

from typing import Any

from memrt.config import MemrtConfig
from memrt.errors import BudgetError
from memrt.memory.fit import DeviceFit, device_fit

__all__ = ["CPU_NO_PLAN", "UNSET", "model_budget", "banner_value", "explain_error", "budget_lines"]

CPU_NO_PLAN = "none: no MEMRT_BUDGET on CPU, no memory plan (set MEMRT_BUDGET=60% to plan)"
"""What the exit summary says of a model on a CPU without MEMRT_BUDGET."""
UNSET = "unset: fit the GPU's free memory (CPU: no plan)"
"""MEMRT_BUDGET's value in the banner when unset and the model's device is not known yet (a distributed job's
banner is printed at init_process_group, before memrt sees the model)."""


def _fit(sess: Any, device: str) -> DeviceFit | None:
    """The session's fit-the-device budget for ``device`` (measured at its first model, then kept)."""
    if device not in sess.fits:
        sess.fits[device] = device_fit(device, test_free_bytes=sess.config.test_device_free)
    return sess.fits[device]


def model_budget(sess: Any, device: str | None, entry: dict[str, Any]) -> tuple[Any, DeviceFit | None]:
    """(the budget to give ``memrt.auto`` for a model on ``device``, its fit-the-device figures or None); where
    the budget came from goes in the model's report ``entry`` (``budget_source``) when MEMRT_BUDGET is unset."""
    config: MemrtConfig = sess.config
    if config.budget is not None or device is None:
        return config.budget, None
    fit = _fit(sess, device)
    if fit is None:  # not a GPU: memrt.auto without a budget keeps everything and measures one step per shape
        if device.startswith("cpu"):
            entry["budget_source"] = CPU_NO_PLAN
        return None, None
    entry["budget_source"] = fit.describe()
    entry["budget_fit"] = fit.to_dict()
    return fit.budget_bytes, fit


def banner_value(sess: Any, device: str | None = None) -> str | None:
    """MEMRT_BUDGET's value in the banner when it is unset (None when set): the fit-the-device figures when the
    model's device is known (a single process) or a test figure stands in for it, else :data:`UNSET`."""
    config: MemrtConfig = sess.config
    if config.budget is not None:
        return None
    if device is None and config.test_device_free is not None:
        device = "cpu"  # the test figure stands in for any device
    if device is None:
        return UNSET
    fit = _fit(sess, device)
    return fit.describe() if fit is not None else CPU_NO_PLAN


def explain_error(exc: BaseException, fit: DeviceFit | None) -> BaseException:
    """The planner's error for a model under a fit-the-device budget, told where that budget came from and
    how to set one (``exc`` itself otherwise)."""
    if fit is None or not isinstance(exc, BudgetError) or exc.source is not None:
        return exc
    told = BudgetError(exc.budget_bytes, exc.min_feasible_bytes, exc.detail, keep_all_bytes=exc.keep_all_bytes,
                       source=fit.describe())
    told.__cause__ = exc
    return told


def budget_lines(summaries: list[dict[str, Any]]) -> list[str]:
    """The exit summary's budget line(s) when MEMRT_BUDGET was unset: one when every rank says the same,
    else one per rank."""
    said = {s["rank"]: s["budget_source"] for s in summaries if s.get("budget_source")}
    if not said:
        return []
    if len(set(said.values())) == 1 and len(said) == len(summaries):
        return [f"memrt: budget  {next(iter(said.values()))}"]
    return [f"memrt: budget  rank {rank}: {text}" for rank, text in sorted(said.items())]
