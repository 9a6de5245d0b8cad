"""ring_core.settings: the one table of environment variables, its page (docs/settings.md), and its readers."""

import re
from pathlib import Path

import pytest

from ring_core import settings

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ring_core", "jax_ring", "torch_bridge")
# A quoted variable name on a line that reads the environment (os.environ / an ``env`` mapping) or names one
# (``..._ENV = "NAME"``).
_READ = re.compile(r"environ|\benv(\.get\(|\[| if )|_ENV\b\s*=|getenv")
_NAME = re.compile(r"""["']([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+|RANK|PATH)["']""")


def _names_read():
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if _READ.search(line):
                    for name in _NAME.findall(line):
                        found.setdefault(name, f"{path.relative_to(ROOT)}:{i}")
    return found


def test_the_docs_page_is_the_table():
    """docs/settings.md is ``python -m ring_core.settings --markdown``: rewrite it with that command."""
    assert (ROOT / "docs" / "settings.md").read_text() == settings.markdown(), \
        "docs/settings.md is out of date: python -m ring_core.settings --markdown > docs/settings.md"


def test_every_variable_the_sources_read_is_in_the_table():
    missing = {name: where for name, where in _names_read().items() if name not in settings.BY_NAME}
    assert not missing, f"environment variables read but not in ring_core.settings.SETTINGS: {missing}"


def test_the_project_reads_its_own_variables_only_through_settings():
    """Outside ring_core/settings.py no module reads a RING_* variable itself (ptxas_shim excepted: it runs as a
    standalone script, with nothing of ring_core importable)."""
    direct = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name in ("settings.py", "ptxas_shim.py"):
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"""environ(\.get)?[\[(]\s*["']RING_""", line) or \
                        re.search(r"""_ENV\s*=\s*["']RING_""", line):
                    direct.append(f"{path.relative_to(ROOT)}:{i}")
    assert not direct


def test_values_are_read_at_call_time(monkeypatch):
    for name in (settings.TIMEOUT_S, settings.ERRORS, settings.HEAP_BYTES, settings.NODE_SIZE, settings.GLUON,
                 settings.GLUON_DETERMINISTIC):
        monkeypatch.delenv(name, raising=False)
    assert (settings.timeout_s(), settings.errors_mode(), settings.heap_bytes(), settings.node_size()) == \
        (300.0, "deferred", 4 << 30, None)
    assert settings.gluon() and settings.gluon_deterministic()
    monkeypatch.setenv(settings.TIMEOUT_S, "2.5")
    monkeypatch.setenv(settings.ERRORS, "call")
    monkeypatch.setenv(settings.HEAP_BYTES, str(64 << 20))
    monkeypatch.setenv(settings.NODE_SIZE, "4")
    monkeypatch.setenv(settings.GLUON, "0")
    assert (settings.timeout_s(), settings.errors_mode(), settings.heap_bytes(), settings.node_size()) == \
        (2.5, "call", 64 << 20, 4)
    assert not settings.gluon()


@pytest.mark.parametrize("name, value, message", [
    (settings.NODE_SIZE, "0", "RING_ATTENTION_NODE_SIZE must be a positive number of ranks per node, got '0'"),
    (settings.NODE_SIZE, "two", "RING_ATTENTION_NODE_SIZE must be a positive number of ranks per node, got 'two'"),
    (settings.TIMEOUT_S, "-1", "RING_ATTENTION_TIMEOUT_S must be a positive number of seconds, got '-1'"),
    (settings.TIMEOUT_S, "soon", "RING_ATTENTION_TIMEOUT_S='soon' is not a number of seconds"),
    (settings.HEAP_BYTES, "lots", "RING_ATTENTION_HEAP_BYTES='lots' is not a number of bytes"),
    (settings.ERRORS, "never", r"RING_ATTENTION_ERRORS must be one of \('call', 'deferred'\), got 'never'"),
])
def test_a_bad_value_says_what_is_wanted(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    reader = {settings.NODE_SIZE: settings.node_size, settings.TIMEOUT_S: settings.timeout_s,
              settings.HEAP_BYTES: settings.heap_bytes, settings.ERRORS: settings.errors_mode}[name]
    with pytest.raises(ValueError, match=message):
        reader()


def test_a_name_outside_the_table_is_refused():
    with pytest.raises(KeyError, match="not in ring_core.settings.SETTINGS"):
        settings.raw("RING_ATTENTION_SOMETHING")
