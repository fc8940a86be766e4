"""The startup-hook files memrt installs next to itself in site-packages, and a check that they are there.

Two files are installed at the top of site-packages (``purelib``), for regular and editable installs alike
(setup.py writes them; ``pip uninstall memrt`` removes them with the rest):

- ``memrt-autoload.pth``: one ``import`` line that reads ``MEMRT`` with the already-loaded ``os`` module and
  does nothing else when it is unset or off (no memrt module is imported, a few microseconds). When it is
  on, it imports :mod:`memrt.activation.autoload` and calls ``start()``; if memrt itself is gone (a stale
  .pth) it prints one line and the interpreter carries on.
- ``memrt-autoload.start`` (PEP 829, Python 3.15+): the entry point ``_memrt_startup:start``; where the
  .start file is honoured, the .pth's import line is skipped. ``_memrt_startup`` is a tiny top-level module
  (generated, no imports beyond ``os``) doing the same check.

The .pth line reads ``os.environ`` itself: it must not import memrt to decide (memrt/config.py is the only
other reader, and everything after the check goes through it).
"""

from __future__ import annotations

import site
import sys
from pathlib import Path

__all__ = ["PTH_NAME", "START_NAME", "STARTUP_MODULE", "pth_text", "start_text", "startup_module_text",
           "autoload_installed", "installed_paths"]

PTH_NAME = "memrt-autoload.pth"
START_NAME = "memrt-autoload.start"
STARTUP_MODULE = "_memrt_startup.py"

# MEMRT values that mean "off"; anything else goes to memrt.config, which rejects typos with a clear error.
_OFF = "('', '0', 'false', 'off', 'no')"

_ON_CODE = (
    "try:\\n from memrt.activation.autoload import start\\n"
    "except ImportError as e:\\n import sys\\n"
    " sys.stderr.write('memrt: MEMRT is set but memrt cannot be imported (%s); running without it\\\\n' % e)\\n"
    "else:\\n start()\\n"
)


def pth_text() -> str:
    """The single line of ``memrt-autoload.pth`` (site.py executes lines that start with ``import``)."""
    return (f"import os; os.environ.get('MEMRT', '').strip().lower() not in {_OFF} and "
            f"exec(\"{_ON_CODE}\")\n")


def start_text() -> str:
    """``memrt-autoload.start`` (PEP 829): one entry point."""
    return "_memrt_startup:start\n"


def startup_module_text() -> str:
    """``_memrt_startup.py``: the PEP 829 entry point, as cheap as the .pth line."""
    return (
        '"""memrt env activation entry point (PEP 829 .start file); does nothing unless MEMRT is on."""\n'
        "import os\n\n\n"
        "def start():\n"
        f"    if os.environ.get('MEMRT', '').strip().lower() in {_OFF}:\n"
        "        return\n"
        "    try:\n"
        "        from memrt.activation.autoload import start as memrt_start\n"
        "    except ImportError as e:\n"
        "        import sys\n"
        "        sys.stderr.write('memrt: MEMRT is set but memrt cannot be imported (%s); running without it\\n' % e)\n"
        "    else:\n"
        "        memrt_start()\n"
    )


def _site_dirs() -> list[Path]:
    dirs = []
    try:
        dirs += [Path(p) for p in site.getsitepackages()]
    except AttributeError:  # pragma: no cover - old virtualenv site.py
        pass
    try:
        dirs.append(Path(site.getusersitepackages()))
    except AttributeError:  # pragma: no cover
        pass
    dirs += [Path(p) for p in sys.path if p.endswith("site-packages")]
    seen, out = set(), []
    for d in dirs:
        key = str(d.resolve()) if d.exists() else str(d)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def installed_paths() -> list[Path]:
    """Every memrt startup-hook file present in this interpreter's site directories."""
    found = []
    for d in _site_dirs():
        for name in (PTH_NAME, START_NAME, STARTUP_MODULE):
            p = d / name
            if p.is_file():
                found.append(p)
    return found


def autoload_installed() -> bool:
    """True when ``memrt-autoload.pth`` with the current line is in a site directory of this interpreter."""
    for d in _site_dirs():
        p = d / PTH_NAME
        try:
            if p.is_file() and p.read_text() == pth_text():
                return True
        except OSError:
            continue
    return False
