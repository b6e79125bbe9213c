"""Session fixtures of the engine tests (see `engine_helpers.py`): one micro model and one
jitted runner per worker, so every bucketed shape compiles once per worker."""
import pytest

from engine_helpers import Served


@pytest.fixture(scope="session")
def micro():
    return Served("micro")


@pytest.fixture(scope="session")
def micro_swa():
    return Served("micro-swa")
