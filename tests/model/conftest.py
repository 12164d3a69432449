import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "heavy: builds a large preset (seconds and GBs); still part of the default run")


@pytest.fixture(scope="session")
def default_corpus():
    from core.model.data import load_corpus

    return load_corpus(None, seq_len=32)
