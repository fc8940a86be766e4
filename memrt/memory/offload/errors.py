"""The offload engine's error."""

from __future__ import annotations

from memrt.errors import MemrtError

__all__ = ["OffloadError"]


class OffloadError(MemrtError):
    """Offloading failed (directory unwritable or full, corrupt read, I/O error); the message names the directory."""
