"""mpi4py and Horovod share one MPI library.

Setup installs mpi4py's binary wheel instead of compiling it against the system MPI (scripts/setup.sh). That is only
safe if the extension the wheel picks at run time loads the very ``libmpi`` Horovod's MPI backend was linked
against: two MPI libraries in one process would each initialize their own runtime, and the statistics exchange on
mpi4py (``safebits_hvd.comm.exchange.MPIExchange``) would not see Horovod's communicator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import horovod.torch  # loads Horovod's MPI backend, which links libmpi
from mpi4py import MPI  # loads the wheel's Open MPI extension, which loads libmpi by its soname
libraries = sorted({os.path.realpath(line.split()[-1]) for line in open('/proc/self/maps')
                    if '/libmpi.so' in line})
print(json.dumps(libraries))
print(MPI.Get_library_version().splitlines()[0])
"""


def loaded_mpi_libraries() -> tuple[list[str], str]:
    """The distinct ``libmpi`` files mapped into a fresh process that imported Horovod and mpi4py, and the MPI
    library version mpi4py reports (a fresh process: ``MPI`` must not be initialized inside the test runner)."""
    pytest.importorskip("horovod.torch")
    pytest.importorskip("mpi4py")
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    result = subprocess.run([sys.executable, "-c", "import json, os\n" + PROBE], capture_output=True, text=True,
                            timeout=120, env=env, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    return json.loads(lines[-2]), lines[-1]


def test_mpi4py_and_horovod_load_the_same_libmpi() -> None:
    libraries, version = loaded_mpi_libraries()
    assert len(libraries) == 1, f"more than one MPI library in one process: {libraries}"
    assert "Open MPI" in version, version
