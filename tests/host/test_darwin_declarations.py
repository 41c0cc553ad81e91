"""The macOS constants and ctypes declarations of kvd/host (pressure, peercred,
fds) checked against the xnu header text each module quotes (runs anywhere):
the numbers in the code are the quoted ones, and the sysctl read works on a
stand-in for sysctlbyname that writes what the kernel's handler writes."""

from __future__ import annotations

import ctypes
import inspect
import re

import pytest

from kvd.host import fds, peercred, pressure


def quote(module, start: str, end: str) -> str:
    src = inspect.getsource(module)
    return src[src.index(start):src.index(end)]


def defines(text: str) -> dict[str, int]:
    return {k: int(v, 0) for k, v in re.findall(r"#define (\w+)\s+(0x[0-9a-fA-F]+|\d+)\b", text)}


def pressure_quote() -> str:
    return quote(pressure, "# The kernel's side, quoted verbatim", "# END_XNU_QUOTE")


def test_the_pressure_levels_are_the_quoted_note_constants():
    d = defines(pressure_quote())
    assert pressure.DARWIN_LEVELS == {
        d["NOTE_MEMORYSTATUS_PRESSURE_NORMAL"]: "normal",
        d["NOTE_MEMORYSTATUS_PRESSURE_WARN"]: "warn",
        d["NOTE_MEMORYSTATUS_PRESSURE_CRITICAL"]: "critical",
    }


def test_each_sysctl_is_read_with_the_width_the_kernel_writes():
    text = pressure_quote()
    # the pressure handler writes a uint32_t (CTLTYPE_INT); hw.memsize is a SYSCTL_QUAD
    assert "uint32_t dispatch_level" in text and "SYSCTL_OUT(req, &dispatch_level, sizeof(dispatch_level))" in text
    assert re.search(r"SYSCTL_PROC\(_kern, OID_AUTO, memorystatus_vm_pressure_level, CTLTYPE_INT\b", text)
    assert re.search(r"SYSCTL_QUAD\(_hw, HW_MEMSIZE, memsize,", text)
    assert pressure.SYSCTL_CTYPES["kern.memorystatus_vm_pressure_level"] is ctypes.c_uint32
    assert pressure.SYSCTL_CTYPES["hw.memsize"] is ctypes.c_uint64


def test_sysctlbyname_is_declared_as_the_prototype():
    flat = " ".join(line.lstrip("# ") for line in pressure_quote().splitlines())  # the comment's prefix off
    proto = re.search(r"int\s+sysctlbyname\((.*?)\);", flat).group(1)
    params = [re.sub(r"\s+", " ", re.sub(r"__sized_by\(.*?\)", "", p)).strip() for p in proto.split(",")]
    assert params == ["const char *", "void *", "size_t *oldlenp", "void *", "size_t newlen"]
    want = (ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p, ctypes.c_size_t)
    assert pressure.SYSCTLBYNAME_ARGTYPES == want and pressure.SYSCTLBYNAME_RESTYPE is ctypes.c_int

    class Lib:  # a stand-in library: the binding must set what the header declares
        sysctlbyname = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 0)

    fn = pressure.bind_sysctlbyname(Lib())
    assert tuple(fn.argtypes) == want and fn.restype is ctypes.c_int


def kernel(values: dict[bytes, tuple[int, int]], seen: list):
    """A sysctlbyname that writes `values[name]` = (value, width) as the kernel's
    handler does (SYSCTL_OUT: the bytes and their length); -1 for other names."""

    def call(name, old, oldlenp, new, newlen):
        seen.append((name, oldlenp[0]))
        if name not in values:
            return -1
        value, width = values[name]
        ctypes.memmove(old, value.to_bytes(width, "little"), width)
        oldlenp[0] = width
        return 0

    return ctypes.CFUNCTYPE(pressure.SYSCTLBYNAME_RESTYPE, *pressure.SYSCTLBYNAME_ARGTYPES)(call)


@pytest.mark.skipif(__import__("sys").byteorder != "little", reason="the stand-in kernel writes little-endian")
def test_sysctl_int_reads_what_the_kernel_writes():
    seen = []
    call = kernel({b"kern.memorystatus_vm_pressure_level": (4, 4), b"hw.memsize": (24 << 30, 8)}, seen)
    assert pressure.sysctl_int("kern.memorystatus_vm_pressure_level", call) == 4
    assert pressure.sysctl_int("hw.memsize", call) == 24 << 30
    assert seen == [(b"kern.memorystatus_vm_pressure_level", 4), (b"hw.memsize", 8)]  # the buffer sizes asked
    assert pressure.darwin_level(pressure.sysctl_int("kern.memorystatus_vm_pressure_level", call)) == "critical"
    failing = kernel({}, seen)
    assert pressure.sysctl_int("hw.memsize", failing) is None


def test_the_peer_pid_option_is_the_quoted_one():
    d = defines(quote(peercred, "macOS: the socket option", "END_XNU_QUOTE"))
    assert (d["SOL_LOCAL"], d["LOCAL_PEERPID"]) == (peercred.SOL_LOCAL, peercred.LOCAL_PEERPID) == (0, 2)
    assert "pid_t" in quote(peercred, "macOS: the socket option", "END_XNU_QUOTE")
    assert peercred.PID_SIZE == 4  # pid_t is an int32 on Darwin


def test_the_fd_ceiling_is_the_quoted_open_max():
    text = quote(fds, "OPEN_MAX, quoted", "END_XNU_QUOTE")
    d = defines(text)
    assert fds.OPEN_MAX == d["OPEN_MAX"] == 10240
    assert d["RLIMIT_NOFILE"] == 8
    assert "RLIM_INFINITY   (((__uint64_t)1 << 63) - 1)" in text
