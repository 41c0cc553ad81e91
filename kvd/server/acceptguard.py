"""libzmq's accept() on the daemon's listener, made to drop a newcomer instead
of aborting the process when no fd is free (Linux).

Theory of operation
-------------------
libzmq 4.3.5 (and its master) calls accept4() on an ipc listener and
asserts on the result: EMFILE (this process's fd table is full) is not in
the list of errors it tolerates, so one connection too many kills the
daemon with SIGABRT (src/ipc_listener.cpp). The gate (peers.py) keeps the
table under its cap, but only as fast as a Python thread runs: preempted
while it has the listener open, or under an fd limit lowered to what the
daemon holds already (rule 6), it cannot stop libzmq's I/O thread from
calling accept4() with no fd free.

So the daemon replaces the accept4() (and accept()) libzmq calls: `install`
finds libzmq's shared object among this process's mappings, reads its ELF
relocations for the slots of its global offset table that hold those two
functions, and writes there the address of `_accept`, a ctypes callback
(the slots are libzmq's own: no other library, and not the Python socket
module, is affected). `_accept` calls the real accept4(); when it fails for
want of an fd (EMFILE, ENFILE) it frees a spare fd held for the purpose,
accepts the waiting connection onto it, closes it at once, takes the spare
again and tells libzmq EAGAIN -- which libzmq takes in its stride. The
newcomer sees its connection closed before a byte was exchanged (a ZeroMQ
client reconnects by itself), the kernel's backlog drains instead of
waking libzmq in a loop, and the gate, told of it, sheds its oldest idle
peers so that the next attempt finds room (`refused`, `on_refused`).

The callback runs on libzmq's I/O thread and takes the GIL: once per
connection libzmq accepts, and once per wake-up while the gate has the
listener paused with a connection waiting. Nothing libzmq does while a
Python thread holds the GIL waits for its I/O thread (pyzmq releases the
GIL in every blocking call: send, recv, poll, the context's term), so the
callback cannot deadlock it. `uninstall` puts the original addresses back;
the callback object lives as long as the process (an I/O thread may be
inside it while the slots are restored).

Only ELF (Linux) on x86-64 and aarch64, with libzmq loaded as a shared
object (pyzmq's wheels; a distribution's libzmq). Elsewhere -- macOS's
Mach-O above all -- `install` returns None and the gate's windows are the
only guard (README, Known limits). `install` also declines when a slot does
not hold what a slot for accept4 must (the real function, or a lazy-binding
stub inside libzmq): someone else's hook, or a file changed since it was
mapped.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import logging
import mmap
import os
import struct
import sys
import threading
from typing import Callable

log = logging.getLogger("kvd.server")

_NO_FD = (errno.EMFILE, errno.ENFILE)
# e_machine -> the relocation types that fill a GOT slot with a symbol's address.
_SLOT_RELOCS = {62: (6, 7), 183: (1025, 1026)}  # x86-64: GLOB_DAT, JUMP_SLOT; aarch64: the same
_NAMES = (b"accept4", b"accept")


class _State:
    """What `_accept` needs (module-level: the GOT is the process's, not an object's)."""

    real4 = None  # libc's accept4, via ctypes (use_errno)
    spare = -1  # an fd held to accept a newcomer onto when the table is full
    refused = 0  # accept() calls that found no fd free (a newcomer waiting then was dropped)
    on_refused: Callable[[], None] | None = None
    patched: list[tuple[int, int]] = []  # (slot address, original value)
    mprotect = None
    lock = threading.Lock()


_PROTO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, use_errno=True)
_PROTO3 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, use_errno=True)


def _take_spare() -> None:
    try:
        _State.spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        _State.spare = -1  # the table filled again meanwhile: taken at the next refusal


def _drop_newcomer(fd: int, flags: int) -> None:
    """No fd free: accept the waiting connection onto the spare's and close it."""
    with _State.lock:
        _State.refused += 1  # counted before the newcomer can see its end
        if _State.spare >= 0:
            os.close(_State.spare)
            _State.spare = -1
        conn = _State.real4(fd, None, None, flags)  # nothing if the listener is the gate's empty stand-in
        if conn >= 0:
            os.close(conn)
        _take_spare()
    hook = _State.on_refused
    if hook is not None:
        hook()


def _guarded(fd: int, addr, alen, flags: int) -> int:
    conn = _State.real4(fd, addr, alen, flags)
    if conn >= 0:
        return conn
    err = ctypes.get_errno()
    if err in _NO_FD:
        try:
            _drop_newcomer(fd, flags)
        except BaseException:  # never an exception into libzmq's thread (ctypes would return 0: fd 0)
            pass
        err = errno.EAGAIN
    ctypes.set_errno(err)  # ctypes hands it to libzmq as errno when the callback returns
    return -1


@_PROTO
def _accept4(fd, addr, alen, flags):
    try:
        return _guarded(fd, addr, alen, flags)
    except BaseException:
        ctypes.set_errno(errno.EAGAIN)
        return -1


@_PROTO3
def _accept(fd, addr, alen):
    try:
        return _guarded(fd, addr, alen, 0)
    except BaseException:
        ctypes.set_errno(errno.EAGAIN)
        return -1


