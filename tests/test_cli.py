"""The ``kvscope`` command's flags: ``serve``'s engine flags, repeated or comma-separated, reach the settings (and
are checked as the variables are); every ``--engine…`` flag the README tells a user to pass exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.cli import build_parser, serve_settings
from app.errors import BadSetting
from app.labs.engine import EngineLimits, links_from
from app.settings import Settings

README = Path(__file__).resolve().parents[1] / "README.md"


def serve(*flags: str, settings: Settings | None = None) -> Settings:
    return serve_settings(build_parser().parse_args(["serve", *flags]), settings or Settings())


def test_each_engine_gets_the_replay_socket_given_on_the_command_line():
    s = serve("--engine", "http://h:8000", "--engine", "http://h:8001", "--engine-events", "tcp://h:5557,tcp://h:5558",
              "--engine-replay", "tcp://h:5567", "--engine-replay", "tcp://h:5568")
    assert s.engine == ("http://h:8000", "http://h:8001") and s.engine_events == ("tcp://h:5557", "tcp://h:5558")
    assert [ln.replay_endpoint for ln in links_from(EngineLimits.of(s))] == ["tcp://h:5567", "tcp://h:5568"]
    # Without it: the events port + 1, as `kvscope engine` starts vLLM
    plain = serve("--engine", "http://h:8000", "--engine-events", "tcp://h:5557")
    assert [ln.replay_endpoint for ln in links_from(EngineLimits.of(plain))] == ["tcp://h:5558"]


def test_a_replay_socket_kvscope_cannot_connect_to_is_refused_naming_it():
    with pytest.raises(BadSetting) as refused:
        serve("--engine", "http://h:8000", "--engine-events", "tcp://h:5557", "--engine-replay", "tcp://*:5558")
    assert "KVSCOPE_ENGINE_REPLAY" in refused.value.message and "tcp://*:5558" in refused.value.message


def test_every_engine_flag_the_readme_names_is_one_serve_accepts():
    named = set(re.findall(r"(--engine[a-z-]*)", README.read_text(encoding="utf-8")))
    assert {"--engine", "--engine-events", "--engine-replay"} <= named
    for flag in named:  # argparse exits (status 2) on a flag it does not know
        args = build_parser().parse_args(["serve", flag, "tcp://h:5567"])
        assert getattr(args, flag.removeprefix("--").replace("-", "_")) == ["tcp://h:5567"]
