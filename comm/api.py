"""The drop-in torch.distributed surface: same names and signatures, topology-aware where it helps.

Collectives on the default group go through memrt (choice of algorithm per call, a CommRecord per
call, peer-failure diagnosis); calls on other groups, and every name memrt does not define, go
straight to torch.distributed. memrt's own algorithms run on one worker thread in call order, so
``async_op=True`` returns a real waitable :class:`MemrtWork` and ordering across ranks is kept.

Set-up and teardown live in :mod:`memrt.comm.setup`, how one call runs (choice, thread, record) in
:mod:`memrt.comm.dispatch`; this module holds the collectives themselves.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
import torch.distributed as tdist

from memrt.comm import fusion
from memrt.comm import hierarchical as alg
from memrt.comm.dispatch import (check_arguments, compressed_inter_hop, compressed_inter_scatter, decide, measure_trial,
                                 on_world, run_flat, run_own)
from memrt.comm.reduction import REDUCE_OPS, op_name
from memrt.comm.select import Decision
from memrt.comm.setup import (STATE, comm_mode, destroy_process_group, ensure, get_topology, init_process_group,
                              let_backend_threads_finish, prepare, set_checks, settings, setup_topology,
                              use_collectives)
from memrt.comm.work import MemrtWork

__all__ = ["init_process_group", "destroy_process_group", "get_topology", "setup_topology", "all_reduce",
           "all_reduce_with", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
           "reduce_scatter_tensor", "reduce_scatter_single", "MemrtWork", "set_checks", "prepare", "comm_mode",
           "let_backend_threads_finish", "settings"]


def all_reduce(tensor: torch.Tensor, op: Any = tdist.ReduceOp.SUM, group: Any = None, async_op: bool = False, *,
               compress: str | None = None):
    """torch.distributed.all_reduce; hierarchical (pipelined) when the topology and size make it pay.

    Exact unless ``compress`` ("bf16", "fp16", "int8", or "auto": bf16 where the cost model predicts
    a gain of at least 10%) asks to compress the inter-node hop of this call; ``MEMRT_COMPRESS`` alone
    applies to gradient reductions (the DDP hook), never to a plain call. No error feedback here: a
    call's own result only (see :func:`memrt.comm.register_ddp_hook` for gradients).
    """
    if compress is not None:
        from memrt.comm.compress import check_compress

        check_compress(compress, "compress")
    elif on_world(group):  # back-to-back small async calls are coalesced
        fused = fusion.intercept(tensor, op, async_op)
        if fused is not None:
            return fused
    return all_reduce_with(tensor, op, group, async_op, codec=compress)


def all_reduce_with(tensor: torch.Tensor, op: Any, group: Any, async_op: bool, *, key: Any = None,
                    codec: str | None = None, flat: Callable[[], Any] | None = None):
    """:func:`all_reduce` without fusion, for memrt's own callers (the DDP hook, fused buffers, the backend).

    ``codec``: compression of the inter hop asked by the caller (None/'none': exact); ``key``: the
    caller's gradient buffer (a compress.FeedbackKey) for error feedback, None for none; ``flat``: how to
    run the flat algorithm when it is chosen (memrt's process group: its real backend's call, returning a
    Work, without a second trip through torch.distributed), default torch.distributed's all_reduce."""
    if not on_world(group):
        return tdist.all_reduce(tensor, op, group, async_op)
    ensure(tensor.device)
    try:
        opn = op_name(op)
    except ValueError:  # PREMUL_SUM, BAND, ...: torch's
        return tdist.all_reduce(tensor, op, group, async_op)
    alg.check_reducible(tensor, opn)
    nbytes = tensor.numel() * tensor.element_size()
    if STATE.checks:
        check_arguments("all_reduce", tensor, STATE.check_group, extra=REDUCE_OPS.index(opn))
    d = decide("all_reduce", nbytes, tensor.dtype, op, compress=codec)
    if d.algorithm == "off":
        return tdist.all_reduce(tensor, op, group, async_op)
    if STATE.mpi is not None and tensor.device.type == "cpu":
        mpi = Decision(algorithm=d.algorithm, via="mpi", predicted_seconds=d.predicted_seconds)
        return run_own("all_reduce", tensor, nbytes, mpi,
                       lambda: STATE.mpi.all_reduce(tensor, opn, algorithm=d.algorithm), async_op, [tensor],
                       opn.lower())
    if d.algorithm == "hier":
        plug = compressed_inter_hop(d.codec, key, tensor.data_ptr())
        chunk = None
        if d.codec is not None:
            from memrt.comm.compress import pipeline_chunk_bytes

            chunk = pipeline_chunk_bytes(d.codec, nbytes)
        return run_own("all_reduce", tensor, nbytes, d,
                       lambda: alg.hierarchical_all_reduce(tensor, opn, STATE.topology, inter_all_reduce=plug,
                                                           groups=STATE.groups, chunk_bytes=chunk),
                       async_op, [tensor], opn.lower())
    return run_flat("all_reduce", tensor, nbytes, flat or (lambda: tdist.all_reduce(tensor, op, group, async_op)),
                    async_op, d.predicted_seconds, opn.lower(), d.reason)


