import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest


@pytest.fixture(autouse=True)
def _settled():
    """Each test ends once the clean-ups its commits left to the background are done, so none
    runs on into the next test, or past the server of a store fixture."""
    yield
    pools = sys.modules.get("jaxckpt._runtime.pools")
    if pools is not None:
        pools.settle()
