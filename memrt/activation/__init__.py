"""Env activation: ``MEMRT=1`` switches memrt on in an unchanged training job.

- :mod:`memrt.activation.autoload`: what the installed ``memrt-autoload.pth`` line (or ``memrt run``'s
  sitecustomize) calls when ``MEMRT`` is on: decides whether this process is a training process and
  registers a post-import hook on torch; imports no torch itself.
- :mod:`memrt.activation.hooks`: the post-import hook and the wrappers of ``init_process_group``,
  ``DistributedDataParallel`` construction and FSDP2 ``fully_shard``.
- :mod:`memrt.activation.session`: one activated process: run id, banner, memory plans, comm hook,
  report at exit.
- :mod:`memrt.activation.run`: ``memrt run -- <command>``.
- :mod:`memrt.activation.install`: the startup-hook files and :func:`autoload_installed`.

This package's ``__init__`` stays empty of imports: it is loaded at interpreter start-up when MEMRT is on.
"""

__all__: list[str] = []
