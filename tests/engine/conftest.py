"""Session fixtures of the engine tests (see `engine_helpers.py`): one micro model and one
jitted runner per worker, so every bucketed shape compiles once per worker."""
import dataclasses

import pytest
from engine_helpers import Served

from kvjax.model_catalog import load_model_spec


@pytest.fixture(scope="session")
def micro():
    return Served("micro")


@pytest.fixture(scope="session")
def micro_swa():
    return Served("micro-swa")


@pytest.fixture(scope="session")
def micro_narrow():
    """micro-swa with its local layer's window narrowed to 5 tokens, less than a block (8)."""
    return Served(dataclasses.replace(load_model_spec("micro-swa"), attention_windows=(5, 1024)))
