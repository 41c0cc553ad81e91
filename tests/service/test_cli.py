"""The admin CLI against a real daemon: output, exit codes, gc, stop."""

from __future__ import annotations

import json

import numpy as np

from support import kvd, prefix_snapshot, wait_spilled


def test_no_daemon_exits_3_with_a_clear_message(tmp_path):
    endpoint = f"ipc://{tmp_path}/none.sock"
    for cmd in (["stats"], ["gc", "--namespace", "x", "--data-dir", str(tmp_path / "empty")], ["stop"]):
        r = kvd(*cmd, "--endpoint", endpoint, "--timeout", "0.5")
        assert r.returncode == 3, (cmd, r.stderr)
        assert "kvd serve" in r.stderr and r.stdout == ""


def test_stats_table_and_json(kvd_daemon):
    with kvd_daemon.client("cli-ns", strict=True) as c:
        assert c.put(np.arange(300), prefix_snapshot(np.arange(300)))
        c.get(np.arange(300))
    r = kvd("stats", "--endpoint", kvd_daemon.endpoint)
    assert r.returncode == 0, r.stderr
    assert "ram" in r.stdout and "cli-ns" in r.stdout and "100.0%" in r.stdout
    for field in ("ssd", "spills=", "drops=", "checksum_failures=", "quarantined=", "promotions=", "evictions"):
        assert field in r.stdout, field
    j = json.loads(kvd("stats", "--json", "--endpoint", kvd_daemon.endpoint).stdout)
    assert j["namespaces"]["cli-ns"]["entries"] == 2 and j["tiers"]["ram"]["entries"] == 2


def test_gc_dry_run_then_namespace_drop_then_budget(kvd_daemon):
    with kvd_daemon.client("a", strict=True) as a, kvd_daemon.client("b", strict=True) as b:
        assert a.put(np.arange(600), prefix_snapshot(np.arange(600)))  # 3 entries
        assert b.put(np.arange(300), prefix_snapshot(np.arange(300)))  # 2 entries
        r = kvd("gc", "--namespace", "a", "--dry-run", "--json", "--endpoint", kvd_daemon.endpoint)
        assert r.returncode == 0 and json.loads(r.stdout)["entries"] == 3
        assert a.probe(np.arange(600)).n == 600  # dry run removed nothing
        r = kvd("gc", "--namespace", "a", "--endpoint", kvd_daemon.endpoint)
        assert r.returncode == 0 and "removed 3 entries" in r.stdout
        assert a.probe(np.arange(600)).n == 0 and b.probe(np.arange(300)).n == 300
        r = kvd("gc", "--ram-mb", "0", "--json", "--endpoint", kvd_daemon.endpoint)
        assert json.loads(r.stdout)["details"]["evicted_ram"]["entries"] == 2
        tiers = b.stats()["tiers"]
        assert tiers["ram"]["entries"] == 0
        assert b.probe(np.arange(300)).n == 300  # evicted from RAM = spilled to SSD, still served


def test_stop_stops_the_daemon_and_it_exits_0(kvd_daemon):
    r = kvd("stop", "--endpoint", kvd_daemon.endpoint)
    assert r.returncode == 0, (r.stdout, r.stderr, kvd_daemon.log())
    assert kvd_daemon.proc.wait(10) == 0, kvd_daemon.log()


def test_names_with_escape_sequences_reach_the_terminal_escaped(kvd_daemon):
    """A namespace is any string a client sent: its escape sequences (a title
    change, a screen clear, a right-to-left override) are printed escaped by
    every view, from the daemon and from the data dir, never sent to the terminal."""
    evil = "ns\x1b]0;pwned\x07\x1b[2J\u202etxt"
    with kvd_daemon.client(evil, strict=True) as c:
        assert c.put(np.arange(300), prefix_snapshot(np.arange(300)))
        wait_spilled(c, 2)
    ep = ("--endpoint", kvd_daemon.endpoint)
    tokens = kvd_daemon.workdir / "tokens.json"
    tokens.write_text(json.dumps(list(range(300))))
    views = [("stats", *ep), ("ls", *ep), ("top", "--count", "1", *ep), ("gc", "--namespace", evil, "--dry-run", *ep),
             ("explain", "--namespace", evil, "--tokens-file", str(tokens), *ep)]
    offline = [("stats", "--offline", "--data-dir", str(kvd_daemon.data_dir)),
               ("ls", "--offline", "--data-dir", str(kvd_daemon.data_dir))]
    for args in views + [None] + offline:
        if args is None:
            assert kvd_daemon.stop() == 0
            continue
        r = kvd(*args)
        assert r.returncode == 0, (args, r.stderr)
        out = r.stdout + r.stderr
        assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out, (args, out)
        if args[0] != "gc":  # (gc says what it would remove, not whose)
            assert "ns\\x1b]0;pwned\\x07\\x1b[2J\\u202etxt" in out, (args, out)


def test_each_command_is_loaded_from_its_module_and_serve_loads_no_other():
    """`kvd.cli.COMMANDS` names every command's module: each is found through
    the table, the table names no command that is not there, and a fresh
    interpreter running `kvd serve --help` imports none of the other
    commands' modules (a daemon starts without them)."""
    import subprocess
    import sys

    import click

    from kvd.cli import COMMANDS, main

    ctx = click.Context(main)
    for name, module in COMMANDS.items():
        cmd = main.get_command(ctx, name)
        assert cmd is not None and cmd.callback.__module__ == f"kvd.cli.{module}", (name, cmd)
    assert sorted(main.commands) == sorted(COMMANDS) == main.list_commands(ctx)
    probe = ("import sys; from kvd.cli import main\n"
             "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in sys.modules if m.startswith('kvd.cli.')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    loaded = out.strip().splitlines()[-1]
    assert "kvd.cli.serve" in loaded and "kvd.cli.doctor" not in loaded and "kvd.cli.top" not in loaded, loaded
