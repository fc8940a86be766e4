"""Where a training step's time goes on this rank, measured on the main thread under ``MEMRT=1``.

A step is the time from one ``optimizer.step()``'s end to the next one's end (the first optimizer of the job
marks the steps). Inside it, every moment of the main thread is put in exactly one part, by the last event
seen (the parts add up to the step, each measured, not derived from the others):

- ``data``: inside a DataLoader iterator's ``__next__`` (waiting for the batch);
- ``forward``: inside the forward of a model memrt set up (DDP's, or the model a single process trains);
- ``backward``: from a forward's end to the last gradient the backward pass accumulates into a parameter
  of that model (autograd's post-accumulate-grad hooks mark it): the backward's compute;
- ``grad_wait``: from that last gradient to the next forward, batch or optimizer step: the end of the
  backward pass that waits for the gradient communication still in flight and for slower ranks (DDP's
  last buckets). The exit summary splits it across ranks into exposed communication and waiting for the
  slowest rank (:func:`split_grad_wait`);
- ``optimizer``: inside ``optimizer.step()``;
- ``other``: from a step's end to its next batch or forward, and from a batch to its forward (``zero_grad``,
  logging, the script's own work).

Steps 1 and 2 are memrt's profiling and planning steps when a memory plan is on: :meth:`StepClock.summary`
leaves out the first ``SKIP`` steps when the job ran more than that. Costs per step: a few ``perf_counter``
calls and list appends, and one ``perf_counter`` per parameter's gradient.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["StepClock", "PARTS", "SKIP", "start_clock", "time_forward", "split_grad_wait"]

PARTS = ("data", "forward", "backward", "grad_wait", "optimizer", "other")
SKIP = 2
"""Leading steps left out of the means (memrt's profile and plan steps) when the job ran more."""


class StepClock:
    """The per-step split of one rank (see the module docstring). Main thread only; not thread-safe."""

    def __init__(self) -> None:
        self._part = "other"
        self._since: float | None = None
        self._current = dict.fromkeys(PARTS, 0.0)
        self.steps: list[dict[str, float]] = []
        """Finished steps, each ``{part: seconds}`` plus ``"step"``: its wall time."""
        self._depth = 0
        self._optimizer: Any = None
        self._last_grad: float | None = None

    def _switch(self, part: str) -> None:
        now = time.perf_counter()
        if self._since is not None:
            last = self._last_grad
            if self._part == "backward" and last is not None and self._since <= last <= now:
                self._current["backward"] += last - self._since
                self._current["grad_wait"] += now - last
            else:
                self._current[self._part] += now - self._since
        self._since, self._part, self._last_grad = now, part, None

    # ---- events
    def data_begin(self) -> None:
        if self._depth == 0:
            self._switch("data")

    def data_end(self) -> None:
        if self._depth == 0:
            self._switch("other")

    def forward_begin(self) -> None:
        if self._depth == 0:
            self._switch("forward")
        self._depth += 1

    def forward_end(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self._switch("backward")

    def grad_ready(self, _param: Any = None) -> None:
        """A gradient was accumulated into a parameter (the latest one ends the backward's compute)."""
        self._last_grad = time.perf_counter()

    def optimizer_begin(self, optimizer: Any) -> None:
        if self._optimizer is None:
            self._optimizer = optimizer  # the job's first optimizer to step marks the steps
        if optimizer is self._optimizer:
            self._switch("optimizer")

    def optimizer_end(self, optimizer: Any) -> None:
        if optimizer is not self._optimizer:
            return
        first = self._since is None
        self._switch("other")
        if first:
            return
        done = self._current
        total = sum(done.values())
        if total > 0 and any(done[p] for p in ("data", "forward", "backward")):
            self.steps.append({**done, "step": total})
        self._current = dict.fromkeys(PARTS, 0.0)

    def start(self) -> None:
        """Begin timing now (the session's start): time before the first step counts in the first step."""
        if self._since is None:
            self._since = time.perf_counter()

    # ---- results
    def summary(self) -> dict[str, Any] | None:
        """Mean seconds per step of each part and of the step, over the steps after the first SKIP (all of
        them when there were no more); None before a step ended."""
        steps = self.steps[SKIP:] if len(self.steps) > SKIP else self.steps
        if not steps:
            return None
        n = len(steps)
        out: dict[str, Any] = {p: sum(s[p] for s in steps) / n for p in (*PARTS, "step")}
        out["steps"] = len(self.steps)
        out["steps_averaged"] = n
        return out


def start_clock() -> StepClock:
    """A clock running from now, with the global optimizer step hooks that mark its steps (torch keeps them
    for the process's life; they cost two calls per ``optimizer.step()``)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    clock = StepClock()
    clock.start()
    register_optimizer_step_pre_hook(lambda opt, _args, _kwargs: clock.optimizer_begin(opt))
    register_optimizer_step_post_hook(lambda opt, _args, _kwargs: clock.optimizer_end(opt))
    return clock


def time_forward(clock: StepClock, module: Any) -> None:
    """Count ``module``'s forward (a model memrt set up) in the clock's ``forward`` part, and mark each
    gradient its backward accumulates (the end of the backward's compute)."""
    module.register_forward_pre_hook(lambda _m, _args: clock.forward_begin())
    module.register_forward_hook(lambda _m, _args, _out: clock.forward_end())
    for p in module.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(clock.grad_ready)


def split_grad_wait(steps: list[dict[str, float]]) -> list[tuple[float, float]]:
    """Each rank's ``grad_wait`` (mean seconds per step, from :meth:`StepClock.summary`) split into
    (exposed communication, waiting for the slowest rank).

    A rank reaches its last gradient after ``step - grad_wait`` seconds of its own work; the last buckets'
    all-reduce cannot finish before the slowest rank gets there, so a rank waits ``max over ranks of (step -
    grad_wait) - its own``, at most its whole ``grad_wait``; the rest is communication that compute did not
    hide. An estimate from means: it assumes the same rank is the slowest in every step.
    """
    own = [s["step"] - s["grad_wait"] for s in steps]
    slowest = max(own, default=0.0)
    out = []
    for s, work in zip(steps, own):
        wait = min(s["grad_wait"], max(0.0, slowest - work))
        out.append((s["grad_wait"] - wait, wait))
    return out
