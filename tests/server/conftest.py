"""Fixtures of the server tests: the micro model, one jitted runner (two executables: decode
[4, 1] and prefill [1, 64], one table width), engines on it, and a server on 127.0.0.1 started
in this process and stopped at the end of the module."""
import pytest
from server_helpers import Stack


@pytest.fixture(scope="session")
def stack():
    return Stack()


@pytest.fixture(scope="module")
def server(stack):
    srv = stack.server(max_pending=8).start()
    yield srv
    srv.stop()
    srv.engine_loop.engine.core.verify_idle()
