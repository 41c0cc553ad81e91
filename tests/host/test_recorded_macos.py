"""The macOS parsers against recorded outputs (tests/host/fixtures/macos; read
its README for where they come from): the OS call is a thin wrapper, its parsing
a pure function tested here on any OS."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvd.host import pressure
from kvd.service import launchd

FIX = Path(__file__).parent / "fixtures" / "macos"


def sysctl_value(text: str) -> int:
    name, _, value = text.strip().partition(": ")
    assert name == "kern.memorystatus_vm_pressure_level"
    return int(value)


@pytest.mark.parametrize("n, level", [(1, "normal"), (2, "warn"), (4, "critical")])
def test_each_recorded_pressure_level_maps_to_kvds_level(n, level):
    raw = sysctl_value((FIX / f"sysctl_pressure_{n}.txt").read_text())
    assert raw == n and pressure.darwin_level(raw) == level


def test_an_unreadable_or_unknown_pressure_value_reads_as_normal():
    assert pressure.darwin_level(None) == "normal"
    assert pressure.darwin_level(0) == "normal" and pressure.darwin_level(3) == "normal"


def test_launchctl_print_of_a_running_agent():
    f = launchd.parse_print((FIX / "launchctl_print_running.txt").read_text())
    assert f["state"] == "running" and f["pid"] == "4242"
    assert f["path"].endswith("Library/LaunchAgents/io.kvd.daemon.plist")
    assert f["stdout path"].endswith("kvd.out.log") and f["stderr path"].endswith("kvd.err.log")
    assert f["last exit code"] == "(never exited)"
    assert "XPC_SERVICE_NAME" not in f and "activation rate" not in f  # nested blocks skipped
    assert launchd.describe_print((FIX / "launchctl_print_running.txt").read_text()) == \
        "state running, pid 4242, last exit code (never exited)"


def test_launchctl_print_of_an_agent_that_exited():
    text = (FIX / "launchctl_print_exited.txt").read_text()
    f = launchd.parse_print(text)
    assert f["state"] == "not running" and "pid" not in f and f["runs"] == "3"
    assert launchd.describe_print(text) == "state not running, last exit code 78: EX_CONFIG"


def test_launchctl_print_of_nothing_says_so():
    assert launchd.describe_print("") == "state ?"


def quoted_xucred() -> str:
    import inspect

    from kvd import endpoint

    src = inspect.getsource(endpoint)
    return src[src.index("#define XUCRED_VERSION"):src.index("XUCRED_SIZE =")]


def test_the_xucred_size_is_the_quoted_struct():
    import re

    from kvd import endpoint

    text = quoted_xucred()
    ngroups = int(re.search(r"#define NGROUPS (\d+)", text).group(1))
    fields = re.findall(r"(u_int|uid_t|short|gid_t)\s+(\w+)(?:\[NGROUPS\])?;", text)
    assert [n for _, n in fields] == ["cr_version", "cr_uid", "cr_ngroups", "cr_groups"]
    # u_int, uid_t, gid_t are 4 bytes, short 2 with 2 of padding before the gid_t array
    assert endpoint.XUCRED_SIZE == 4 + 4 + 2 + 2 + ngroups * 4
    assert "#define LOCAL_PEERCRED  0x001" in text and "#define SOL_LOCAL       0" in text


def test_recorded_local_peercred_bytes_give_the_uid():
    from kvd import endpoint

    lines = (FIX / "local_peercred_xucred.hex").read_text().splitlines()
    raw = bytes.fromhex("".join(x for x in lines if not x.startswith("#")))
    assert len(raw) == endpoint.XUCRED_SIZE and endpoint.xucred_uid(raw) == 501
    assert endpoint.xucred_uid(b"\1\0\0\0" + raw[4:]) is None  # another layout version
    assert endpoint.xucred_uid(raw[:6]) is None


def test_vm_stat_gives_page_size_and_pages():
    page, pages = pressure.parse_vm_stat((FIX / "vm_stat.txt").read_text())
    assert page == 16384  # Apple Silicon's 16 KiB pages
    assert pages["Pages free"] == 12345 and pages["Translation faults"] == 987654321
    assert pages["Pages stored in compressor"] == 654321 and len(pages) == 22
    assert pressure.vm_stat_available(page, pages) == 16384 * (12345 + 389012 + 4567)


def test_what_is_not_vm_stat_is_refused():
    with pytest.raises(ValueError, match="not vm_stat output"):
        pressure.parse_vm_stat("Pages free: 1.\n")


def test_service_status_reports_the_recorded_launchctl_print(tmp_path):
    from kvd.service import install as svc

    t = svc.Target("launchd", tmp_path, 501, "/usr/bin/python3", {"HOME": str(tmp_path)})
    asked = []

    def launchctl(argv):  # the thin wrapper's seam: what a Mac printed
        asked.append(tuple(argv))
        return svc.Result(0, (FIX / "launchctl_print_running.txt").read_text())

    st = svc.status(t, "ipc:///nowhere/kvd.sock", runner=launchctl, pinger=lambda ep: (True, "ping 0.10 ms"))
    assert asked == [("launchctl", "print", "gui/501/io.kvd.daemon")]
    assert st.loaded and st.loaded_detail == "state running, pid 4242, last exit code (never exited)"
