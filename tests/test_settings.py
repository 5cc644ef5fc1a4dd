"""Settings from the environment: every KVSCOPE_* number is read as one, and a value the server cannot run with
stops start-up with a message that names the variable, in the console's language."""

from __future__ import annotations

import dataclasses

import pytest

from app.cli import main
from app.errors import BadInput, BadSetting
from app.i18n import translate
from app.quota import Requester
from app.settings import GROUPS, MAXIMUM, ORDERED, ZERO_MEANS, Settings, resolve_device

NUMBERS = [f for f in dataclasses.fields(Settings) if f.type in ("int", "float")]


def var(f: dataclasses.Field) -> str:
    return f"KVSCOPE_{f.name.upper()}"


def test_every_number_is_read_from_its_variable():
    assert len(NUMBERS) > 20
    given = {f.name: min(7, MAXIMUM.get(f.name, 7)) for f in NUMBERS}  # one value for all: every ORDERED pair holds
    settings = Settings.from_env({var(f): str(given[f.name]) for f in NUMBERS})
    for f in NUMBERS:
        value = getattr(settings, f.name)
        assert value == given[f.name] and type(value) is {"int": int, "float": float}[f.type], f.name


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


def test_each_group_names_real_settings_and_is_what_its_lab_reads():
    names = {f.name for f in dataclasses.fields(Settings)}
    grouped = [name for group in GROUPS.values() for name in group]
    assert set(grouped) <= names
    for group in GROUPS.values():
        assert len(group) == len(set(group))
    # A lab holds its limits object, never the Settings: the object's fields are its group, so the group is what
    # the lab reads (less a prefix the group's names share, ``PREFIX``). (lines: the labs' lines, built by
    # app/state.py.)
    import app.state  # noqa: F401  (imports every lab, so every Limits subclass is defined)
    from app.labs.limits import Limits

    limits = {cls.GROUP: cls for cls in Limits.__subclasses__()}
    assert set(GROUPS) - set(limits) <= {"lines"}
    for group, cls in limits.items():
        assert {f.name for f in dataclasses.fields(cls)} == {n.removeprefix(cls.PREFIX) for n in GROUPS[group]}, cls
        assert cls.of(Settings()) == cls(**{n.removeprefix(cls.PREFIX): v for n, v in Settings().group(group).items()})
    # Every setting named after a lab is in that lab's group.
    prefixes = {"paged_": "paged", "prefix_": "prefix", "arena_": "arena", "spec_": "speculative", "train_": "train",
                "capacity_": "capacity", "inspect_": "inspect", "decode_": "decode",
                "patch_": "patch"}
    for name in names:
        for prefix, lab in prefixes.items():
            if name.startswith(prefix):
                assert name in GROUPS[lab], name
    assert Settings().group("paged")["paged_max_block_size"] == 16


@pytest.mark.parametrize("low, high", ORDERED)
def test_a_lower_bound_above_its_upper_one_stops_start_up_naming_both(low, high):
    defaults = Settings()
    above = getattr(defaults, high) * 2 if isinstance(getattr(defaults, high), float) else getattr(defaults, high) + 1
    with pytest.raises(BadSetting) as refused:
        Settings.from_env({f"KVSCOPE_{low.upper()}": str(above)})
    assert refused.value.message == translate("boot.settings.ordered", name=f"KVSCOPE_{low.upper()}",
                                              value=repr(type(getattr(defaults, low))(above)),
                                              other=f"KVSCOPE_{high.upper()}", high=repr(getattr(defaults, high)))
    assert f"KVSCOPE_{high.upper()}" in refused.value.text("zh")
    # Equal bounds are fine.
    assert getattr(Settings.from_env({f"KVSCOPE_{low.upper()}": str(getattr(defaults, high))}), low) == \
        getattr(defaults, high)


