"""knnconv.context: the settings, their environment variables, and what they refuse."""

from pathlib import Path

import pytest

from knnconv import context


def test_the_environment_sets_the_settings_and_reset_rereads_it(monkeypatch, tmp_path):
    monkeypatch.setenv("KNNCONV_AUTOTUNE", "1")
    monkeypatch.setenv("KNNCONV_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KNNCONV_KEEP_INPUT_RELAYOUT", "off")
    monkeypatch.setenv("KNNCONV_WARPGROUP_MMA", "yes")
    assert not context.settings().autotune  # read when knnconv was imported
    context.reset()
    settings = context.settings()
    assert settings.autotune and settings.cache_dir == tmp_path and settings.warpgroup_mma
    assert not settings.keep_input_relayout


def test_a_malformed_flag_names_its_variable(monkeypatch):
    monkeypatch.setenv("KNNCONV_AUTOTUNE", "maybe")
    with pytest.raises(ValueError, match="KNNCONV_AUTOTUNE='maybe'"):
        context.reset()
    monkeypatch.delenv("KNNCONV_AUTOTUNE")  # the settings fixture rereads it on teardown


def test_using_restores_the_settings_even_on_error():
    before = context.settings()
    with pytest.raises(RuntimeError), context.using(keep_input_relayout=True, autotune=True):
        assert context.settings().keep_input_relayout and context.settings().autotune
        raise RuntimeError
    assert context.settings() == before


@pytest.mark.parametrize("changes, error, message", [
    ({"autotune": 1}, TypeError, "autotune must be a bool"),
    ({"warpgroup_mma": "on"}, TypeError, "warpgroup_mma must be a bool"),
    ({"cache_dir": None}, TypeError, "cache_dir must be a path"),
    ({"colour": True}, TypeError, "unknown knnconv settings"),
    ({"cuda_include_dir": "/no/such/include"}, ValueError, "is not a directory"),
])
def test_settings_that_cannot_work_are_refused(changes, error, message):
    before = context.settings()
    with pytest.raises(error, match=message):
        context.configure(**changes)
    assert context.settings() == before


def test_a_file_is_no_cache_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="is a file"):
        context.configure(cache_dir=blocker)
    context.configure(cache_dir=str(tmp_path))
    assert context.settings().cache_dir == Path(tmp_path)
