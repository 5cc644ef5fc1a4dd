"""Settings from the environment: every KVSCOPE_* number is read as one, and a value the server cannot run with
stops start-up with a message that names the variable, in the console's language."""

from __future__ import annotations

import dataclasses

import pytest

from app.cli import main
from app.errors import BadSetting
from app.i18n import translate
from app.settings import ZERO_MEANS, Settings, resolve_device

NUMBERS = [f for f in dataclasses.fields(Settings) if f.type in ("int", "float")]


def var(f: dataclasses.Field) -> str:
    return f"KVSCOPE_{f.name.upper()}"


def test_every_number_is_read_from_its_variable():
    assert len(NUMBERS) > 20
    settings = Settings.from_env({var(f): "7" for f in NUMBERS})
    for f in NUMBERS:
        value = getattr(settings, f.name)
        assert value == 7 and type(value) is {"int": int, "float": float}[f.type], f.name


@pytest.mark.parametrize("raw", ["-1", "-0.5", "abc", "", "nan", "inf", "1e400"])
def test_a_value_that_is_not_a_usable_number_stops_start_up_naming_the_variable(raw):
    for f in NUMBERS:
        with pytest.raises(BadSetting) as refused:
            Settings.from_env({var(f): raw})
        assert refused.value.message.startswith(f"{var(f)} must be "), refused.value.message
        assert refused.value.text("zh").startswith(f"{var(f)} "), refused.value.text("zh")
        assert repr(raw) in refused.value.message  # what was given, quoted


def test_zero_is_refused_where_it_means_nothing_and_taken_where_it_means_something():
    assert set(ZERO_MEANS) < {f.name for f in NUMBERS}  # each names a real number setting
    for f in NUMBERS:
        if f.name in ZERO_MEANS:
            assert getattr(Settings.from_env({var(f): "0"}), f.name) == 0
        else:
            with pytest.raises(BadSetting) as refused:
                Settings.from_env({var(f): "0"})
            assert refused.value.message in (
                translate("boot.settings.at_least", name=var(f), value="'0'", low=1),
                translate("boot.settings.above_zero", name=var(f), value="'0'"),
            )


def test_whole_numbers_are_whole_the_port_is_a_port_and_a_model_is_named():
    assert Settings.from_env({"KVSCOPE_SESSION_TTL_S": "0.5"}).session_ttl_s == 0.5
    with pytest.raises(BadSetting) as refused:
        Settings.from_env({"KVSCOPE_MAX_SESSIONS": "2.5"})
    assert refused.value.message == translate("boot.settings.whole_number", name="KVSCOPE_MAX_SESSIONS", value="'2.5'")
    assert Settings.from_env({"KVSCOPE_PORT": "65535"}).port == 65535
    with pytest.raises(BadSetting, match="^KVSCOPE_PORT must be at most 65535, not '65536'"):
        Settings.from_env({"KVSCOPE_PORT": "65536"})
    with pytest.raises(BadSetting, match="^KVSCOPE_MODELS names no model"):
        Settings.from_env({"KVSCOPE_MODELS": " , "})
    assert Settings.from_env({}) == Settings()  # nothing set: the defaults


@pytest.mark.parametrize("lang, locale", [("en", "en_US.UTF-8"), ("zh", "zh_CN.UTF-8")])
def test_kvscope_serve_stops_before_listening_and_says_which_variable(lang, locale, monkeypatch, capsys):
    def listen(*args, **kwargs):
        raise AssertionError("start-up went on with a bad setting")

    monkeypatch.setattr("app.web.boot.serve", listen)
    monkeypatch.setenv("LC_ALL", locale)
    monkeypatch.setenv("KVSCOPE_MAX_SESSIONS", "-3")
    assert main(["serve"]) == 2
    why = translate("boot.settings.at_least", lang, name="KVSCOPE_MAX_SESSIONS", value="'-3'", low=1)
    assert capsys.readouterr().err.strip() == translate("boot.console.bad_setting", lang, why=why)


def test_device_is_read_from_its_variable_and_checked(monkeypatch):
    import torch

    assert Settings.from_env({"KVSCOPE_DEVICE": "cpu"}).device == "cpu"
    assert resolve_device(Settings(device="CPU")) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(Settings()) == "cpu"  # the default: cuda only where torch sees one
    with pytest.raises(BadSetting, match="^KVSCOPE_DEVICE must be cpu, cuda or cuda:N, not 'tpu'"):
        resolve_device(Settings.from_env({"KVSCOPE_DEVICE": "tpu"}))
    with pytest.raises(BadSetting, match="^KVSCOPE_DEVICE is 'cuda', but torch sees no such CUDA GPU"):
        resolve_device(Settings.from_env({"KVSCOPE_DEVICE": "cuda"}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device(Settings()) == "cuda" and resolve_device(Settings(device="cuda:0")) == "cuda:0"
    with pytest.raises(BadSetting, match="^KVSCOPE_DEVICE is 'cuda:1'"):
        resolve_device(Settings(device="cuda:1"))


@pytest.mark.parametrize("lang, locale", [("en", "en_US.UTF-8"), ("zh", "zh_CN.UTF-8")])
def test_serve_device_cuda_without_cuda_stops_with_a_clear_message(lang, locale, monkeypatch, capsys):
    import torch

    seen = {}
    monkeypatch.setattr("app.web.boot.serve", lambda settings: seen.setdefault("device", settings.device) and 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LC_ALL", locale)
    monkeypatch.delenv("KVSCOPE_DEVICE", raising=False)
    assert main(["serve", "--device", "cpu"]) == 0 and seen["device"] == "cpu"  # the flag reaches Settings
    assert main(["serve", "--device", "cuda"]) == 2
    why = translate("boot.settings.no_cuda", lang, name="KVSCOPE_DEVICE", value="'cuda'")
    assert capsys.readouterr().err.strip() == translate("boot.console.bad_setting", lang, why=why)
    with pytest.raises(SystemExit):
        main(["serve", "--device", "tpu"])  # argparse: only cpu or cuda