_FLAT_MPI = Decision(algorithm="flat", via="mpi")
"""memrt's MPI backend runs the call (CPU tensors under ``init_process_group(backend="mpi")``)."""


def broadcast(tensor: torch.Tensor, src: int | None = None, group: Any = None, async_op: bool = False,
              group_src: int | None = None):
    """torch.distributed.broadcast; across nodes once then inside each node when that pays."""
    if not on_world(group) or group_src is not None or src is None:
        return tdist.broadcast(tensor, src, group, async_op, group_src=group_src)
    ensure(tensor.device)
    nbytes = tensor.numel() * tensor.element_size()
    if STATE.checks:
        check_arguments("broadcast", tensor, STATE.check_group, extra=src)
    if STATE.mpi is not None and tensor.device.type == "cpu":
        return run_own("broadcast", tensor, nbytes, _FLAT_MPI, lambda: STATE.mpi.broadcast(tensor, src), async_op,
                       [tensor])
    choice = decide("broadcast", nbytes, tensor.dtype, src=src)
    if choice.algorithm == "off":
        return tdist.broadcast(tensor, src, group, async_op)

    def hier() -> None:
        alg.hierarchical_broadcast(tensor, src, STATE.topology, groups=STATE.groups)

    choice = measure_trial(choice, tensor, {"flat": lambda: tdist.broadcast(tensor, src, group), "hier": hier})
    if choice.algorithm == "hier":
        return run_own("broadcast", tensor, nbytes, choice, hier, async_op, [tensor])
    return run_flat("broadcast", tensor, nbytes, lambda: tdist.broadcast(tensor, src, group, async_op), async_op,
                    choice.predicted_seconds, reason=choice.reason)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False):
    """torch.distributed.all_gather_into_tensor; inter-node first then intra-node on equal nodes."""
    flat_fn = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
    if not on_world(group):
        return flat_fn(output_tensor, input_tensor, group, async_op)
    ensure(input_tensor.device)
    nbytes = input_tensor.numel() * input_tensor.element_size()
    if STATE.checks:
        check_arguments("all_gather", input_tensor, STATE.check_group)
    if STATE.mpi is not None and input_tensor.device.type == "cpu":
        return run_own("all_gather", input_tensor, nbytes, _FLAT_MPI,
                       lambda: STATE.mpi.all_gather_into_tensor(output_tensor, input_tensor), async_op,
                       [output_tensor])
    # memrt's path writes a contiguous output in place; any other output takes torch's call
    choice = (decide("all_gather", nbytes, input_tensor.dtype) if output_tensor.is_contiguous()
              else Decision(algorithm="flat"))
    if choice.algorithm == "off":
        return flat_fn(output_tensor, input_tensor, group, async_op)

    def hier() -> None:
        alg.hierarchical_all_gather(output_tensor, input_tensor, STATE.topology, groups=STATE.groups)

    choice = measure_trial(choice, input_tensor, {"flat": lambda: flat_fn(output_tensor, input_tensor, group),
                                                  "hier": hier})
    if choice.algorithm == "hier":
        return run_own("all_gather", input_tensor, nbytes, choice, hier, async_op, [output_tensor])
    return run_flat("all_gather", input_tensor, nbytes, lambda: flat_fn(output_tensor, input_tensor, group, async_op),
                    async_op, choice.predicted_seconds if choice.algorithm == "flat" else None, reason=choice.reason)


