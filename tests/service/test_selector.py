"""The device selector grammar: parsing, refusals that name the bad term, matching on facts."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from service.devices import selector as sel


def device(**change):
    facts = {"isa": ["dotprod", "neon"], "device_model": "Google Pixel 7", "cpu_model": "Tensor G2",
             "logical_cores": 8, "os": "Android 14 (API 34)", "gpu_model": None}
    base = dict(id="d1", name="pixel-7", kind="phone", arch="aarch64", status="online",
                transport="adb", fingerprint="ab" * 32, facts=facts)
    return SimpleNamespace(**(base | change))


@pytest.mark.parametrize("text, expected", [
    ("kind:phone,arch:aarch64,feature:neon,name:PIXEL", True),
    ("feature:neon,feature:dotprod", True),
    ("feature:neon,feature:sve", False),
    ("model:pixel 7", True),
    ("cores:8", True), ("cores:9", False),
    ("kind:cpu", False), ("arch:x86_64", False),
    ("os:android 14", True), ("gpu:adreno", False),
    ("fingerprint:ABAB", True), ("status:offline", False),
    ("", True),
])
def test_terms_match_the_facts(text, expected):
    assert sel.parse(text).matches(device()) is expected


def test_gpu_means_a_gpu_host_and_the_text_round_trips():
    assert sel.parse("kind:gpu").matches(device(kind="gpu-host"))
    assert str(sel.parse(" kind : phone , arch:aarch64 ")) == "kind:phone,arch:aarch64"
    assert sel.from_params(kind="phone", feature=["neon", "fp16"], name=None).terms == (
        ("kind", "phone"), ("feature", "neon"), ("feature", "fp16"))


@pytest.mark.parametrize("text, names", [
    ("chipset:sd8", "unknown device selector key 'chipset'"),
    ("kind", "'kind' is not key:value"),
    ("kind:", "'kind:' is not key:value"),
    ("kind:watch", "kind:watch"),
    ("cores:many", "cores:many"),
    ("name:x," * 40, "at most 32 terms"),
    ("name:" + "x" * 2000, "at most 1000 characters"),
])
def test_bad_selectors_are_refused_by_name(text, names):
    with pytest.raises(sel.SelectorError, match=None) as info:
        sel.parse(text)
    assert names in str(info.value)
