"""The suite on every core (pytest.ini: pytest-xdist, -n auto, --dist loadgroup): each worker's share of the
cores, and the tests of one module-scoped fixture on one worker, which makes the fixture once."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

SHARED = """
import os

import pytest


@pytest.fixture(scope="module", params=[None] + {params})
def made(request):
    with open(os.environ["MADE_LOG"], "a") as f:  # one line each time a worker makes the fixture
        f.write(f"{{__name__}}-{{request.param}} {{os.environ['PYTEST_XDIST_WORKER']}}\\n")
    return request.param


@pytest.mark.parametrize("i", range(4))
def test_uses_it(made, i):
    pass


@pytest.mark.parametrize("i", range(4))
def test_alone(i):
    pass
"""


def test_a_worker_gets_its_share_of_the_cores():
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers and "OMP_NUM_THREADS" not in os.environ:  # a user's own setting wins
        raise AssertionError("conftest.py did not set OMP_NUM_THREADS in this worker")
    if workers:
        assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])
        assert int(os.environ["OMP_NUM_THREADS"]) >= 1


def test_the_tests_of_one_module_fixture_run_on_one_worker(tmp_path):
    """Two modules, each a module-scoped fixture (one of them parametrized) taken by several tests, and tests
    that take none, on two workers with this suite's conftest.py: each fixture, and each parameter, made once."""
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_one.py").write_text(SHARED.format(params="[]"))
    (tmp_path / "test_two.py").write_text(SHARED.format(params="['a', 'b']"))
    log = tmp_path / "made.log"
    env = dict(os.environ, MADE_LOG=str(log), OMP_NUM_THREADS="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "24 passed" in proc.stdout, proc.stdout[-2000:]
    made = sorted(line.split()[0] for line in log.read_text().splitlines())
    # each made once; pytest 9.2 drops xdist's groups (pytest-xdist#1386), and every worker makes each one
    assert made == ["test_one-None", "test_two-None", "test_two-a", "test_two-b"], f"pytest {pytest.__version__}"
