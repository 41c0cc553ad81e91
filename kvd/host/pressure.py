"""Memory pressure as the OS reports it: the level a sample of this machine reads.

A *source* is a callable returning a `Sample`: a level -- "normal", "warn"
or "critical" -- with the reason in words and, when known, the bytes still
available and the total they are out of. `system_source()` is this
machine's; the governor (kvd/server/governor.py) decides what the RAM tier
does with it, and adds the sources that are not the OS's (off, a level file).

What each OS gives:

    Linux   /proc/meminfo MemAvailable against MemTotal; PSI
            (/proc/pressure/memory, "some" avg10: the share of the last 10 s
            in which some task waited for memory); and the cgroup the daemon
            runs in, v2 (memory.max / memory.current) or v1
            (memory.limit_in_bytes / memory.usage_in_bytes), each level up
            to the root, counting the working set: anonymous memory plus
            shared memory (v2 memory.stat anon + shmem, v1 total_rss +
            total_shmem), never the file cache, active or not, which the
            kernel reclaims before it kills anyone -- the SSD tier's own
            writes and reads fill it, and its active part had counted as
            pressure and cut the RAM budget to the floor. Where memory.stat
            lacks those keys: usage less inactive file cache.
    macOS   sysctl kern.memorystatus_vm_pressure_level via ctypes (the
            kernel's own level: 1 normal, 2 warn, 4 critical) and hw.memsize;
            `kvd doctor` adds vm_stat's free + inactive + speculative pages.
            The calls are thin wrappers; their parsing (`darwin_level`,
            `parse_vm_stat`) is tested against recorded outputs
            (tests/host/test_recorded_macos.py).
    other   no source: always "normal".

Levels have hysteresis: each measure enters a level at one threshold and
leaves it only below a lower one (`THRESHOLDS`), so a value hovering at a
threshold does not flap. The worst measure decides.

`memory_total()`: the bytes this process may use (physical memory, or the
tightest cgroup limit if lower; macOS hw.memsize).

Cost: a sample reads three or four small /proc and /sys files (~50 us); the
daemon takes one every `pressure_poll_s` seconds from its housekeeping
tick, between requests, never on a request's path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvd.host import select

LEVELS = ("normal", "warn", "critical")
MiB = 1 << 20
GiB = 1 << 30


# measure -> (warn enter, warn leave, critical enter, critical leave); higher is worse.
THRESHOLDS = {
    "used": (0.90, 0.85, 0.95, 0.92),  # 1 - MemAvailable/MemTotal, or cgroup working set / limit
    "psi": (10.0, 5.0, 40.0, 20.0),  # PSI memory "some" avg10, percent
}


@dataclass(frozen=True, slots=True)
class Sample:
    level: str  # one of LEVELS
    reason: str  # what decided it, in words
    available: int | None = None  # bytes the daemon could still get
    total: int | None = None  # bytes it is out of (physical memory or a cgroup limit)


Source = Callable[[str], Sample]  # called with the previous level (for hysteresis)


def classify(measure: str, value: float, previous: str) -> str:
    """The level of one measure, with hysteresis against `previous`."""
    warn_in, warn_out, crit_in, crit_out = THRESHOLDS[measure]
    if value >= crit_in or (previous == "critical" and value >= crit_out):
        return "critical"
    if value >= warn_in or (previous != "normal" and value >= warn_out):
        return "warn"
    return "normal"


def _worst(levels: list[str]) -> str:
    return max(levels, key=LEVELS.index) if levels else "normal"


# -- Linux ------------------------------------------------------------------------


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[name] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def _psi_some_avg10(path: str = "/proc/pressure/memory") -> float | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("some"):
                    for field in line.split()[1:]:
                        k, _, v = field.partition("=")
                        if k == "avg10":
                            return float(v)
    except (OSError, ValueError):
        return None
    return None


@dataclass(frozen=True, slots=True)
class _Cgroup:
    path: Path
    v2: bool

    def limit(self) -> int | None:
        raw = _read_int(self.path / ("memory.max" if self.v2 else "memory.limit_in_bytes"))
        # cgroup v1 says "no limit" with a huge page-aligned number.
        return None if raw is None or raw >= 1 << 60 else raw

    # memory.stat's keys for what the kernel cannot drop to make room:
    # anonymous memory and shared memory (tmpfs, /dev/shm: the shm plane).
    # v1's rss is anonymous only (shmem is in its cache); total_* count the subtree.
    _HELD = {True: ("anon", "shmem"), False: ("total_rss", "total_shmem")}

    def working_set(self) -> int | None:
        """Bytes the cgroup holds that reclaim cannot free: anonymous plus
        shared memory (module docstring). The file cache, active or
        inactive, is not counted: the kernel drops it before it OOM-kills,
        and the SSD tier's own files would otherwise count as pressure.
        Without those keys in memory.stat: usage less inactive file cache."""
        stat = self._stat()
        held = self._HELD[self.v2]
        if all(k in stat for k in held):
            return sum(stat[k] for k in held)
        used = _read_int(self.path / ("memory.current" if self.v2 else "memory.usage_in_bytes"))
        if used is None:
            return None
        return max(0, used - stat.get("inactive_file" if self.v2 else "total_inactive_file", 0))

    def _stat(self) -> dict[str, int]:
        """memory.stat as numbers; empty if it cannot be read."""
        out: dict[str, int] = {}
        try:
            for line in (self.path / "memory.stat").read_text().splitlines():
                k, _, v = line.partition(" ")
                try:
                    out[k] = int(v)
                except ValueError:
                    continue
        except OSError:
            pass
        return out


def _mounts() -> tuple[Path | None, Path | None]:
    """(cgroup v2 mount, cgroup v1 memory-controller mount)."""
    v2 = v1 = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fstype, _, opts = (right.split() + ["", "", ""])[:3]
                mount = Path(left.split()[4])
                if fstype == "cgroup2" and v2 is None:
                    v2 = mount
                elif fstype == "cgroup" and "memory" in opts.split(",") and v1 is None:
                    v1 = mount
    except OSError:
        pass
    return v2, v1


def own_cgroups(proc_cgroup: str = "/proc/self/cgroup", mounts: tuple[Path | None, Path | None] | None = None) -> list[_Cgroup]:
    """The memory cgroups this process is in, innermost first, up to the root
    of each hierarchy (a parent's limit binds too). v2 only if it has the
    memory controller there."""
    v2_mount, v1_mount = _mounts() if mounts is None else mounts
    found: list[_Cgroup] = []
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hid == "0" and controllers == "" and v2_mount is not None:
            base, v2 = v2_mount, True
        elif "memory" in controllers.split(",") and v1_mount is not None:
            base, v2 = v1_mount, False
        else:
            continue
        path = base / rel.lstrip("/")
        while True:
            cg = _Cgroup(path, v2)
            if (path / ("memory.max" if v2 else "memory.limit_in_bytes")).exists():
                found.append(cg)
            if path == base or base not in path.parents:
                break
            path = path.parent
    return found


class LinuxSource:
    """MemAvailable, PSI and the daemon's cgroups (see the module docstring)."""

    def __init__(self, cgroups: list[_Cgroup] | None = None, psi: bool = True):
        # A process can be moved to another cgroup while it runs (a service
        # manager, a test): unless given, they are looked up at each sample
        # (one small file; the mount points are read once).
        self._fixed = cgroups
        self._psi = psi  # False on the portable host (kvd.host.select): no PSI
        self._mounts = _mounts() if cgroups is None else (None, None)

    @property
    def cgroups(self) -> list[_Cgroup]:
        return self._fixed if self._fixed is not None else own_cgroups(mounts=self._mounts)

    def __call__(self, previous: str = "normal") -> Sample:
        levels, reasons = [], []
        info = _meminfo()
        total, avail = info.get("MemTotal"), info.get("MemAvailable")
        if total and avail is not None:
            used = 1 - avail / total
            levels.append(classify("used", used, previous))
            reasons.append(f"MemAvailable {avail / GiB:.1f} of {total / GiB:.1f} GiB")
        psi = _psi_some_avg10() if self._psi else None
        if psi is not None:
            levels.append(classify("psi", psi, previous))
            reasons.append(f"psi some avg10={psi:.1f}")
        for cg in self.cgroups:
            limit = cg.limit()
            ws = cg.working_set() if limit else None
            if limit and ws is not None:
                levels.append(classify("used", ws / limit, previous))
                reasons.append(f"cgroup {cg.path.name or '/'} {ws / MiB:.0f} of {limit / MiB:.0f} MiB")
                if total is None or limit - ws < (avail or 0):
                    total, avail = limit, max(0, limit - ws)
        return Sample(_worst(levels), ", ".join(reasons) or "no measure available", avail, total)


# -- macOS ------------------------------------------------------------------------


# The kernel's side, quoted verbatim (tabs expanded) from Apple's xnu:
# apple-oss-distributions/xnu, tag xnu-11417.101.15, commit
# e3723e1f17661b24996789d8afc084c0c3303b26. tests/host/test_recorded_macos.py
# parses it and checks DARWIN_LEVELS, SYSCTL_CTYPES and the sysctlbyname
# declaration against it. (event_private.h is not in the SDK: the values reach
# user space as the sysctl's value and as libdispatch's memory-pressure flags.)
#   bsd/sys/event_private.h, lines 298-303:
#     /*
#      * data/hint fflags for EVFILT_MEMORYSTATUS, shared with userspace.
#      */
#     #define NOTE_MEMORYSTATUS_PRESSURE_NORMAL       0x00000001      /* system memory pressure has returned to normal */
#     #define NOTE_MEMORYSTATUS_PRESSURE_WARN         0x00000002      /* system memory pressure has changed to the warning state */
#     #define NOTE_MEMORYSTATUS_PRESSURE_CRITICAL     0x00000004      /* system memory pressure has changed to the critical state */
#   bsd/kern/kern_memorystatus_notify.c, lines 1805-1807 and 1817-1818 (the handler
#   and the release kernels' declaration):
#             uint32_t dispatch_level = convert_internal_pressure_level_to_dispatch_level(memorystatus_vm_pressure_level);
#
#             return SYSCTL_OUT(req, &dispatch_level, sizeof(dispatch_level));
#     SYSCTL_PROC(_kern, OID_AUTO, memorystatus_vm_pressure_level, CTLTYPE_INT | CTLFLAG_RD | CTLFLAG_LOCKED | CTLFLAG_MASKED,
#         0, 0, &sysctl_memorystatus_vm_pressure_level, "I", "");
#   bsd/kern/kern_mib.c, line 925 (macOS):
#     SYSCTL_QUAD(_hw, HW_MEMSIZE, memsize, CTLFLAG_RD | CTLFLAG_KERN | CTLFLAG_LOCKED, &max_mem_actual, "");
#   bsd/sys/sysctl.h, lines 1449-1450:
#     int     sysctlbyname(const char *, void *__sized_by(*oldlenp), size_t *oldlenp,
#         void *__sized_by(newlen), size_t newlen);
# END_XNU_QUOTE

# What each sysctl kvd reads holds: the handler's uint32_t, SYSCTL_QUAD's 64 bits.
SYSCTL_CTYPES = {"kern.memorystatus_vm_pressure_level": ctypes.c_uint32, "hw.memsize": ctypes.c_uint64}
SYSCTLBYNAME_ARGTYPES = (ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p,
                         ctypes.c_size_t)
SYSCTLBYNAME_RESTYPE = ctypes.c_int


def bind_sysctlbyname(lib) -> object:
    """Declare sysctlbyname on `lib` as <sys/sysctl.h> does (quoted above); returns it."""
    fn = lib.sysctlbyname
    fn.argtypes = SYSCTLBYNAME_ARGTYPES
    fn.restype = SYSCTLBYNAME_RESTYPE
    return fn


_SYSCTLBYNAME = None  # bound on first use (macOS only)


def sysctl_int(name: str, call=None) -> int | None:
    """The value of the sysctl `name` (one of SYSCTL_CTYPES), None if the call
    fails. `call` stands in for the bound sysctlbyname (tests off a Mac)."""
    global _SYSCTLBYNAME
    if call is None:
        if _SYSCTLBYNAME is None:
            _SYSCTLBYNAME = bind_sysctlbyname(ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True))
        call = _SYSCTLBYNAME
    value = SYSCTL_CTYPES[name](0)
    size = ctypes.c_size_t(ctypes.sizeof(value))
    if call(name.encode(), ctypes.addressof(value), ctypes.byref(size), None, 0) != 0:
        return None
    return int(value.value)


