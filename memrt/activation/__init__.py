"""Env activation: ``MEMRT=1`` switches memrt on in an unchanged training job.

- :mod:`memrt.activation.install`: the start-up files (``memrt-autoload.pth`` / ``.start``) and
  :func:`~memrt.activation.install.autoload_installed`.
- :mod:`memrt.activation.autoload`: what those files (or ``memrt run``'s sitecustomize) call when ``MEMRT``
  is on: decides whether this process is a training process and registers the post-import hook; no torch.
- :mod:`memrt.activation.hooks`: the post-import hook and the wrappers of ``init_process_group``,
  ``destroy_process_group``, ``DistributedDataParallel`` construction and FSDP2 ``fully_shard``.
- :mod:`memrt.activation.session`: one activated process: settings, run id, the failure policy.
- :mod:`memrt.activation.wiring`: memory plan and comm hook for a DDP model (per rank, agreed hook).
- :mod:`memrt.activation.report`: session start (banner) and the report at exit; :mod:`~memrt.activation.banner`.
- :mod:`memrt.activation.mpi`: the rendezvous address for unchanged torchrun scripts under mpiexec / srun.
- :mod:`memrt.activation.run`: ``memrt run -- <command>``.

This package's ``__init__`` imports nothing: it is loaded at interpreter start-up when MEMRT is on.
"""

__all__: list[str] = []
