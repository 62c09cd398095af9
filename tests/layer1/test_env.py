"""layer 1's env_switch: the on/off environment switches kernels and layer 2 read."""
import pytest

from layer1_kernels.env import env_switch


def test_env_switch_is_strict(monkeypatch):
    """layer 1's env_switch (the switches layer 2's all-reduce reads): "1" on, "0" off, unset
    the default, a typo an error naming the variable."""
    name = "LLM_STACK_TEST_SWITCH"
    monkeypatch.delenv(name, raising=False)
    assert env_switch(name, False) is False and env_switch(name, True) is True
    for value, on in (("1", True), ("0", False)):
        monkeypatch.setenv(name, value)
        assert env_switch(name, not on) is on
    monkeypatch.setenv(name, "true")
    with pytest.raises(ValueError, match="LLM_STACK_TEST_SWITCH must be 0 or 1"):
        env_switch(name, False)