# NOTE_MEMORYSTATUS_PRESSURE_NORMAL, _WARN, _CRITICAL (quoted above): the values
# kern.memorystatus_vm_pressure_level holds.
DARWIN_LEVELS = {1: "normal", 2: "warn", 4: "critical"}


def darwin_level(raw: int | None) -> str:
    """The level for a kern.memorystatus_vm_pressure_level value (pure: tested
    against recorded `sysctl` outputs); unreadable or unknown reads as normal."""
    return DARWIN_LEVELS.get(raw if raw is not None else 1, "normal")


def parse_vm_stat(text: str) -> tuple[int, dict[str, int]]:
    """(page size, {field: pages}) from `vm_stat`'s output (pure: tested against
    recorded outputs). Its first line is "Mach Virtual Memory Statistics: (page
    size of 16384 bytes)"; then lines "Pages free:   12345." (a trailing dot).
    Raises ValueError when the header is not there."""
    head, _, rest = text.partition("\n")
    m = re.search(r"page size of (\d+) bytes", head)
    if m is None:
        raise ValueError(f"not vm_stat output: {head[:80]!r}")
    pages = {}
    for line in rest.splitlines():
        name, sep, value = line.rpartition(":")
        value = value.strip().rstrip(".")
        if sep and value.isdigit():
            pages[name.strip().strip('"')] = int(value)
    return int(m.group(1)), pages


