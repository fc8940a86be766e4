"""memrt.sync: how the ranks of a data-parallel job keep one model (``MEMRT_SYNC``).

``exact`` (default): stock DDP, gradients averaged over every rank every step; nothing here runs.
``diloco``: :func:`attach` makes gradients exact within a node every step and, across nodes, runs an outer
optimizer step on the nodes' averaged parameter change every ``MEMRT_SYNC_EVERY`` steps
(:mod:`memrt.sync.diloco`; docs/sections/sync.md).

    handle = memrt.sync.attach(ddp_model, optimizer)   # None unless MEMRT_SYNC=diloco on several nodes
    ... train ...
    if handle is not None:
        handle.finish()                                # one model on every rank
"""

from memrt.sync.diloco import DiLoCo, NodeMeanState, attach, node_mean_hook
from memrt.sync.outer import Fragment, OuterSGD, make_fragment

__all__ = ["DiLoCo", "Fragment", "NodeMeanState", "OuterSGD", "attach", "make_fragment", "node_mean_hook"]