all_gather_single = all_gather_into_tensor


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False):
    """torch.distributed.all_gather; equal-shape lists take the hierarchical path when it pays."""
    if not on_world(group) or any(t.shape != tensor.shape or t.dtype != tensor.dtype for t in tensor_list):
        return tdist.all_gather(tensor_list, tensor, group, async_op)
    ensure(tensor.device)
    nbytes = tensor.numel() * tensor.element_size()
    choice = decide("all_gather", nbytes, tensor.dtype) if STATE.mpi is None else Decision(algorithm="flat")
    if choice.algorithm == "off":
        return tdist.all_gather(tensor_list, tensor, group, async_op)
    if STATE.checks and (choice.algorithm == "hier" or choice.trial is not None):  # torch's call checks its own
        check_arguments("all_gather", tensor, STATE.check_group)

    def hier() -> None:
        out = torch.empty(len(tensor_list) * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        alg.hierarchical_all_gather(out, tensor, STATE.topology, groups=STATE.groups)
        for i, t in enumerate(tensor_list):
            t.copy_(out[i * tensor.numel():(i + 1) * tensor.numel()].view(tensor.shape))

    choice = measure_trial(choice, tensor, {"flat": lambda: tdist.all_gather(tensor_list, tensor, group),
                                            "hier": hier})
    if choice.algorithm != "hier":
        return run_flat("all_gather", tensor, nbytes, lambda: tdist.all_gather(tensor_list, tensor, group, async_op),
                        async_op, choice.predicted_seconds, reason=choice.reason)
    return run_own("all_gather", tensor, nbytes, choice, hier, async_op, list(tensor_list))


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = tdist.ReduceOp.SUM,  # noqa: A002
                          group: Any = None, async_op: bool = False, *, compress: str | None = None,
                          key: Any = None):
    """torch.distributed.reduce_scatter_tensor; intra-node then inter-node on equal nodes.

    Exact unless ``compress`` ("bf16", "fp16", "int8", or "auto") asks to compress what crosses the slow
    link (floating-point SUM / AVG on two or more equal nodes; the intra-node stage stays exact). ``key``:
    the gradient buffer this call reduces (a :class:`memrt.comm.compress.FeedbackKey`, e.g. one FSDP2
    parameter group), for error feedback; None for none."""
    flat_fn = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor
    if compress is not None:
        from memrt.comm.compress import check_compress

        check_compress(compress, "compress")
    if not on_world(group):
        return flat_fn(output, input, op, group, async_op)
    ensure(input.device)
    opn = op_name(op)
    alg.check_reducible(input, opn)
    nbytes = input.numel() * input.element_size()
    if STATE.checks:
        check_arguments("reduce_scatter", input, STATE.check_group, extra=REDUCE_OPS.index(opn))
    if STATE.mpi is not None and input.device.type == "cpu":
        return run_own("reduce_scatter", input, nbytes, _FLAT_MPI,
                       lambda: STATE.mpi.reduce_scatter_tensor(output, input, opn), async_op, [output], opn.lower())
    topo = STATE.topology
    d = decide("reduce_scatter", nbytes, input.dtype, op, compress=compress, compressible=output.is_contiguous())
    if d.algorithm == "off":
        return flat_fn(output, input, op, group, async_op)
    if d.algorithm == "hier" and output.is_contiguous():
        plug = compressed_inter_scatter(d.codec, key)
        return run_own("reduce_scatter", input, nbytes, d,
                       lambda: alg.hierarchical_reduce_scatter(output, input, opn, topo, groups=STATE.groups,
                                                               inter_reduce_scatter=plug),
                       async_op, [output], opn.lower())
    return run_flat("reduce_scatter", input, nbytes, lambda: flat_fn(output, input, op, group, async_op), async_op,
                    d.predicted_seconds if d.algorithm == "flat" else None, opn.lower(), d.reason)


reduce_scatter_single = reduce_scatter_tensor

fusion.use_all_reduce(all_reduce_with)  # fused buffers go through memrt's all-reduce
use_collectives(sys.modules[__name__])  # the link probe times memrt's algorithms through these collectives
