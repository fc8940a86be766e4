"""memrt: memory and communication optimization runtime for PyTorch training.

``comm/`` and ``profiling/`` install as ``memrt.comm`` and ``memrt.profiling`` (top-level ``comm`` is
Jupyter's package and ``profiling`` is taken too).
"""

import importlib.util
import re
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "memrt/_version.py").read_text()).group(1)

packages = [p for p in find_packages(include=["memrt", "memrt.*"])]
packages += ["memrt.comm"] + ["memrt.comm." + p for p in find_packages("comm")]
packages += ["memrt.profiling"] + ["memrt.profiling." + p for p in find_packages("profiling")]



def _startup_files() -> dict[str, str]:
    """The env-activation files installed at the top of site-packages (memrt/activation/install.py)."""
    spec = importlib.util.spec_from_file_location("_memrt_install", HERE / "memrt/activation/install.py")
    install = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(install)  # stdlib only: no memrt, no torch at build time
    return {install.PTH_NAME: install.pth_text(), install.START_NAME: install.start_text(),
            install.STARTUP_MODULE: install.startup_module_text()}


class BuildPyWithStartup(build_py):
    """Regular installs (wheel): write the startup files at the root of build_lib, i.e. purelib."""

    def run(self):
        super().run()
        for name, text in _startup_files().items():
            path = Path(self.build_lib, name)
            path.write_text(text)
            self._memrt_outputs = getattr(self, "_memrt_outputs", []) + [str(path)]

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + list(getattr(self, "_memrt_outputs", []))


cmdclass = {"build_py": BuildPyWithStartup}
try:  # editable installs (PEP 660): the same files go into the editable wheel, next to setuptools' own .pth
    from setuptools.command.editable_wheel import editable_wheel

    class EditableWheelWithStartup(editable_wheel):
        def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
            result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
            for name, text in _startup_files().items():
                Path(unpacked_wheel, name).write_text(text)
            return result

    if hasattr(editable_wheel, "_run_build_commands"):
        cmdclass["editable_wheel"] = EditableWheelWithStartup
except ImportError:  # setuptools < 64: no PEP 660 editable wheels
    pass

setup(
    name="memrt",
    version=VERSION,
    description="Memory and communication optimization runtime for PyTorch training",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=packages,
    package_dir={"memrt": "memrt", "memrt.comm": "comm", "memrt.profiling": "profiling"},
    package_data={"memrt": ["py.typed"]},
    install_requires=["torch>=2.4", "numpy", "psutil"],
    extras_require={
        "mpi": ["mpi4py>=3.1"],
        "test": ["pytest>=7", "pytest-timeout", "pytest-xdist>=3", "hypothesis", "expecttest", "mpi4py>=3.1", "mpich", "matplotlib", "transformers>=5",
                 "accelerate>=1.0", "pytorch-lightning>=2.0", "import-linter>=2.17"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["memrt=memrt.cli:main"]},
    cmdclass=cmdclass,
    zip_safe=False,
)