def test_settings_built_in_code_are_held_to_the_same_rules():
    """Not only the environment: ``Settings(...)`` with a bad number fails the same way (a ValueError too)."""
    with pytest.raises(BadSetting, match="^KVSCOPE_PAGED_MAX_BLOCKS must be at least 1, not -2"):
        Settings(paged_max_blocks=-2)
    with pytest.raises(ValueError, match="^KVSCOPE_TRAIN_MAX_LR must be more than 0"):
        Settings(train_max_lr=0.0)
    with pytest.raises(BadSetting, match="^KVSCOPE_PREFIX_DEFAULT_BLOCKS must be at most KVSCOPE_PREFIX_MAX_BLOCKS"):
        Settings(prefix_default_blocks=600)
    with pytest.raises(BadSetting, match="^KVSCOPE_ADDRESS_SHARE must be at most 1"):
        Settings.from_env({"KVSCOPE_ADDRESS_SHARE": "1.5"})
    with pytest.raises(BadSetting, match="whole number"):
        Settings(max_sessions=2.5)  # type: ignore[arg-type]
    assert Settings(malloc_arena_max=0, malloc_mmap_threshold_kib=0).malloc_arena_max == 0  # 0: glibc's default


def test_block_sizes_are_the_powers_of_two_up_to_the_largest():
    s = Settings()
    assert s.block_sizes(16) == (1, 2, 4, 8, 16) and s.block_sizes(7) == (1, 2, 4) and s.block_sizes(1) == (1,)


def test_a_lab_takes_its_limits_from_the_settings(tiny):
    """The paged lab and the capacity check offer what the settings allow, and refuse beyond it (one bound each)."""
    from app.model.loading import ModelRegistry
    from app.state import AppState

    registry = ModelRegistry(models={"builtin": tiny}, default="builtin", failures={})
    state = AppState.create(Settings(models=("builtin",), paged_max_blocks=8, paged_max_block_size=4,
                                     capacity_check_max_blocks=5), registry)
    assert state.paged.block_sizes == (1, 2, 4)
    with pytest.raises(BadInput, match="num_blocks must be from 2 to 8, not 9"):
        state.paged.create(model=None, num_blocks=9, block_size=4, who=Requester("a"), lang="en")
    with pytest.raises(BadInput, match="Block size must be one of 1, 2, 4"):
        state.paged.create(model=None, num_blocks=8, block_size=8, who=Requester("a"), lang="en")
    pool = state.paged.create(model=None, num_blocks=8, block_size=4, who=Requester("a"), lang="en")["pool"]
    assert pool["num_blocks"] == 8
    with pytest.raises(BadInput, match="num_blocks must be from 1 to 5, not 6"):
        state.capacity.check(model=None, num_blocks=6, block_size=4, max_num_seqs=2, requests_text="0 3 3")
    assert state.prefix.limits.prefix_max_blocks == 512 and state.prefix.peek("a").limits.prefix_max_blocks == 512


def test_a_second_server_with_other_settings_is_obeyed_as_nothing_is_read_at_import(tiny):
    """Two servers' states in one process, one with the defaults and one with other values: each obeys its own (a
    value read when a module was imported would hold for both). The prefix lab's default capacity, and the bound on
    pasted requests in the capacity check (it was the simulator's import-time default)."""
    from app.model.loading import ModelRegistry
    from app.state import AppState

    registry = ModelRegistry(models={"builtin": tiny}, default="builtin", failures={})
    default = AppState.create(Settings(models=("builtin",)), registry)
    other = AppState.create(Settings(models=("builtin",), prefix_default_blocks=100, capacity_sim_max_requests=2),
                            registry)
    three = "0 3 3\n0 3 3\n0 3 3\n"
    assert len(default.capacity.check(model=None, num_blocks=8, block_size=4, max_num_seqs=2,
                                      requests_text=three)["requests"]) == 3
    with pytest.raises(BadInput, match="At most 2 requests"):
        other.capacity.check(model=None, num_blocks=8, block_size=4, max_num_seqs=2, requests_text=three)
    for state, blocks in ((default, Settings().prefix_default_blocks), (other, 100)):
        lab = state.prefix.run(model=None, preset=None, prompts=["hello"], block_size=4, num_blocks=None, salt=None,
                               who=Requester("a"))
        assert lab.cache is not None and lab.cache.pool.num_blocks == blocks
