"""Every ``PUZZLETRON_OBJECT_*`` variable is read and checked in one place: a value that is not what is
expected, or a name this package does not read, is one `ConfigError` naming the variable, the value and
what is expected, before any request (never a request made 0 times, a bound switched off, or a timeout
that never ends)."""

from __future__ import annotations

import pytest

from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.storage.object_cache import ObjectCache
from puzzletron.dataset.storage.objects import ObjectOptions, Objects
from puzzletron.dataset.storage.settings import object_settings


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("PUZZLETRON_OBJECT_RETRIES", "-1", "a whole number of retries, 0 or more"),
        ("PUZZLETRON_OBJECT_RETRIES", "abc", "a whole number of retries, 0 or more"),
        ("PUZZLETRON_OBJECT_RETRIES", "2.5", "a whole number of retries, 0 or more"),
        ("PUZZLETRON_OBJECT_READ_TIMEOUT_S", "0", "a number of seconds, finite and above 0"),
        ("PUZZLETRON_OBJECT_READ_TIMEOUT_S", "inf", "a number of seconds, finite and above 0"),
        ("PUZZLETRON_OBJECT_CONNECT_TIMEOUT_S", "nan", "a number of seconds, finite and above 0"),
        ("PUZZLETRON_OBJECT_REQUEST_TIMEOUT_S", "-3", "a number of seconds, finite and above 0"),
        ("PUZZLETRON_OBJECT_CACHE_BYTES", "lots", "expected bytes, or a number with K, M, G or T"),
        ("PUZZLETRON_OBJECT_CACHE_BYTES", "0", "expected at least 1 byte"),
    ],
)
def test_an_odd_value_is_one_error_naming_the_variable_the_value_and_what_is_expected(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, expected: str
) -> None:
    monkeypatch.setenv(name, value)
    for read in (object_settings, ObjectOptions, ObjectCache.default, lambda: Objects("s3://b/p").options):
        with pytest.raises(ConfigError, match=f"{name}={value!r}: .*{expected}") as caught:
            read()
        assert "\n" not in str(caught.value)


def test_an_unknown_variable_is_refused_so_a_typo_never_leaves_the_default_in_force(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PUZZLETRON_OBJECT_RETRY", "0")  # RETRIES misspelt
    with pytest.raises(ConfigError, match=r"PUZZLETRON_OBJECT_RETRY: not a variable this package reads"):
        ObjectOptions()


def test_values_given_in_code_are_held_to_the_same_checks() -> None:
    with pytest.raises(ConfigError, match=r"retries=-1: expected a whole number"):
        ObjectOptions(retries=-1)
    with pytest.raises(ConfigError, match=r"read_timeout_s=inf"):
        ObjectOptions(read_timeout_s=float("inf"))
    with pytest.raises(ConfigError, match=r"request_timeout_s=0"):
        ObjectOptions(request_timeout_s=0)


def test_the_defaults_and_good_values_are_read(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    for name in ("RETRIES", "READ_TIMEOUT_S", "CONNECT_TIMEOUT_S", "REQUEST_TIMEOUT_S", "CACHE_BYTES"):
        monkeypatch.delenv(f"PUZZLETRON_OBJECT_{name}", raising=False)
    monkeypatch.setenv("PUZZLETRON_OBJECT_CACHE", str(tmp_path))
    settings = object_settings()
    assert (settings.retries, settings.read_timeout_s, settings.request_timeout_s) == (4, 60.0, 300.0)
    assert (settings.cache, settings.cache_bytes) == (tmp_path, 64 << 30)
    monkeypatch.setenv("PUZZLETRON_OBJECT_RETRIES", "0")
    monkeypatch.setenv("PUZZLETRON_OBJECT_CACHE_BYTES", "512M")
    assert ObjectOptions().retries == 0 and ObjectCache.default().max_bytes == 512 << 20
