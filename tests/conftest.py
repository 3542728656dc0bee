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
