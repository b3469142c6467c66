"""The systest image cache key: what invalidates the cached guest image and what must not."""

from __future__ import annotations

import io
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the systest package

from systest import cachekey


def make_wheel(members: dict[str, bytes], date: tuple[int, ...] = (1980, 1, 1, 0, 0, 0)) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(zipfile.ZipInfo(name, date_time=date), data)  # type: ignore[arg-type]
    return buf.getvalue()


BASE = cachekey.BaseInputs("bookworm", ("systemd", "python3"), {"image.py": b"v1"})


def test_base_key_is_stable_and_short() -> None:
    assert cachekey.base_key(BASE) == cachekey.base_key(BASE)
    assert len(cachekey.base_key(BASE)) == cachekey.KEY_CHARS
    assert cachekey.IMAGE_DIR.fullmatch(cachekey.base_key(BASE))


def test_base_key_ignores_package_order_and_duplicates() -> None:
    same = cachekey.BaseInputs("bookworm", ("python3", "systemd", "python3"), {"image.py": b"v1"})
    assert cachekey.base_key(same) == cachekey.base_key(BASE)


@pytest.mark.parametrize(
    "changed",
    [
        cachekey.BaseInputs("trixie", BASE.packages, BASE.recipe_files),
        cachekey.BaseInputs("bookworm", (*BASE.packages, "libgomp1"), BASE.recipe_files),
        cachekey.BaseInputs("bookworm", BASE.packages, {"image.py": b"v2"}),
        cachekey.BaseInputs("bookworm", BASE.packages, {"image.py": b"v1", "guest/x": b""}),
        cachekey.BaseInputs("bookworm", BASE.packages, {"image2.py": b"v1"}),
    ],
    ids=["suite", "package", "recipe-content", "recipe-added", "recipe-renamed"],
)
def test_base_key_changes_with_each_input(changed: cachekey.BaseInputs) -> None:
    assert cachekey.base_key(changed) != cachekey.base_key(BASE)


def test_length_prefixing_keeps_boundaries() -> None:
    a = cachekey.BaseInputs("bookworm", ("ab", "c"), {})
    b = cachekey.BaseInputs("bookworm", ("a", "bc"), {})
    assert cachekey.base_key(a) != cachekey.base_key(b)


def test_wheel_digest_ignores_zip_timestamps_and_member_order() -> None:
    one = make_wheel({"a.py": b"x", "b.py": b"y"}, date=(1980, 1, 1, 0, 0, 0))
    two = make_wheel({"b.py": b"y", "a.py": b"x"}, date=(2026, 11, 30, 5, 0, 0))
    assert one != two
    assert cachekey.wheel_digest(one) == cachekey.wheel_digest(two)


def test_wheel_digest_sees_content_and_names() -> None:
    ref = cachekey.wheel_digest(make_wheel({"a.py": b"x"}))
    assert cachekey.wheel_digest(make_wheel({"a.py": b"z"})) != ref
    assert cachekey.wheel_digest(make_wheel({"c.py": b"x"})) != ref


def test_wheel_digest_rejects_non_zip() -> None:
    with pytest.raises(zipfile.BadZipFile):
        cachekey.wheel_digest(b"not a wheel")


def test_image_key_depends_on_base_recipe_and_every_wheel() -> None:
    wheels = {"slmguard-0.1.0-py3-none-any.whl": "d1", "numpy.whl": "d2"}
    key = cachekey.image_key("base1", b"recipe", wheels)
    assert key == cachekey.image_key("base1", b"recipe", dict(reversed(list(wheels.items()))))
    assert key != cachekey.image_key("base2", b"recipe", wheels)
    assert key != cachekey.image_key("base1", b"recipe 2", wheels)
    assert key != cachekey.image_key("base1", b"recipe", {**wheels, "numpy.whl": "d3"})
    assert key != cachekey.image_key("base1", b"recipe", {"numpy.whl": "d2"})


def test_stale_entries_keeps_the_newest_of_each_kind_only() -> None:
    k = "0123456789abcdef"
    entries = [
        (k, 1.0),
        (k.replace("0", "1"), 3.0),
        (k.replace("0", "2"), 2.0),
        (f"base-{k}", 1.0),
        (f"base-{k.replace('0', '9')}", 5.0),
        ("run", 0.0),
        (f"{k}.tmp", 0.0),
    ]
    assert cachekey.stale_entries(entries, cachekey.IMAGE_DIR, keep=2) == [k]
    assert cachekey.stale_entries(entries, cachekey.BASE_DIR, keep=1) == [f"base-{k}"]
    assert cachekey.stale_entries(entries, cachekey.IMAGE_DIR, keep=5) == []
