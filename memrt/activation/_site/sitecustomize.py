"""memrt run's start-up hook: switch memrt on, then run the sitecustomize this one shadows (if any).

``memrt run`` puts this folder first on PYTHONPATH, so every Python process of the command imports it
at start-up, as site.py imports any sitecustomize. Nothing here may break the interpreter.
"""

import importlib.util
import os
import sys


def _memrt_start():
    if os.environ.get("MEMRT", "").strip().lower() in ("", "0", "false", "off", "no"):
        return  # a child that switched memrt off again
    try:
        from memrt.activation.autoload import start
    except ImportError as e:
        sys.stderr.write("memrt: memrt run's start-up hook cannot import memrt (%s); running without it\n" % e)
        return
    start()


def _chain():
    """Import the next sitecustomize on sys.path (the one this module hides), as site.py would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved = list(sys.path)
    mine = sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        if importlib.util.find_spec("sitecustomize") is not None:
            import sitecustomize  # noqa: F401 - runs the user's own start-up code
    finally:
        chained = sys.modules.get("sitecustomize")
        sys.path[:] = saved
        if chained is None and mine is not None:
            sys.modules["sitecustomize"] = mine


_memrt_start()
_chain()
