"""Loads the C++ engine (the `_meshtune` extension built from src/python/bindings.cpp).

Open MPI loads its own plugins with dlopen and expects libmpi's symbols to be global; Python opens
extensions with RTLD_LOCAL, so the extension is opened with RTLD_GLOBAL (as mpi4py does), which
lets `mpirun -np N python3 script.py` work.
"""
import os
import sys

_flags = sys.getdlopenflags()
sys.setdlopenflags(_flags | os.RTLD_GLOBAL)
try:
    from meshtune import _meshtune as engine  # noqa: E402
finally:
    sys.setdlopenflags(_flags)

__all__ = ["engine"]
