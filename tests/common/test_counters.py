"""Counter names: one canonical list (common/counters.py) that every COUNTERS.add in the package keeps to."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dsaserve.common.counters import COLLECTIVE_KINDS, COUNTER_FAMILIES, is_counter_name

PACKAGE = Path(__file__).resolve().parents[2] / "dsaserve"


def test_known_names_and_families_pass_and_others_do_not():
    assert is_counter_name("kv_bytes_read") and is_counter_name("device_busy_seconds")
    assert all(is_counter_name(f"collective_wire_bytes.{k}") for k in COLLECTIVE_KINDS)
    assert is_counter_name("eager_fallbacks.decode_capture_failed")  # reasons are open-ended
    for name in ("weird_counter", "collective_calls.teleport", "collective_calls", "eager_fallbacks.", "kv_bytes"):
        assert not is_counter_name(name), name


def _added_names() -> list[tuple[str, str]]:
    """(first argument of every COUNTERS.add call, file:line): a literal, or an f-string's text to its first field."""
    out = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "COUNTERS" and node.args:
                arg, where = node.args[0], f"{path.relative_to(PACKAGE)}:{node.lineno}"
                if isinstance(arg, ast.Constant):
                    out.append((arg.value, where))
                elif isinstance(arg, ast.JoinedStr) and isinstance(arg.values[0], ast.Constant):
                    out.append((arg.values[0].value, where))
    return out


def test_every_counter_the_package_adds_is_in_the_list():
    names = _added_names()
    assert len(names) > 10
    for name, where in names:
        family = name.removesuffix(".")
        assert is_counter_name(name) if not name.endswith(".") else family in COUNTER_FAMILIES, (name, where)


def test_strict_names_refuse_an_unlisted_counter_at_its_first_add():
    from dsaserve.common.counters import Counters

    c = Counters()
    c.strict_names = True
    c.add("kv_bytes_read", 5)
    c.add_source(lambda reset: {"device_busy_seconds": 1.0})
    assert c.snapshot() == {"kv_bytes_read": 5, "device_busy_seconds": 1.0}
    with pytest.raises(ValueError, match="counter 'kv_bytes' is not in"):
        c.add("kv_bytes", 1)
    c.add_source(lambda reset: {"busy": 1.0})
    with pytest.raises(ValueError, match="counter 'busy' is not in"):
        c.snapshot()