def refused() -> int:
    """libzmq's accept() calls that found no fd free so far, each answered
    EAGAIN with the waiting newcomer (if any) dropped (0 when not installed)."""
    return _State.refused


def installed() -> bool:
    return bool(_State.patched)


def _mappings() -> dict[str, tuple[int, int, int]]:
    """Mapped files whose name says libzmq (or pyzmq's backend, if it links
    libzmq in): path -> (start of the mapping at file offset 0, lowest mapped
    address, highest)."""
    out: dict[str, list[int]] = {}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 6:
                continue
            path = parts[5]
            name = os.path.basename(path)
            if not (name.startswith("libzmq") or name.startswith("_zmq.")):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            m = out.setdefault(path, [0, lo, hi])
            m[1], m[2] = min(m[1], lo), max(m[2], hi)
            if int(parts[2], 16) == 0 and not m[0]:
                m[0] = lo
    return {p: (m[0], m[1], m[2]) for p, m in out.items() if m[0]}


def _slots(path: str) -> list[tuple[int, bytes]]:
    """(offset from the load address, symbol) of every GOT slot for accept4
    or accept in the ELF file `path`. Raises ValueError for what is not a
    little-endian ELF64 of a known machine."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise ValueError("not a little-endian ELF64")
        machine = struct.unpack_from("<H", data, 0x12)[0]
        if machine not in _SLOT_RELOCS:
            raise ValueError(f"machine {machine}")
        phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
        loads = [struct.unpack_from("<IIQQ", data, phoff + i * phentsize) for i in range(phnum)]
        first = min((p[3] - p[2] for p in loads if p[0] == 1), default=0)  # vaddr - offset of PT_LOADs
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
        out = []
        for _, kind, _, _, off, size, link, _, _, _ in sections:
            if kind != 4:  # SHT_RELA
                continue
            sym_off, str_idx = sections[link][4], sections[link][6]
            str_off = sections[str_idx][4]
            for j in range(size // 24):
                r_offset, r_info, _ = struct.unpack_from("<QQq", data, off + j * 24)
                if r_info & 0xFFFFFFFF not in _SLOT_RELOCS[machine] or not r_info >> 32:
                    continue
                st_name = struct.unpack_from("<I", data, sym_off + (r_info >> 32) * 24)[0]
                start = str_off + st_name
                name = data[start:data.find(b"\0", start)]
                if name in _NAMES:
                    out.append((r_offset - first, name))
        return out


def install(on_refused: Callable[[], None] | None = None) -> bool:
    """Route libzmq's accept4()/accept() through `_accept`; True if done.
    `on_refused()` is called (on libzmq's I/O thread) after each newcomer
    dropped for want of an fd. Idempotent."""
    if _State.patched:
        _State.on_refused = on_refused
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        real4 = libc.accept4
        real4.restype, real4.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        mprotect = libc.mprotect
        mprotect.restype, mprotect.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        real_addr = {b"accept4": ctypes.cast(libc.accept4, ctypes.c_void_p).value,
                     b"accept": ctypes.cast(libc.accept, ctypes.c_void_p).value}
        todo = []
        for path, (base, lo, hi) in _mappings().items():
            for off, name in _slots(path):
                slot = base + off
                if not lo <= slot < hi:
                    raise ValueError(f"slot of {name.decode()} outside {path}")
                now = ctypes.c_void_p.from_address(slot).value or 0
                if now != real_addr[name] and not lo <= now < hi:  # bound, or still libzmq's lazy stub
                    raise ValueError(f"the slot of {name.decode()} in {path} holds {now:#x}: not libc's nor a stub")
                todo.append((slot, name, now))
        if not todo:
            return False
    except (OSError, ValueError, AttributeError, struct.error, IndexError) as exc:
        log.info("accept guard not installed (%s): the fd gate alone keeps libzmq's accept() from a full table", exc)
        return False
    _State.real4, _State.on_refused = real4, on_refused
    if _State.spare < 0:
        _take_spare()
    _State.mprotect = mprotect
    new = {b"accept4": ctypes.cast(_accept4, ctypes.c_void_p).value, b"accept": ctypes.cast(_accept, ctypes.c_void_p).value}
    for slot, name, now in todo:
        if _write_slot(slot, new[name]):
            _State.patched.append((slot, now))
    if _State.patched:
        atexit.register(uninstall)  # no callback into an interpreter that is finalizing
    return bool(_State.patched)


def _write_slot(slot: int, value: int) -> bool:
    """Write a pointer into a GOT slot; a read-only page (full RELRO) is made
    writable for the write and read-only again after."""
    page = mmap.PAGESIZE
    start = slot & ~(page - 1)
    writable = _writable(slot)
    if not writable and _State.mprotect(start, page, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
        return False  # left as it was: the gate's windows still guard it
    ctypes.c_void_p.from_address(slot).value = value
    if not writable:
        _State.mprotect(start, page, mmap.PROT_READ)
    return True


def _writable(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return perms[1] == "w"
    return False


def uninstall() -> None:
    """Put libzmq's original slots back (the callback stays alive: an I/O
    thread may be inside it)."""
    while _State.patched:
        slot, original = _State.patched.pop()
        _write_slot(slot, original)
    _State.on_refused = None
