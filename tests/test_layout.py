"""The project's shape: import contracts (.importlinter), names that do not shadow torch's, one of each helper.

import-linter runs over a copy of the package as it installs (``comm/`` and ``profiling/`` become
``memrt.comm`` and ``memrt.profiling``), so the contracts see the same modules a user imports.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from memrt.testing import venv_bin

REPO = Path(__file__).resolve().parent.parent
CONTRACTS = REPO / ".importlinter"
SOURCES = ("memrt", "comm", "profiling", "benchmarks", "tests", "examples")


def _installed_copy(root: Path) -> Path:
    """``root/memrt``: memrt/, comm/ and profiling/ laid out as the installed package."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "memrt", root / "memrt", ignore=skip)
    shutil.copytree(REPO / "comm", root / "memrt" / "comm", ignore=skip)
    shutil.copytree(REPO / "profiling", root / "memrt" / "profiling", ignore=skip)
    return root


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([venv_bin("lint-imports"), str(CONTRACTS), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def _names() -> list[str]:
    return re.findall(r"^name = (.+)$", CONTRACTS.read_text(), re.M)


def test_import_contracts_hold(tmp_path):
    proc = _lint(_installed_copy(tmp_path))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    out = " ".join(proc.stdout.split())
    for name in _names():
        assert f"{name} KEPT" in out, f"contract {name!r} not reported kept:\n{proc.stdout[-3000:]}"


@pytest.mark.parametrize("module, line, contract", [
    ("memory/units.py", "import memrt.comm.topology", "layers"),  # memory and comm are independent
    ("profiling/recorder.py", "import memrt.memory.planner", "layers"),  # profiling is below memory
    ("comm/costmodel.py", "import memrt.testing.models", "the library never imports"),
    ("errors.py", "import memrt.config", "no import cycles"),  # config imports errors
    ("comm/reduction.py", "import memrt.comm.tiers", "no import cycles"),  # tiers imports reduction
    ("memory/planner.py", "import memrt.memory.offload.folder", "the planner and the plan applier"),  # through the registry
])
def test_import_contracts_catch_a_violation(tmp_path, module, line, contract):
    root = _installed_copy(tmp_path)
    path = root / "memrt" / module
    path.write_text(path.read_text() + f"\n{line}  # injected by the test\n")
    proc = _lint(root)
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0, f"{line} in {module} broke no contract:\n{proc.stdout[-3000:]}"
    broken = [n for n in _names() if f"{n} BROKEN" in out]
    assert any(n.startswith(contract) for n in broken), f"{contract!r} not broken by {line} in {module}: {broken}"


def test_memrt_comm_submodules_do_not_shadow_torch_distributed():
    import pkgutil

    import torch.distributed

    import memrt.comm

    torch_names = set(dir(torch.distributed)) | {m.name for m in pkgutil.iter_modules(torch.distributed.__path__)}
    ours = {m.name for m in pkgutil.iter_modules(memrt.comm.__path__)}
    assert not ours & torch_names, f"memrt.comm submodules hide torch.distributed names: {sorted(ours & torch_names)}"
    # the drop-in surface reaches torch's subpackages
    assert memrt.comm.algorithms is torch.distributed.algorithms
    assert memrt.comm.algorithms.Join is torch.distributed.algorithms.Join
    assert memrt.comm.fsdp.fully_shard is torch.distributed.fsdp.fully_shard


def _python_files():
    for top in SOURCES:
        for path in sorted((REPO / top).rglob("*.py")):
            if ".venv" not in path.parts and path != Path(__file__).resolve():
                yield path


def test_one_port_rule_and_one_byte_formatter():
    ports, formatters = [], []
    for path in _python_files():
        text = path.read_text()
        rel = path.relative_to(REPO).as_posix()
        if re.search(r"\.bind\(\(.*,\s*0\)\)", text):
            ports.append(rel)
        if re.search(r"\(\s*\"B\",\s*\"KiB\"", text):
            formatters.append(rel)
    assert ports == ["memrt/launcher.py"], f"free ports picked outside memrt.launcher.free_port: {ports}"
    assert formatters == ["memrt/sizes.py"], f"bytes formatted outside memrt.sizes.format_bytes: {formatters}"


def test_only_the_core_reads_the_environment():
    """Outside memrt/config.py the library only writes variables (for torch's env:// reader, child processes);
    the start-up stubs that decide whether to import memrt at all read MEMRT themselves."""
    readers = {"memrt/config.py", "memrt/activation/install.py", "memrt/activation/_site/sitecustomize.py"}
    write = re.compile(r"os\.environ(\[[^\]]+\]\s*=[^=]|\.setdefault\(|\.update\(|\.pop\()")
    found = []
    for top in ("memrt", "comm", "profiling"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel in readers:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if re.search(r"os\.getenv|os\.environ", code) and not write.search(code):
                    found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "environment read outside memrt.config:\n" + "\n".join(found)


def test_one_of_each_shared_rule():
    """One definition of each rule the project shares: the rank launcher, the free port, the byte format,
    nccl-tests' busbw factor, the bytes a call sends per tier."""
    homes = {"launch_ranks": ["memrt/testing/launch.py"], "free_port": ["memrt/launcher.py"],
             "format_bytes": ["memrt/sizes.py"], "busbw_factor": ["profiling/comm_log.py"],
             "tier_bytes": ["comm/select.py"]}
    found: dict[str, list[str]] = {name: [] for name in homes}
    for path in _python_files():
        for name in re.findall(r"^\s*def (\w+)\(", path.read_text(), re.M):
            if name in found:
                found[name].append(path.relative_to(REPO).as_posix())
    assert found == homes


def _layout_rows() -> list[tuple[str, str]]:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| `")]
    return [(where.strip(), what.strip()) for where, what in rows]


def test_readme_layout_matches_the_tree():
    """Every path the README's Layout table names exists, every file it names is in its row's folders, and
    every package and top-level module of memrt is in the table."""
    rows = _layout_rows()
    named = set()
    for where, what in rows:
        folders = []
        for path in re.findall(r"`([\w.-]*/[\w./-]*|[\w.-]+\.(?:py|md|sh))`", where):  # paths, not module names
            assert (REPO / path).exists(), f"README Layout names {path}, which is not in the tree"
            named.add(path.rstrip("/"))
            if (REPO / path).is_dir():
                folders.append(REPO / path)
        for path in re.findall(r"`([\w./-]+\.py)`", what):
            if "/" in path:
                assert (REPO / path).exists(), f"README Layout names {path}, which is not in the tree"
                named.add(path)
            else:
                assert any(list(f.rglob(path)) for f in folders), f"README Layout: {path} is not in {where}"
    for child in sorted((REPO / "memrt").iterdir()):
        rel = child.relative_to(REPO).as_posix()
        if child.is_dir() and (child / "__init__.py").exists() or child.suffix == ".py" and \
                child.name not in ("__init__.py", "__main__.py", "_version.py"):
            assert rel in named, f"{rel} is not in the README's Layout table"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path) -> tuple[str, bool]:
    """The installed module name of a library file (``comm/x.py`` is ``memrt.comm.x``) and whether it is a package."""
    rel = path.relative_to(REPO)
    parts = [{"memrt": "memrt", "comm": "memrt.comm", "profiling": "memrt.profiling"}[rel.parts[0]]]
    parts += list(rel.with_suffix("").parts[1:])
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _private_reach_ins(path: Path, text: str) -> list[str]:
    """Where the file imports or reads another memrt module's ``_private`` name."""
    import ast

    module, is_package = _module_name(path)
    tree = ast.parse(text)
    aliases: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("memrt")})
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("memrt"):
                continue
            for a in node.names:
                if _private(a.name) and source != module:
                    found.append(f"{node.lineno}: from {source} import {a.name}")
                aliases[a.asname or a.name] = f"{source}.{a.name}"
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain, base = [], node.value
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if not isinstance(base, ast.Name):
            continue
        head = aliases.get(base.id, "memrt" if base.id == "memrt" else None)
        if head is None:
            continue
        target = ".".join([head, *reversed(chain)])
        if target != module and not target.startswith(module + "."):
            found.append(f"{node.lineno}: {target}.{node.attr}")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    """A module's ``_name`` is its own: the library (tests excluded) never imports or reads another memrt
    module's private names; what another module needs gets a public name."""
    found = []
    for top in ("memrt", "comm", "profiling"):
        for path in sorted((REPO / top).rglob("*.py")):
            if "_site" not in path.parts:
                rel = path.relative_to(REPO).as_posix()
                found += [f"{rel}:{hit}" for hit in _private_reach_ins(path, path.read_text())]
    assert not found, "private names read across modules:\n" + "\n".join(found)


@pytest.mark.parametrize("module, line", [
    ("memrt/memory/units.py", "from memrt.memory.planner import _secret"),
    ("comm/api.py", "from . import select as s\ns._hidden_helper()"),
    ("profiling/report.py", "import memrt.profiling.recorder\nmemrt.profiling.recorder._REC"),
])
def test_private_reach_in_scan_catches_one(module, line):
    path = REPO / module
    found = _private_reach_ins(path, path.read_text() + "\n" + line + "\n")
    assert found, f"{line!r} in {module} was not caught"
