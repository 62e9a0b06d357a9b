"""The warm start's launcher (kgtp_sim/launch.py): it imports only the interpreter's built-in modules, and its
request is the JSON json.dumps writes, for the warm server's json.loads (warm.py) to read back exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kgtp_sim.launch import encode_request

from .conftest import ROOT

AWKWARD = ["", "plain", 'quote " and \\ backslash', "tab\tnew\nline\r\x00\x1f\x7f", "é ß 漢字 🙂",
           "\udcff\udc80 from a non-UTF-8 environment", "</script>", "\u2028\u2029"]


def test_the_request_is_what_json_writes_and_reads_back():
    argv = ["gdbserver", *AWKWARD]
    env = {f"K{i}{key}": value for i, (key, value) in enumerate(zip(AWKWARD, reversed(AWKWARD)))}
    cwd = AWKWARD[4]
    text = encode_request(argv, cwd, env)
    assert text == json.dumps({"argv": argv, "cwd": cwd, "env": env}).encode()
    assert json.loads(text) == {"argv": argv, "cwd": cwd, "env": env}
    assert encode_request([], "/", {}) == json.dumps({"argv": [], "cwd": "/", "env": {}}).encode()


def test_the_launcher_loads_no_module_of_the_standard_library_beyond_the_interpreters_own():
    probe = ("import sys; before = set(sys.modules); import kgtp_sim.launch; "
             "print(' '.join(sorted(set(sys.modules) - before)))")
    result = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    loaded = set(result.stdout.split())
    assert {"kgtp_sim", "kgtp_sim.launch"} <= loaded
    assert not loaded & {"json", "socket", "signal", "re", "enum", "selectors", "collections"}, loaded


def test_only_a_gdbserver_command_with_the_variable_set_is_offered(monkeypatch):
    from kgtp_sim import launch

    offered = []
    monkeypatch.setattr(launch, "launch", lambda path, argv: offered.append((path, argv)))
    monkeypatch.delenv(launch.ENV, raising=False)
    launch.offer(["gdbserver", ":1234"])
    monkeypatch.setenv(launch.ENV, "/run/warm.sock")
    launch.offer(["serve"])
    launch.offer([])
    launch.offer(["gdbserver", "--multi", ":1234"])
    assert offered == [("/run/warm.sock", ["gdbserver", "--multi", ":1234"])]
