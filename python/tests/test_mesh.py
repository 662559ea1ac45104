"""`mpirun -np 2 python3 script.py` on a (1, 2) mesh with the tutorial's layout map equals one
process (within the command line's mesh tolerance), and the tutorial example runs on both."""
import json
import os
import subprocess
import sys

import keras_like_run  # noqa: F401  (the script below, importable for the one-process run)
from conftest import MPIEXEC, TINY2

HERE = os.path.dirname(__file__)
EXAMPLE = os.path.join(HERE, "../../examples/distributed_tuning.py")


def mpirun(np, *args):
    command = [MPIEXEC, "--allow-run-as-root", "--oversubscribe", "-np", str(np), "--timeout", "240",
               sys.executable, *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_a_two_process_mesh_equals_one_process(tmp_path):
    one = keras_like_run.run(TINY2, mesh=False)
    mpirun(2, os.path.join(HERE, "keras_like_run.py"), TINY2, str(tmp_path))
    lines = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]  # every rank ran the same script
    for mesh in lines:
        assert mesh["specs"]["decoder_block_1/attention/query/kernel"] == "PartitionSpec('model', None, None)"
        assert len(mesh["losses"]) == len(one["losses"]) == 5
        for a, b in zip(mesh["losses"], one["losses"]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b))
        assert mesh["text"] == one["text"]


def test_the_tutorial_example_runs_on_one_process_and_on_a_mesh():
    for np in (1, 2):
        result = mpirun(np, EXAMPLE, TINY2)
        assert result.stdout.count("PartitionSpec(") >= 9 * np
        assert "30/30" in result.stderr  # Keras' progress bar, once
        assert result.stderr.count("30/30") == 1