def vm_stat_available(page: int, pages: dict[str, int]) -> int:
    """Bytes the system could hand out without compressing or swapping: free,
    inactive and speculative pages (what Activity Monitor's "available" adds
    up to, less purgeable memory it also counts)."""
    return page * sum(pages.get(k, 0) for k in ("Pages free", "Pages inactive", "Pages speculative"))


def darwin_vm_available() -> int | None:
    """Thin wrapper: run `vm_stat` once (for `kvd doctor`, not the daemon's
    sampling: a process per reading is too dear there); None off macOS."""
    import subprocess

    if sys.platform != "darwin":
        return None
    try:
        out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5, check=True).stdout
        return vm_stat_available(*parse_vm_stat(out))
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def darwin_sample(previous: str = "normal") -> Sample:
    """The kernel's memory-pressure level (the one the dispatch source reports)."""
    raw = sysctl_int("kern.memorystatus_vm_pressure_level")
    total = sysctl_int("hw.memsize")
    return Sample(darwin_level(raw), f"kern.memorystatus_vm_pressure_level={raw}", None, total)


# -- the one OS switch ------------------------------------------------------------


def system_source() -> Source:
    """This machine's pressure source (module docstring)."""
    if sys.platform.startswith("linux"):
        return LinuxSource(psi=select.mechanism("memory_pressure") == "meminfo+psi+cgroup")
    if sys.platform == "darwin":
        return darwin_sample
    return lambda previous="normal": Sample("normal", f"no pressure source on {sys.platform}")


def memory_total() -> int | None:
    """Bytes of memory this process may use: physical memory, or the tightest
    cgroup limit if lower. None if unknown."""
    if sys.platform == "darwin":
        total = sysctl_int("hw.memsize")
    else:
        total = _meminfo().get("MemTotal")
        for cg in own_cgroups() if sys.platform.startswith("linux") else []:
            limit = cg.limit()
            if limit and (total is None or limit < total):
                total = limit
    return total
