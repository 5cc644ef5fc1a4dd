"""The ``kvscope`` command's flags: ``serve``'s engine flags, repeated or comma-separated, reach the settings (and
are checked as the variables are); every ``--engine…`` flag the README tells a user to pass exists; ``kvscope engine``
prints a ``serve`` line that runs, and SIGTERM or SIGINT to it stops its real vLLM."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.cli import build_parser, kvscope_command, serve_settings
from app.engine.launch import free_port, free_port_pair
from app.errors import BadSetting
from app.labs.engine import EngineLimits, links_from
from app.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


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


def test_the_kvscope_command_is_the_venvs_script_where_path_does_not_find_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a shell that has not activated the venv
    monkeypatch.chdir(ROOT)
    cmd = kvscope_command()
    assert cmd != "kvscope"
    runs = subprocess.run([*cmd.split(), "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert runs.returncode == 0 and "--engine-replay" in runs.stdout


def listening(port: int) -> bool:
    """Whether any process listens on this TCP port (the kernel's own table: a closed server's TIME_WAIT is not
    a listener)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                return True
    return False


def process_group_alive(pgid: int) -> bool:
    """A process of the group still runs (a zombie, already dead and waiting for its new parent to reap it, does not
    count: it holds no memory and no port)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state != "Z":
            return True
    return False


def children_of(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # the field after the state: the parent's id
            out.append(int(stat.parent.name))
    return out


def start_engine_cli(engine_venv_dir, smollm2_dir):
    """``kvscope engine`` on free ports, with SIGINT ignored as a shell's ``&`` starts a background job (Ctrl-C /
    kill -INT must still stop it), read until it says its engine is up: (process, its ports, what it said)."""
    http, events = free_port(), free_port_pair()
    no_kvscope = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "kvscope").exists())
    env = {**os.environ, "KVSCOPE_HOME": str(smollm2_dir.parents[1]), "PATH": no_kvscope}
    cli = subprocess.Popen([sys.executable, "-m", "app.cli", "engine", "--port", str(http), "--events-port",
                            str(events), "--venv", str(engine_venv_dir)], cwd=ROOT, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in cli.stdout], daemon=True).start()
    said: list[str] = []
    deadline = time.monotonic() + 420
    while not any("stops it" in line for line in said) and time.monotonic() < deadline:
        if cli.poll() is not None:
            break
        try:
            said.append(lines.get(timeout=1))
        except queue.Empty:
            continue
    return cli, (http, events), said


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_kvscope_engine_stops_its_vllm_and_frees_its_ports(sig, engine_venv_dir, smollm2_dir, tmp_path):
    cli, (http, events), said = start_engine_cli(engine_venv_dir, smollm2_dir)
    if cli.poll() is not None and "not healthy" in "".join(said):
        # vLLM's start on 2 busy cores has stalled at its worker's start (seen once in a run beside another suite):
        # what is tested here is the stop, so a start that never came up is tried once more, on new ports.
        cli, (http, events), said = start_engine_cli(engine_venv_dir, smollm2_dir)
    vllm: list[int] = []
    try:
        assert any("stops it" in line for line in said), "".join(said)
        vllm = children_of(cli.pid)
        assert len(vllm) == 1 and listening(http) and listening(events)
        line = next(x for x in "".join(said).splitlines() if " serve --engine " in x).strip()
        assert line.startswith(".venv/bin/kvscope serve --engine http://127.0.0.1:")  # not on this PATH
        cli.send_signal(sig)
        assert cli.wait(timeout=60) == 0
        time.sleep(0.5)
        assert not process_group_alive(vllm[0])  # vLLM and its engine-core child: its own session, all gone
        assert not any(listening(p) for p in (http, events, events + 1))
    finally:
        if cli.poll() is None:
            cli.kill()
        for pgid in vllm:
            if process_group_alive(pgid):
                os.killpg(pgid, signal.SIGKILL)


def test_the_readmes_data_parallel_serve_line_is_one_serve_accepts():
    import shlex

    text = README.read_text(encoding="utf-8").replace("\\\n", " ")
    lines = [x.strip() for x in text.splitlines() if x.strip().startswith(".venv/bin/kvscope serve --engine")]
    assert lines  # the data-parallel example
    for line in lines:
        s = serve_settings(build_parser().parse_args(shlex.split(line)[1:]), Settings())
        assert len(s.engine) == len(s.engine_events) == len(s.engine_replay) == 2
        assert [ln.replay_endpoint for ln in links_from(EngineLimits.of(s))] == list(s.engine_replay)
