"""Paths the tests need, given by ctest (tests/CMakeLists.txt) through the environment."""
import os
import subprocess

import pytest

FIXTURES = os.environ.get("MESHTUNE_FIXTURES_DIR", os.path.join(os.path.dirname(__file__), "../../../shared/fixtures"))
BINARY = os.environ.get("MESHTUNE_BINARY", os.path.join(os.path.dirname(__file__), "../../build/meshtune"))
MPIEXEC = os.environ.get("MESHTUNE_MPIEXEC", "mpirun")
TINY = os.path.join(FIXTURES, "keras/preset-gemma-tiny")
TINY2 = os.path.join(FIXTURES, "keras/preset-gemma2-tiny")


def run_cli(*args, env=None):
    """The meshtune command line with `args`; returns stdout, asserting it succeeded."""
    result = subprocess.run([BINARY, *args], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def read_npy_f32(path):
    """A float32 .npy file as (shape, array of floats), without numpy."""
    import array
    import ast
    with open(path, "rb") as f:
        data = f.read()
    assert data[:6] == b"\x93NUMPY"
    header_len = int.from_bytes(data[8:10], "little")
    header = ast.literal_eval(data[10:10 + header_len].decode())
    assert header["descr"] == "<f4" and not header["fortran_order"]
    values = array.array("f")
    values.frombytes(data[10 + header_len:])
    return tuple(header["shape"]), values


def write_npy_i32(path, rows):
    import array
    flat = array.array("i", [v for r in rows for v in r])
    header = "{'descr': '<i4', 'fortran_order': False, 'shape': (%d, %d), }" % (len(rows), len(rows[0]))
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + flat.tobytes())


@pytest.fixture(autouse=True)
def fresh_globals():
    """Each test starts with no distribution, float32 and no seed (the package's global state)."""
    import meshtune
    meshtune.distribution.set_distribution(None)
    meshtune.mixed_precision.set_global_policy("float32")
    meshtune.utils._seed = None
    yield


def as_lists(values):
    """score()'s logits as nested lists whether numpy is installed (an array) or not (lists)."""
    return values.tolist() if hasattr(values, "tolist") else values
