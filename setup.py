"""memrt: memory and communication optimization runtime for PyTorch training.

``comm/`` and ``profiling/`` install as ``memrt.comm`` and ``memrt.profiling`` (top-level ``comm`` is
Jupyter's package and ``profiling`` is taken too).
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "memrt/_version.py").read_text()).group(1)

packages = [p for p in find_packages(include=["memrt", "memrt.*"])]
packages += ["memrt.comm"] + ["memrt.comm." + p for p in find_packages("comm")]
packages += ["memrt.profiling"] + ["memrt.profiling." + p for p in find_packages("profiling")]

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
        "test": ["pytest>=7", "pytest-timeout", "hypothesis", "mpi4py>=3.1", "mpich", "matplotlib"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["memrt=memrt.cli:main"]},
    zip_safe=False,
)
