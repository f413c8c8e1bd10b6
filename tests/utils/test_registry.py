"""fedreid.registry: one Registry class behind every extension point."""

from __future__ import annotations

import sys
import types

import pytest

from fedreid.options import ConfigError
from fedreid.registry import Registry, UnknownNameError


def test_register_forms_and_lookup():
    reg: Registry[object] = Registry("widget")

    @reg.register
    class Alpha:
        name = "alpha"

    @reg.register("beta")
    def make_beta():
        return "b"

    def gamma():
        return "g"

    reg.register(gamma)
    assert reg.get("alpha") is Alpha and reg["beta"] is make_beta and reg.get("gamma") is gamma
    assert reg.names() == ["alpha", "beta", "gamma"] and list(reg) == ["alpha", "beta", "gamma"]
    assert "beta" in reg and "delta" not in reg and len(reg) == 3
    assert reg.register(Alpha) is Alpha  # the same object again: a no-op
    with pytest.raises(ValueError, match="widget name 'alpha' is taken"):
        reg.register(type("Other", (), {"name": "alpha"}))
    with pytest.raises(ValueError, match="no widget name"):
        reg.register(type("Nameless", (), {"name": ""}))


def test_unknown_name_is_a_one_line_config_error_with_close_names():
    reg: Registry[int] = Registry("widget")
    reg.register(1, name="fedprox")
    reg.register(2, name="fedavg")
    with pytest.raises(UnknownNameError) as info:
        reg.get("fedprx")
    assert str(info.value) == "unknown widget 'fedprx' (did you mean fedprox?); known: fedavg, fedprox"
    assert isinstance(info.value, ConfigError) and isinstance(info.value, KeyError)
    with pytest.raises(ConfigError) as info:
        reg.get("zzz", where="train.objective")
    assert str(info.value) == "train.objective: unknown 'zzz'; known: fedavg, fedprox"
    with pytest.raises(KeyError):
        reg["zzz"]


def test_custom_error_class():
    class UnknownWidget(UnknownNameError):
        pass

    reg: Registry[int] = Registry("widget", unknown=UnknownWidget)
    with pytest.raises(UnknownWidget, match="known: none"):
        reg.get("x")


def test_locations_are_imported_on_first_lookup(monkeypatch):
    reg: Registry[int] = Registry("widget", locations=("fedreid_test_widgets",))
    module = types.ModuleType("fedreid_test_widgets")
    imported = []

    def exec_module():
        imported.append(True)
        reg.register(7, name="seven")

    class Finder:
        def find_spec(self, name, path=None, target=None):
            if name != "fedreid_test_widgets":
                return None
            import importlib.machinery

            loader = types.SimpleNamespace(create_module=lambda spec: module,
                                           exec_module=lambda mod: exec_module())
            return importlib.machinery.ModuleSpec(name, loader)

    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, "fedreid_test_widgets", raising=False)
    assert imported == []  # creating the registry imports nothing
    assert reg.get("seven") == 7 and imported == [True]
    assert reg.names() == ["seven"] and imported == [True]  # once


def test_copy_is_independent():
    reg: Registry[int] = Registry("widget")
    reg.register(1, name="one")
    other = reg.copy()
    other.register(2, name="two")
    assert "two" in other and "two" not in reg and other.get("one") == 1


def test_every_extension_point_is_a_registry():
    from fedreid.data.raw import PARSERS
    from fedreid.fl.local.base import OBJECTIVES
    from fedreid.fl.server_hooks.base import SERVER_HOOKS
    from fedreid.models import classifiers

    for reg, member in ((PARSERS, "market1501"), (OBJECTIVES, "fedprox"), (SERVER_HOOKS, "kd"),
                        (classifiers._REGISTRY, "cnn_lmd")):
        assert isinstance(reg, Registry) and member in reg.names()
