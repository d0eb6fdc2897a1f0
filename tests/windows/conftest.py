"""The Windows-semantics tier: every test here runs with training/os_compat.py on its Windows branch and the process
imitating Windows where it differs (tests/windows_imitation.py)."""
import pytest

from windows_imitation import WindowsImitation


@pytest.fixture
def windows(monkeypatch):
    return WindowsImitation(monkeypatch).install()
