"""The BITMATCH switch has one rule everywhere: the vLLM plugin and the verl actor / check agree on
every value (BITMATCH=false used to turn verl's patch on and vLLM's off)."""
import pytest

from bitmatch import switch


def _readers():
    from bitmatch.adapters.vllm import is_enabled
    return {"switch": switch.enabled, "vllm": is_enabled}


@pytest.mark.parametrize("value, want", [("1", True), ("true", True), (" YES ", True), ("on", True),
                                         ("", False), ("0", False), ("false", False), ("No", False), ("off", False)])
def test_every_reader_agrees(monkeypatch, value, want):
    monkeypatch.setenv("BITMATCH", value)
    assert {k: f() for k, f in _readers().items()} == {k: want for k in _readers()}


def test_unset_is_off(monkeypatch):
    monkeypatch.delenv("BITMATCH", raising=False)
    assert switch.enabled() is False


def test_unknown_value_names_the_fix(monkeypatch):
    monkeypatch.setenv("BITMATCH", "maybe")
    with pytest.raises(ValueError, match="BITMATCH='maybe' is neither on nor off: set BITMATCH=1"):
        switch.enabled()


def test_verl_readers_use_the_same_rule():
    """verl is not installed here: read the sources, so a private parse cannot come back."""
    import pathlib
    root = pathlib.Path(switch.__file__).resolve().parent / "adapters"
    for f in [root / "verl" / "actor.py", root / "verl" / "check.py", root / "vllm" / "__init__.py"]:
        src = f.read_text()
        assert 'environ.get("BITMATCH"' not in src and "switch.enabled()" in src, f
