"""Loads the C++ engine (the `_meshtune` extension built from src/python/bindings.cpp).

OpenBLAS takes its kernel family from OPENBLAS_CORETYPE when it loads and otherwise guesses it from
the CPU's model numbers, often wrongly (src/backend/cpu/blas_kernels.h). The engine measures the
families once per machine (cached); a child Python asks it for the choice, which is set here
before the extension, and OpenBLAS with it, loads — as the command line does by re-executing
itself — so that Python and the command line run the same kernels and give the same numbers.

Open MPI loads its own plugins with dlopen and expects libmpi's symbols to be global; Python opens
extensions with RTLD_LOCAL, so the extension is opened with RTLD_GLOBAL (as mpi4py does), which
lets `mpirun -np N python3 script.py` work.
"""
import os
import subprocess
import sys


def _choose_blas_kernels():
    if any(name in os.environ for name in ("OPENBLAS_CORETYPE", "MESHTUNE_TIME_SGEMM", "MESHTUNE_CHOOSING_BLAS")):
        return  # the user's choice, or a child of the choice below
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prelude = f"import sys; sys.path.insert(0, {package_parent!r}); from meshtune._engine import engine; "
    timing = [sys.executable, "-c", prelude + "engine._time_sgemm()"]
    ask = prelude + f"core, note = engine._blas_kernels_to_use({timing!r}); print(core); print(note)"
    try:
        child = subprocess.run([sys.executable, "-c", ask], env={**os.environ, "MESHTUNE_CHOOSING_BLAS": "1"},
                               stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError):
        return  # OpenBLAS' own choice; the engine still works
    lines = child.stdout.splitlines()
    if child.returncode == 0 and len(lines) >= 2:
        if lines[-2]:
            os.environ["OPENBLAS_CORETYPE"] = lines[-2]
        os.environ["MESHTUNE_BLAS_NOTE"] = lines[-1]


_choose_blas_kernels()
_flags = sys.getdlopenflags()
sys.setdlopenflags(_flags | os.RTLD_GLOBAL)
try:
    from meshtune import _meshtune as engine  # noqa: E402
finally:
    sys.setdlopenflags(_flags)

__all__ = ["engine"]
