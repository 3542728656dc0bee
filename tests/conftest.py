import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _settled():
    """Each test ends once the clean-ups its commits left to the background are done, so none
    runs on into the next test, or past the server of a store fixture."""
    yield
    pools = sys.modules.get("jaxckpt._runtime.pools")
    if pools is not None:
        pools.settle()


@pytest.fixture(scope="session")
def loops_group(tmp_path_factory):
    """One real 2-process group (tests/loops_worker.py) for the schedule and iterator tests:
    ``(records by process, its work directory)``."""
    from groups import run_group

    work = tmp_path_factory.mktemp("loops")
    worker = Path(__file__).parent / "loops_worker.py"
    records = run_group(worker, "two", 2, work, 600)
    for r in records:
        assert "error" not in r, r["error"]
    return records, work


@pytest.fixture(scope="session")
def emulator():
    """fake-gcs-server behind its proxy (tests/gcs_server.py), one per test process: tensorstore
    reads the emulator's URL from the environment when it opens a store and reuses an open one,
    so a second emulator in the same process would get some requests of the first's stores."""
    from gcs_server import serve

    yield from serve()


@pytest.fixture
def gcs(emulator):
    """The emulator, its link healthy again after the test (no fault, held requests released)."""
    from http_proxy import Shaping

    yield emulator
    emulator.fault = None
    emulator.proxy.shaping = Shaping()
    emulator.proxy.release()
