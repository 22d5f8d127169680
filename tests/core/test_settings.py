import pytest

from mono_ext.core.settings import ENV_VARS, Settings, SettingsError, load_settings


def test_defaults_when_unset():
    s = load_settings({})
    assert s == Settings(
        check=False, deadline_s=10.0, agree_every=16, serve_unmeasured=False, profile_host=False
    )
    assert set(ENV_VARS) == {
        "MONO_EXT_CHECK",
        "MONO_EXT_DEADLINE_S",
        "MONO_EXT_AGREE_EVERY",
        "MONO_EXT_SERVE_UNMEASURED",
        "MONO_EXT_PROFILE_HOST",
    }


@pytest.mark.parametrize("raw,want", [("1", True), ("true", True), ("ON", True), ("0", False)])
def test_check_switch(raw, want):
    assert load_settings({"MONO_EXT_CHECK": raw}).check is want


def test_valid_numbers():
    s = load_settings({"MONO_EXT_DEADLINE_S": "0.5", "MONO_EXT_AGREE_EVERY": "4"})
    assert (s.deadline_s, s.agree_every) == (0.5, 4)


@pytest.mark.parametrize(
    "name,raw",
    [
        ("MONO_EXT_CHECK", "maybe"),
        ("MONO_EXT_DEADLINE_S", "ten"),
        ("MONO_EXT_DEADLINE_S", "0"),
        ("MONO_EXT_DEADLINE_S", "-3"),
        ("MONO_EXT_DEADLINE_S", "nan"),
        ("MONO_EXT_DEADLINE_S", "1e9"),
        ("MONO_EXT_AGREE_EVERY", "1.5"),
        ("MONO_EXT_AGREE_EVERY", "0"),
        ("MONO_EXT_PROFILE_HOST", "sometimes"),
    ],
)
def test_bad_values_name_the_variable(name, raw):
    with pytest.raises(SettingsError) as err:
        load_settings({name: raw})
    assert name in str(err.value) and repr(raw) in str(err.value)
