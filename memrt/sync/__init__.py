"""memrt.sync: how the ranks of a data-parallel job keep one model (``MEMRT_SYNC``).

``exact`` (default): stock DDP, gradients averaged over every rank every step; nothing here runs.
``diloco``: :func:`attach` makes gradients exact within a node every step and, across nodes, runs an outer
optimizer step on the nodes' averaged parameter change every ``MEMRT_SYNC_EVERY`` steps
(:mod:`memrt.sync.diloco`; docs/sections/sync.md); ``MEMRT_SYNC_FRAGMENTS=K`` streams the model as K fragments
whose exchanges overlap the inner steps (Streaming DiLoCo).

    handle = memrt.sync.attach(ddp_model, optimizer)   # None unless MEMRT_SYNC=diloco on several nodes
    ... train ...
    if handle is not None:
        handle.finish()                                # one model on every rank
"""

from memrt.sync.diloco import DiLoCo, NodeMeanState, attach, node_mean_hook
from memrt.sync.outer import Fragment, OuterSGD, fragment_offsets, make_fragment, split_parameters

__all__ = ["DiLoCo", "Fragment", "NodeMeanState", "OuterSGD", "attach", "fragment_offsets", "make_fragment",
           "node_mean_hook", "split_parameters"]
