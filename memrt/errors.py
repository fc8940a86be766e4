"""The exceptions memrt raises to users."""

from __future__ import annotations

from memrt.sizes import format_bytes

__all__ = ["AgreementError", "ConfigError", "BudgetError", "MemrtError", "note_degraded", "degraded"]


class MemrtError(RuntimeError):
    """Base class of memrt's own errors."""


class ConfigError(MemrtError, ValueError):
    """A setting (environment variable or argument) has a value memrt cannot use.

    The message names the setting, the bad value and the accepted forms, on one line.
    """

    def __init__(self, setting: str, value: object, expected: str) -> None:
        self.setting = setting
        self.value = value
        self.expected = expected
        super().__init__(f"{setting}={value!r} is not valid: expected {expected}")


class AgreementError(MemrtError):
    """The ranks of one job cannot run memrt together: a setting that must agree differs between ranks,
    a rank stopped on a bad setting, or a rank sent no settings (memrt off there). One line, naming the
    setting, the ranks and their values."""


class BudgetError(MemrtError):
    """No plan fits the memory budget; ``min_feasible_bytes`` is the smallest that does and
    ``keep_all_bytes`` (when the planner knows it) the peak with nothing recomputed or offloaded.
    ``source``: where a budget the user did not give came from (``fit the device: ...``), named in the message."""

    def __init__(self, budget_bytes: int, min_feasible_bytes: int, detail: str = "", *,
                 keep_all_bytes: int | None = None, source: str | None = None) -> None:
        self.budget_bytes = int(budget_bytes)
        self.min_feasible_bytes = int(min_feasible_bytes)
        self.keep_all_bytes = None if keep_all_bytes is None else int(keep_all_bytes)
        self.detail, self.source = detail, source
        msg = (
            f"memory budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is infeasible: the smallest "
            f"feasible budget is {format_bytes(min_feasible_bytes)} ({min_feasible_bytes} bytes); "
        )
        if source is None:
            msg += "raise MEMRT_BUDGET (or budget=) to at least that"
        else:
            msg = (f"no MEMRT_BUDGET, so the budget came from the device's free memory ({source}): {msg}"
                   f"free more memory on the device (that much plus the margin), or set MEMRT_BUDGET "
                   f"(e.g. MEMRT_BUDGET={min_feasible_bytes}) to plan for a budget of your own")
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


_DEGRADED: list[str] = []


def note_degraded(what: str) -> None:
    """Record that this process could not do what a setting asked and carried on without it (one line:
    the setting and why); the run summary counts these as failures."""
    _DEGRADED.append(what)


def degraded() -> list[str]:
    """What :func:`note_degraded` recorded in this process."""
    return list(_DEGRADED)
