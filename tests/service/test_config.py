"""kvd.config: the settings table, precedence default < file < env < flag, errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvd import config as C
from kvd.cli import exits

# Three distinct valid values per kind: (file, env, flag) as given, then parsed.
SAMPLES = {
    "int": ((11, "12", 13), (11, 12, 13)),
    "float": ((1.5, "2.5", 3.5), (1.5, 2.5, 3.5)),
    "bool": ((True, "false", True), (True, False, True)),
    "str": (("ipc:///tmp/f.sock", "ipc:///tmp/e.sock", "tcp://127.0.0.1:5599"),) * 2,
    "choice": (("debug", "WARNING", "error"), ("debug", "warning", "error")),
    "path": (("/tmp/kvd-f", "/tmp/kvd-e", "/tmp/kvd-x"),) * 2,
    "int_auto": ((11, "auto", "13"), (11, "auto", 13)),
    "source": (("off", "file:/tmp/p", "AUTO"), ("off", "file:/tmp/p", "auto")),
    "url": (("redis://h:6379/0", "valkey://u:p@h2:1", "rediss://h3:6380"),) * 2,
    "host": (("portable", "AUTO", "portable"), ("portable", "auto", "portable")),
}


def toml_literal(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def write_toml(path: Path, values: dict[str, object]) -> Path:
    path.write_text("".join(f"{k} = {toml_literal(v)}\n" for k, v in values.items()))
    return path


@pytest.fixture
def env(tmp_path, monkeypatch) -> dict[str, str]:
    """A clean environment with a fake HOME, also applied to os.environ."""
    for k in list(os.environ):
        if k.startswith("KVD_") or k.startswith("XDG_"):
            monkeypatch.delenv(k)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return {"HOME": str(home)}


def test_every_setting_is_documented_and_named_consistently():
    names = [s.name for s in C.SETTINGS]
    assert len(names) == len(set(names))
    required = {"endpoint", "ram_mb", "data_dir", "ssd_gb", "min_free_gb", "write_through",
                "spill_queue", "max_message_mb", "log_level", "log_file", "metrics_port",
                "timeout", "chunk_tokens"}
    assert required <= set(names)
    for s in C.SETTINGS:
        assert s.doc and s.doc[0].isupper() and s.doc.endswith("."), s.name
        assert s.env == "KVD_" + s.name.upper()
        assert s.flag == "--" + s.name.replace("_", "-")
        assert s.kind in SAMPLES, f"{s.name}: no test samples for kind {s.kind}"
        assert s.describe_default()


@pytest.mark.parametrize("setting", C.SETTINGS, ids=lambda s: s.name)
def test_precedence_file_env_flag(setting, env, tmp_path):
    (file_v, env_v, flag_v), (file_p, env_p, flag_p) = SAMPLES[setting.kind]
    cfg_file = write_toml(tmp_path / "kvd.toml", {setting.name: file_v})
    name = setting.name

    cfg = C.resolve(environ=env, config_path=cfg_file)
    assert (getattr(cfg, name), cfg.sources[name]) == (file_p, f"file:{cfg_file}")
    assert cfg.config_path == cfg_file

    env2 = {**env, setting.env: env_v}
    cfg = C.resolve(environ=env2, config_path=cfg_file)
    assert (getattr(cfg, name), cfg.sources[name]) == (env_p, f"env:{setting.env}")

    cfg = C.resolve({name: flag_v}, environ=env2, config_path=cfg_file)
    assert (getattr(cfg, name), cfg.sources[name]) == (flag_p, f"flag:{setting.flag}")

    cfg = C.resolve({name: None}, environ=env2, config_path=cfg_file)  # None = flag not given
    assert cfg.sources[name] == f"env:{setting.env}"


def test_defaults(env):
    cfg = C.resolve(environ=env)
    assert set(cfg.sources.values()) == {"default"}
    assert cfg.config_path is None
    assert (cfg.ram_mb, cfg.ssd_gb, cfg.min_free_gb) == (1024, 16.0, 2.0)
    assert (cfg.write_through, cfg.spill_queue, cfg.max_message_mb) == (False, 256, 512)
    assert (cfg.log_level, cfg.log_file, cfg.metrics_port) == ("info", None, 0)
    assert (cfg.timeout, cfg.chunk_tokens) == (5.0, 256)
    assert cfg.data_dir == C.default_data_dir(env)
    assert cfg.endpoint.startswith("ipc://")
    assert list(cfg.as_dict()) == [s.name for s in C.SETTINGS]


def test_default_locations():
    home = {"HOME": "/h"}
    assert C.default_config_path(home, "linux") == Path("/h/.config/kvd/kvd.toml")
    assert C.default_config_path({**home, "XDG_CONFIG_HOME": "/x"}, "linux") == Path("/x/kvd/kvd.toml")
    assert C.default_config_path({**home, "XDG_CONFIG_HOME": "rel"}, "linux") == Path("/h/.config/kvd/kvd.toml")
    assert C.default_config_path(home, "darwin") == Path("/h/Library/Application Support/kvd/kvd.toml")
    assert C.default_data_dir(home, "linux") == "/h/.cache/kvd"
    assert C.default_data_dir({**home, "XDG_CACHE_HOME": "/c"}, "linux") == "/c/kvd"
    assert C.default_data_dir(home, "darwin") == "/h/Library/Caches/kvd"


def test_config_file_is_found_by_env_then_default(env, tmp_path):
    default = C.default_config_path(env)
    default.parent.mkdir(parents=True)
    write_toml(default, {"ram_mb": 100})
    assert C.resolve(environ=env).sources["ram_mb"] == f"file:{default}"
    other = write_toml(tmp_path / "other.toml", {"ram_mb": 200})
    cfg = C.resolve(environ={**env, "KVD_CONFIG": str(other)})
    assert (cfg.ram_mb, cfg.config_path) == (200, other)
    third = write_toml(tmp_path / "third.toml", {"ram_mb": 300})
    cfg = C.resolve({"config": str(third)}, environ={**env, "KVD_CONFIG": str(other)})
    assert (cfg.ram_mb, cfg.config_path) == (300, third)


def test_data_dir_none_and_relative_paths(env, tmp_path):
    assert C.resolve({"data_dir": "none"}, environ=env).data_dir is None
    assert C.resolve(environ={**env, "KVD_DATA_DIR": ""}).data_dir is None
    sub = tmp_path / "conf"
    sub.mkdir()
    f = write_toml(sub / "kvd.toml", {"data_dir": "store", "log_file": "~/kvd.log"})
    cfg = C.resolve(environ=env, config_path=f)
    assert cfg.data_dir == str(sub / "store")  # relative to the file's folder
    assert cfg.log_file == os.path.join(env["HOME"], "kvd.log")


@pytest.mark.parametrize(
    "flags, environ, file_values, needle",
    [
        ({}, {"KVD_RAM_MB": "lots"}, {}, "ram_mb (from env:KVD_RAM_MB)"),
        ({}, {"KVD_RAM_MB": "0"}, {}, "ram_mb (from env:KVD_RAM_MB): must be >= 1"),
        ({}, {}, {"ram_mb": "1024"}, "ram_mb (from file:"),
        ({}, {}, {"ram_mb": 1.5}, "ram_mb (from file:"),
        ({"metrics_port": 70000}, {}, {}, "metrics_port (from flag:--metrics-port)"),
        ({}, {"KVD_TIMEOUT": "0"}, {}, "timeout (from env:KVD_TIMEOUT): must be > 0"),
        ({}, {"KVD_TIMEOUT": "nan"}, {}, "timeout (from env:KVD_TIMEOUT)"),
        ({}, {"KVD_WRITE_THROUGH": "maybe"}, {}, "write_through (from env:KVD_WRITE_THROUGH)"),
        ({}, {}, {"write_through": 1}, "write_through (from file:"),
        ({}, {"KVD_LOG_LEVEL": "loud"}, {}, "log_level (from env:KVD_LOG_LEVEL)"),
        ({"endpoint": "/tmp/x.sock"}, {}, {}, "endpoint (from flag:--endpoint)"),
        ({}, {}, {"ssd_gb": -1}, "ssd_gb (from file:"),
        ({}, {}, {"data_dir": 5}, "data_dir (from file:"),
        ({}, {}, {"ram_gb": 5}, "unknown setting(s) ram_gb"),
        # Past a bound: no OverflowError later, in a float() or a poll, a lock, an encoder.
        ({}, {}, {"ssd_gb": 10**400}, "ssd_gb (from file:"),
        ({}, {}, {"timeout": 10**400}, "timeout (from file:"),
        ({"timeout": 3e6}, {}, {}, "timeout (from flag:--timeout): must be <= 1e+06"),
        ({}, {"KVD_STOP_TIMEOUT": "1e300"}, {}, "stop_timeout (from env:KVD_STOP_TIMEOUT): must be <="),
        ({}, {"KVD_DIRTY_MAX_MB": str(10**15)}, {}, "dirty_max_mb (from env:KVD_DIRTY_MAX_MB)"),
        ({"ram_mb": 10**15}, {}, {}, "ram_mb (from flag:--ram-mb)"),
    ],
)
def test_bad_values_name_setting_and_source(env, tmp_path, flags, environ, file_values, needle):
    f = write_toml(tmp_path / "kvd.toml", file_values)
    with pytest.raises(C.ConfigError) as info:
        C.resolve(flags, environ={**env, **environ}, config_path=f)
    assert needle in str(info.value)


def test_file_errors(env, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("ram_mb = = 3\n")
    with pytest.raises(C.ConfigError, match="not valid TOML"):
        C.resolve(environ=env, config_path=bad)
    with pytest.raises(C.ConfigError, match=r"from --config\) does not exist"):
        C.resolve(environ=env, config_path=tmp_path / "missing.toml")
    with pytest.raises(C.ConfigError, match=r"from \$KVD_CONFIG\) does not exist"):
        C.resolve(environ={**env, "KVD_CONFIG": str(tmp_path / "missing.toml")})


def test_unknown_flags_are_ignored(env):
    cfg = C.resolve({"foreground": True, "ram_mb": 7}, environ=env)
    assert cfg.ram_mb == 7
    with pytest.raises(AttributeError):
        cfg.foreground


def test_click_options_round_trip(env, tmp_path):
    @click.command()
    @C.config_options
    def cmd(**kwargs):
        cfg = C.resolve(kwargs)
        click.echo(json.dumps({"values": cfg.as_dict(), "sources": cfg.sources}))

    runner = CliRunner()
    help_text = runner.invoke(cmd, ["--help"], terminal_width=200).output
    for s in C.SETTINGS:
        assert s.flag in help_text and s.env in help_text, s.name
    assert "--config" in help_text and "--no-write-through" in help_text

    f = write_toml(tmp_path / "k.toml", {"ram_mb": 5, "write_through": True})
    result = runner.invoke(
        cmd,
        ["--config", str(f), "--ssd-gb", "3", "--no-write-through", "--log-level", "DEBUG"],
        env={"KVD_RAM_MB": "6"},
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["values"]["ram_mb"] == 6 and out["sources"]["ram_mb"] == "env:KVD_RAM_MB"
    assert out["values"]["ssd_gb"] == 3.0 and out["sources"]["ssd_gb"] == "flag:--ssd-gb"
    assert out["values"]["write_through"] is False
    assert out["sources"]["write_through"] == "flag:--write-through"
    assert out["values"]["log_level"] == "debug"
    assert out["sources"]["chunk_tokens"] == "default"


def test_kvd_config_command(env, tmp_path):
    import tomllib

    from kvd.cli import config_cmd, main  # noqa: F401  (registers `kvd config`)

    runner = CliRunner()
    f = write_toml(tmp_path / "k.toml", {"ram_mb": 5})
    result = runner.invoke(main, ["config", "--config", str(f), "--chunk-tokens", "64"],
                           env={"KVD_SSD_GB": "1.5"})
    assert result.exit_code == 0, result.output
    lines = {ln.split(" = ")[0]: ln for ln in result.output.splitlines() if " = " in ln}
    assert lines["ram_mb"].endswith(f"# file:{f}")
    assert lines["ssd_gb"].endswith("# env:KVD_SSD_GB")
    assert lines["chunk_tokens"].endswith("# flag:--chunk-tokens")
    assert lines["timeout"].endswith("# default")
    parsed = tomllib.loads(result.output)  # the text output is itself a config file
    assert parsed["ram_mb"] == 5 and parsed["ssd_gb"] == 1.5 and parsed["log_file"] == "none"
    assert C.resolve(environ=env, config_path=_save(tmp_path, result.output)).chunk_tokens == 64

    result = runner.invoke(main, ["config", "--json", "--config", str(f)])
    data = json.loads(result.output)
    assert data["config_file"] == str(f)
    assert data["settings"]["ram_mb"] == {
        "value": 5, "source": f"file:{f}", "env": "KVD_RAM_MB", "flag": "--ram-mb",
        "doc": C.BY_NAME["ram_mb"].doc,
    }

    result = runner.invoke(main, ["config"], env={"KVD_RAM_MB": "x"})
    assert result.exit_code == exits.CONFIG
    assert "ram_mb (from env:KVD_RAM_MB)" in result.output


def _save(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "saved.toml"
    p.write_text(text)
    return p
