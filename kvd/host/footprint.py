"""macOS: this process's physical footprint, the figure Activity Monitor and
the kernel's memory accounting (jetsam) use, read with one proc_pid_rusage()
call through ctypes (a few microseconds, no allocation in the kernel).

What each OS gives:

    Linux   not this module: /proc/self/statm (kvd/host/memory.py).
    macOS   proc_pid_rusage(getpid(), RUSAGE_INFO_V2, &rusage_info_v2) from
            libSystem (libproc), field ri_phys_footprint: resident anonymous
            and compressed memory, which leaves out file-backed maps (the
            index's) and, like RssAnon, counts what this process dirtied.

The C declarations below are quoted verbatim (tabs expanded, indented) from
Apple's open-source xnu, the source of the SDK's headers: repository
apple-oss-distributions/xnu, tag xnu-11417.101.15 (the macOS 15 kernel), commit
e3723e1f17661b24996789d8afc084c0c3303b26, files bsd/sys/resource.h and
libsyscall/wrappers/libproc/libproc.h, which the SDK installs as
usr/include/sys/resource.h and usr/include/libproc.h (resource.h at tag
xnu-10002.1.13, macOS 14, has the same text). tests/host/test_footprint.py
parses this quote and checks the ctypes Structure, the flavor and the
call's argtypes/restype against it field for field, so the quote and the
declarations cannot drift apart. Versions v3..v6 extend v2 at its end:
asking for v2 works on every macOS kvd runs on.

SDK_QUOTE:
    // xnu bsd/sys/resource.h (the SDK's usr/include/sys/resource.h), lines 192-206:
    #define RUSAGE_INFO_V0  0
    #define RUSAGE_INFO_V1  1
    #define RUSAGE_INFO_V2  2
    #define RUSAGE_INFO_V3  3
    #define RUSAGE_INFO_V4  4
    #define RUSAGE_INFO_V5  5
    #define RUSAGE_INFO_V6  6
    #define RUSAGE_INFO_CURRENT RUSAGE_INFO_V6

    /*
     * Flags for RUSAGE_INFO_V5
     */
    #define RU_PROC_RUNS_RESLIDE    0x00000001      /* proc has reslid shared cache */

    typedef void *rusage_info_t;

    // the same file, lines 242-262:
    struct rusage_info_v2 {
            uint8_t  ri_uuid[16];
            uint64_t ri_user_time;
            uint64_t ri_system_time;
            uint64_t ri_pkg_idle_wkups;
            uint64_t ri_interrupt_wkups;
            uint64_t ri_pageins;
            uint64_t ri_wired_size;
            uint64_t ri_resident_size;
            uint64_t ri_phys_footprint;
            uint64_t ri_proc_start_abstime;
            uint64_t ri_proc_exit_abstime;
            uint64_t ri_child_user_time;
            uint64_t ri_child_system_time;
            uint64_t ri_child_pkg_idle_wkups;
            uint64_t ri_child_interrupt_wkups;
            uint64_t ri_child_pageins;
            uint64_t ri_child_elapsed_abstime;
            uint64_t ri_diskio_bytesread;
            uint64_t ri_diskio_byteswritten;
    };

    // xnu libsyscall/wrappers/libproc/libproc.h (the SDK's usr/include/libproc.h), lines 106-111:
    /*
     * Return resource usage information for the given pid, which can be a live process or a zombie.
     *
     * Returns 0 on success; or -1 on failure, with errno set to indicate the specific error.
     */
    int proc_pid_rusage(int pid, int flavor, rusage_info_t *buffer) __OSX_AVAILABLE_STARTING(__MAC_10_9, __IPHONE_7_0);
END_SDK_QUOTE
"""

from __future__ import annotations

import ctypes
import os
import sys

RUSAGE_INFO_V2 = 2


class RusageInfoV2(ctypes.Structure):
    """struct rusage_info_v2, field for field (quoted above)."""

    _fields_ = [
        ("ri_uuid", ctypes.c_uint8 * 16),
        ("ri_user_time", ctypes.c_uint64),
        ("ri_system_time", ctypes.c_uint64),
        ("ri_pkg_idle_wkups", ctypes.c_uint64),
        ("ri_interrupt_wkups", ctypes.c_uint64),
        ("ri_pageins", ctypes.c_uint64),
        ("ri_wired_size", ctypes.c_uint64),
        ("ri_resident_size", ctypes.c_uint64),
        ("ri_phys_footprint", ctypes.c_uint64),
        ("ri_proc_start_abstime", ctypes.c_uint64),
        ("ri_proc_exit_abstime", ctypes.c_uint64),
        ("ri_child_user_time", ctypes.c_uint64),
        ("ri_child_system_time", ctypes.c_uint64),
        ("ri_child_pkg_idle_wkups", ctypes.c_uint64),
        ("ri_child_interrupt_wkups", ctypes.c_uint64),
        ("ri_child_pageins", ctypes.c_uint64),
        ("ri_child_elapsed_abstime", ctypes.c_uint64),
        ("ri_diskio_bytesread", ctypes.c_uint64),
        ("ri_diskio_byteswritten", ctypes.c_uint64),
    ]


# rusage_info_t *buffer: the C type is a pointer to void *, but the kernel
# writes the whole struct there, so the call passes the struct's address.
ARGTYPES = (ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
RESTYPE = ctypes.c_int


def bind(lib) -> object:
    """Declare proc_pid_rusage on `lib` as the SDK does; returns the function."""
    fn = lib.proc_pid_rusage
    fn.argtypes = ARGTYPES
    fn.restype = RESTYPE
    return fn


def _load():
    if sys.platform != "darwin":
        return None
    try:
        return bind(ctypes.CDLL("/usr/lib/libSystem.B.dylib", use_errno=True))
    except (OSError, AttributeError):
        return None


_CALL = _load()


def available() -> bool:
    return _CALL is not None


def phys_footprint(call=None, pid: int | None = None) -> int | None:
    """ri_phys_footprint of this process in bytes, or None where there is no
    proc_pid_rusage (not macOS) or the call fails. `call` stands in for the
    bound function (tests on Linux hand it one that fills the struct)."""
    fn = call if call is not None else _CALL
    if fn is None:
        return None
    buf = RusageInfoV2()  # one per call: the call drops the GIL, so a shared one could be torn
    if fn(os.getpid() if pid is None else pid, RUSAGE_INFO_V2, ctypes.addressof(buf)) != 0:
        return None
    return int(buf.ri_phys_footprint)
