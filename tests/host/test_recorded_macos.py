"""The macOS parsers against recorded outputs (tests/host/fixtures/macos; read
its README for where they come from): the OS call is a thin wrapper, its parsing
a pure function tested here on any OS."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvd.host import pressure
from kvd.service import launchd

FIX = Path(__file__).parent / "fixtures" / "macos"


def recorded(name: str) -> str:
    """A fixture's recorded text: its leading `# ` header (where the text comes
    from) left out, the rest as it was printed."""
    lines = (FIX / name).read_text().splitlines(keepends=True)
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return "".join(lines)


def test_every_fixture_names_its_source_or_says_it_is_hand_written():
    for path in FIX.iterdir():
        if path.name == "README.md":
            continue
        head = path.read_text().splitlines()[0]
        assert head.startswith("# source: https://github.com/") or head.startswith("# HAND-WRITTEN"), path.name


def sysctl_value(text: str) -> int:
    name, _, value = text.strip().partition(": ")
    assert name == "kern.memorystatus_vm_pressure_level"
    return int(value)


@pytest.mark.parametrize("n, level", [(1, "normal"), (2, "warn"), (4, "critical")])
def test_each_recorded_pressure_level_maps_to_kvds_level(n, level):
    raw = sysctl_value(recorded(f"sysctl_pressure_{n}.txt"))
    assert raw == n and pressure.darwin_level(raw) == level


def test_an_unreadable_or_unknown_pressure_value_reads_as_normal():
    assert pressure.darwin_level(None) == "normal"
    assert pressure.darwin_level(0) == "normal" and pressure.darwin_level(3) == "normal"


def test_launchctl_print_of_a_running_daemon_macos_mojave():
    text = recorded("launchctl_print_running.txt")
    f = launchd.parse_print(text)
    assert f["state"] == "running" and f["pid"] == "1486" and f["runs"] == "3"
    assert f["path"] == "/Library/LaunchDaemons/com.wazuh.agent.plist"
    assert f["program"] == "/Library/StartupItems/WAZUH/Wazuh-launcher"
    assert f["domain"] == "com.apple.xpc.launchd.domain.system" and f["last exit code"] == "0"
    assert "PATH" not in f and "XPC_SERVICE_NAME" not in f  # nested blocks skipped
    assert launchd.describe_print(text) == "state running, pid 1486, last exit code 0"


def test_launchctl_print_of_a_daemon_that_ran_and_exited():
    text = recorded("launchctl_print_exited.txt")
    f = launchd.parse_print(text)
    assert f["state"] == "not running" and "pid" not in f and f["runs"] == "1"
    assert f["type"] == "LaunchDaemon" and f["active count"] == "0"
    assert f["program"] == "/Library/Application Support/Wazuh agent.app/bin/wazuh-agent"  # spaces kept
    assert f["stdout path"] == "/var/log/wazuh-output.log" and f["stderr path"] == "/var/log/wazuh-error.log"
    assert f["spawn type"] == "daemon (3)" and f["jetsam memory limit (active)"] == "(unlimited)"
    assert f["last exit code"] == "0"
    assert launchd.describe_print(text) == "state not running, last exit code 0"


def test_launchctl_print_of_nothing_says_so():
    assert launchd.describe_print("") == "state ?"


def quoted_xucred() -> str:
    import inspect

    from kvd import endpoint

    src = inspect.getsource(endpoint)
    return src[src.index("# macOS: struct xucred"):src.index("XUCRED_SIZE =")]


C_SIZES = {"u_int": 4, "uid_t": 4, "short": 2, "gid_t": 4}  # Darwin's, on arm64 and x86-64


def test_the_xucred_size_is_the_quoted_struct():
    import re

    from kvd import endpoint

    text = quoted_xucred()
    assert re.search(r"#define NGROUPS\s+NGROUPS_MAX\s", text)
    ngroups = int(re.search(r"#define NGROUPS_MAX\s+(\d+)", text).group(1))
    body = re.search(r"struct xucred \{(.*?)\};", text, re.S).group(1)
    fields = re.findall(r"(\w+)\s+(\w+)(\[NGROUPS\])?;", body)
    assert [(t, n) for t, n, _ in fields] == [
        ("u_int", "cr_version"), ("uid_t", "cr_uid"), ("short", "cr_ngroups"), ("gid_t", "cr_groups")]
    offset = 0
    for ctype, name, array in fields:  # C layout: each field aligned to its own size
        size = C_SIZES[ctype]
        offset = -(-offset // size) * size
        if name == "cr_uid":
            assert offset == 4  # where xucred_uid reads it
        offset += size * (ngroups if array else 1)
    assert endpoint.XUCRED_SIZE == offset == 76
    assert int(re.search(r"#define XUCRED_VERSION\s+(\d+)", text).group(1)) == 0  # the version xucred_uid accepts
    sol_local = int(re.search(r"#define SOL_LOCAL\s+(\w+)", text).group(1), 0)
    peercred = int(re.search(r"#define LOCAL_PEERCRED\s+(\w+)", text).group(1), 0)
    assert (sol_local, peercred) == (0, 1)
    # and peer_uid passes those numbers on a Mac
    import inspect
    assert "s.getsockopt(0, 1, XUCRED_SIZE)" in inspect.getsource(endpoint.peer_uid)


def test_recorded_local_peercred_bytes_give_the_uid():
    from kvd import endpoint

    lines = (FIX / "local_peercred_xucred.hex").read_text().splitlines()
    raw = bytes.fromhex("".join(x for x in lines if not x.startswith("#")))
    assert len(raw) == endpoint.XUCRED_SIZE and endpoint.xucred_uid(raw) == 501
    assert endpoint.xucred_uid(b"\1\0\0\0" + raw[4:]) is None  # another layout version
    assert endpoint.xucred_uid(raw[:6]) is None


def test_vm_stat_of_an_intel_mac_gives_page_size_and_pages():
    page, pages = pressure.parse_vm_stat(recorded("vm_stat_intel.txt"))
    assert page == 4096
    assert pages["Pages free"] == 6127229 and pages["Pages inactive"] == 628646
    assert pages["Pages speculative"] == 430715 and pages["Pages wired down"] == 715958
    assert pages["Translation faults"] == 11477162  # printed in quotes
    assert pages["Pages stored in compressor"] == 0 and pages["Pageins"] == 280307
    assert len(pages) == 22 and pages["Swapouts"] == 0
    assert pressure.vm_stat_available(page, pages) == 4096 * (6127229 + 628646 + 430715)


def test_what_is_not_vm_stat_is_refused():
    with pytest.raises(ValueError, match="not vm_stat output"):
        pressure.parse_vm_stat("Pages free: 1.\n")


def test_service_status_reports_the_recorded_launchctl_print(tmp_path):
    from kvd.service import install as svc

    t = svc.Target("launchd", tmp_path, 501, "/usr/bin/python3", {"HOME": str(tmp_path)})
    asked = []

    def launchctl(argv):  # the thin wrapper's seam: what a Mac printed
        asked.append(tuple(argv))
        return svc.Result(0, recorded("launchctl_print_running.txt"))

    st = svc.status(t, "ipc:///nowhere/kvd.sock", runner=launchctl, pinger=lambda ep: (True, "ping 0.10 ms"))
    assert asked == [("launchctl", "print", "gui/501/io.kvd.daemon")]
    assert st.loaded and st.loaded_detail == "state running, pid 1486, last exit code 0"
