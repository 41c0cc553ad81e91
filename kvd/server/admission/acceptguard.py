"""libzmq's accept() on the daemon's listener, made to drop a newcomer instead
of aborting the process when no fd is free (Linux).

Theory of operation
-------------------
libzmq 4.3.5 (and its master) calls accept4() on an ipc listener and
asserts on the result: EMFILE (this process's fd table is full) is not in
the list of errors it tolerates, so one connection too many kills the
daemon with SIGABRT (src/ipc_listener.cpp). The gate (gate.py) keeps the
table under its cap, but only as fast as a Python thread runs: preempted
while it has the listener open, or under an fd limit lowered to what the
daemon holds already (rule 6), it cannot stop libzmq's I/O thread from
calling accept4() with no fd free.

So the daemon replaces the accept4() (and accept()) libzmq calls: `install`
finds libzmq's shared object among this process's mappings, reads its ELF
relocations for the slots of its global offset table that hold those two
functions, and writes there the address of `_accept4`/`_accept`, ctypes
callbacks (the slots are libzmq's own: no other library, and not Python's
socket module, is affected; all are patched or none). The callback calls
the real accept4(); when it fails for want of an fd (EMFILE, ENFILE) it
closes a spare fd held for the purpose, accepts the waiting connection onto
that number and closes it at once, takes the spare again and tells libzmq
EAGAIN -- which libzmq takes in its stride. While the gate has libzmq's fd
pointing at its empty stand-in (gate.py, pausing), the newcomer is taken
from the real listener, whose duplicate the gate hands over
(`set_listener`); only a connection that is waiting is accepted (libzmq's
listener is a blocking socket). The newcomer sees its connection closed
before a byte was exchanged (a ZeroMQ client reconnects by itself), the
backlog drains instead of waking libzmq in a loop, and the gate, told of it
(`on_refused`), logs it and sheds its oldest idle peers if the table is
still full, so that the next attempt finds room. `refused()` counts the
newcomers dropped. libc is called through ctypes.PyDLL, which keeps the
GIL: no Python thread can take the spare's number between its close and
the accept onto it (a thread in C code could: the drop then finds no fd,
and the gate takes the spare again at its next sample, `ensure_spare`,
also when a lowered fd limit left it above the limit).

Banned processes (gate rule 9). The gate gives the guard its `refuse(fd)`
(`set_refuse`; with nobody banned it answers at once): a connection
accepted whose process is banned is kept here, unread, and libzmq is told
EAGAIN, so it never parses what the bomber sends and sees no connection at
all. The sender's writes block once its socket buffer is full, so a bomber
that reconnects at once waits instead. At most `hold_most` are held (the gate
sets it from the fd limit: 16 to 1,024); past it the oldest is closed, so a
process with more connections at once than that cycles through them, each
costing an accept and a SO_PEERCRED read here (less than libzmq's reading
and the gate's cut before). The gate closes
them when the ban ends (`release`), and the last `uninstall` closes any
left. They are not counted among the gate's peers. At a full table, a
waiting connection would make the gate shed its oldest idle peers; while a
process is banned the gate first screens what waits (`set_screen`): the
guard takes each waiting connection past the budget, holds a banned
process's, and hands the first other one to libzmq, one over the cap, for
which the gate sheds one idle peer that was there before (`take_screened`
tells it which; `settle` waits for an accept under way). So a banned
process connecting again and again at a full table costs no other peer its
connection.

The callback runs on libzmq's I/O thread and takes the GIL: once per
connection libzmq accepts, and once per wake-up while the gate has the
listener paused with a connection waiting and fds to spare (libzmq's epoll
watches the real listener, level-triggered: it retries until the gate
admits the connection or sheds for it, which it does at once at its cap;
under rule 6's tight limit, until the limit is raised). While the gate
holds the listener open for a window, it lets the GIL go (the callback
needs it) and gives the guard a budget, its room: past it the callback
answers EAGAIN without accepting (`set_budget`). Nothing libzmq does
while a Python thread holds the GIL waits for its I/O thread (pyzmq
releases the GIL in every blocking call: send, recv, poll, the context's
term), so the callback cannot deadlock it. The daemon runs the cyclic
collector on its own tick, never on its own (collector.py), so no
collection runs inside the callback. `uninstall` puts the original
addresses back when the last user is done -- the daemon calls it before
its context's term -- and the callback objects live as long as the
process (an I/O thread may be inside one while the slots are restored).

Only ELF (Linux) on x86-64 and aarch64, with libzmq loaded as a shared
object (pyzmq's wheels; a distribution's libzmq). Elsewhere -- macOS's
Mach-O above all -- `install` returns False and the gate's windows are the
only guard (README, Known limits). `install` also declines when a slot does
not hold what a slot for accept4 must (the real function, or a lazy-binding
stub inside libzmq): someone else's hook, or a file changed since it was
mapped.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import mmap
import os
import struct
import sys
import threading
import time
from typing import Callable

log = logging.getLogger("kvd.server")

_NO_FD = (errno.EMFILE, errno.ENFILE)
# e_machine -> the relocation types that fill a GOT slot with a symbol's address.
_SLOT_RELOCS = {62: (6, 7), 183: (1025, 1026)}  # x86-64: GLOB_DAT, JUMP_SLOT; aarch64: the same
_NAMES = (b"accept4", b"accept")


class _State:
    """What `_accept` needs (module-level: the GOT is the process's, not an object's)."""

    # libc's accept4, close and open through ctypes.PyDLL: called inside the
    # callback they keep the GIL, so no Python thread takes the spare's fd
    # number between its close and the accept onto it.
    accept4 = close = open = poll = None
    spare = -1  # an fd held to accept a newcomer onto when the table is full
    listener: int | None = None  # the gate's duplicate of the real listener (gate.py), if it has one
    refused = 0  # newcomers dropped for want of an fd
    budget: int | None = None  # accepts left in the gate's open window (None: no bound)
    main: int | None = None  # libzmq's fd of the main listener: the budget is its alone
    others: collections.deque = collections.deque(maxlen=65536)  # connections accepted on other listeners (lanes)
    hooks: list[Callable[[], None]] = []  # told of every accept() that found no fd free
    refuse: Callable[[int], bool] | None = None  # the gate's: is a new connection's process banned?
    held: collections.deque = collections.deque()  # connections of banned processes, held unread
    held_total = 0  # connections ever held
    hold_most = 16  # held at most (the gate sets it: set_hold_most); past it the oldest is closed
    # At a full table with a ban in force (the gate's `_screen`): accept what
    # waits to see whose it is; a banned process's is held, and one other is
    # handed to libzmq past the budget (then this goes False).
    screen = False
    screened: int | None = None  # the fd the screen let in, for the gate (`take_screened`)
    inflight = 0  # accepts on the main listener under way (`settle`)
    # Held while the budget or the screen is read and written: the callback
    # lets the GIL go in `_refused` (Python, with someone banned), so a window
    # may close between its read and its write.
    window = threading.Lock()
    users = 0  # install() less uninstall() calls
    patched: list[tuple[int, int]] = []  # (slot address, original value)
    mprotect = None
    lock = threading.Lock()


_PROTO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, use_errno=True)
_PROTO3 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, use_errno=True)
_DEVNULL = os.devnull.encode()


def _take_spare() -> None:
    """Hold an fd for the next drop (the lowest free one); -1 if none is free."""
    _State.spare = _State.open(_DEVNULL, os.O_RDONLY | os.O_CLOEXEC)


def ensure_spare(limit: int) -> None:
    """Take the spare again if a drop could not, or if it is at or above the
    soft fd limit `limit` (lowered under the daemon: freeing it would not
    free a number accept() may use). Called by the gate at each sample."""
    if not _State.patched:
        return
    with _State.lock:
        if 0 <= _State.spare < limit:
            return
        if _State.spare >= 0:
            old, _State.spare = _State.spare, -1
            _State.close(old)
        _take_spare()


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


def _waiting(fd: int) -> bool:
    """Is a connection waiting on listening socket `fd`? (poll(2), no wait, GIL kept)"""
    pfd = _PollFd(fd, 1, 0)  # POLLIN
    return _State.poll(ctypes.byref(pfd), 1, 0) == 1 and bool(pfd.revents & 1)


def set_budget(n: int | None) -> None:
    """Accept at most `n` more connections (the gate's room while it has the
    listener open for a window: gate.py rule 8); None: no bound. Past it,
    libzmq is told EAGAIN and the newcomer waits in the backlog."""
    with _State.window:
        _State.budget = n


def set_listener(fd: int | None) -> None:
    """The fd of the real listener to drop newcomers from while the gate has
    libzmq's fd pointing at its empty stand-in (None: libzmq's own fd)."""
    _State.listener = fd


def _drop_newcomer(fd: int, flags: int) -> None:
    """No fd free: accept the waiting connection onto the spare's and close it."""
    with _State.lock:
        spare, _State.spare = _State.spare, -1
        if spare >= 0:
            _State.close(spare)
        listener = _State.listener if _State.listener is not None else fd
        # libzmq's listener is a blocking socket: accept only what waits.
        conn = _State.accept4(listener, None, None, flags) if _waiting(listener) else -1
        if conn >= 0:
            _State.refused += 1  # counted before the newcomer can see its end
            _State.close(conn)
        _take_spare()
    for hook in list(_State.hooks):
        hook()


def set_main(fd: int | None) -> None:
    """libzmq's fd of the daemon's main listener (the gate's, from LISTENING).
    The window's budget bounds accepts there only; connections accepted on
    any other listener (the daemon's lanes) are kept for `accepted_elsewhere`."""
    _State.main = fd


def accepted_elsewhere() -> list[int]:
    """The fds of connections accepted on listeners other than the main one
    since the last call (at most the last 65,536)."""
    out = []
    others = _State.others
    while others:
        out.append(others.popleft())
    return out


def set_hold_most(n: int) -> None:
    """Hold at most `n` connections of banned processes (the gate's share of
    the fd limit); the oldest past it are closed now."""
    with _State.lock:
        _State.hold_most = max(1, n)
        while len(_State.held) > _State.hold_most:
            _State.close(_State.held.popleft())


def set_screen(on: bool) -> None:
    """While on, an accept past the budget on the main listener takes the
    waiting connection to see whose it is: a banned process's is held, the
    first other one goes to libzmq (and turns this off). The gate's, at a
    full table while a process is banned (gate rule 9, `_screen`)."""
    with _State.window:
        _State.screen = on
        if on:
            _State.screened = None


def screening() -> bool:
    """Is the screen still on (no connection but banned processes' taken)?"""
    return _State.screen


def settle(timeout: float) -> bool:
    """Wait, the GIL let go, until no accept on the main listener is in
    flight (one may be inside `_refused`, Python, when a window closes), at
    most `timeout` seconds; True if none is."""
    deadline = time.monotonic() + timeout
    while _State.inflight and time.monotonic() < deadline:
        time.sleep(0.0001)
    return not _State.inflight


def take_screened() -> int | None:
    """The fd of the connection the screen let in (None if none), once."""
    with _State.window:
        fd, _State.screened = _State.screened, None
        return fd


def set_refuse(refuse: Callable[[int], bool] | None) -> None:
    """The gate's `refuse(fd)`: a new connection whose process it names is
    held unread, never handed to libzmq (`_hold`). None: none asked."""
    _State.refuse = refuse


def _refused(conn: int) -> bool:
    refuse = _State.refuse
    if refuse is None:
        return False
    try:
        return bool(refuse(conn))
    except BaseException:  # never an exception into libzmq's thread: the connection goes to libzmq
        return False


def _hold(conn: int) -> None:
    """Keep a banned process's new connection, unread: its sender blocks once
    the socket's buffer is full, instead of connecting again at once."""
    with _State.lock:
        if _State.users == 0:  # uninstalled meanwhile: nothing would close it
            _State.close(conn)
            return
        _State.held.append(conn)
        _State.held_total += 1
        while len(_State.held) > _State.hold_most:
            _State.close(_State.held.popleft())


def release(keep: Callable[[int], bool]) -> None:
    """Close the held connections `keep(fd)` no longer wants (their process's
    ban is over): the sender sees its connection end and may come again.
    Called by the gate at its samples while some are held."""
    with _State.lock:
        held, _State.held = list(_State.held), collections.deque()
    kept = []
    for conn in held:
        try:
            keeping = keep(conn)
        except Exception:
            keeping = False
        if keeping:
            kept.append(conn)
        else:
            os.close(conn)
    with _State.lock:
        if _State.users > 0:
            _State.held.extendleft(reversed(kept))
            kept = []
    for conn in kept:  # the guard was uninstalled meanwhile: nothing holds them now
        os.close(conn)


def held() -> tuple[int, int]:
    """(connections held now, held since start) of banned processes."""
    return len(_State.held), _State.held_total


def _guarded(fd: int, addr, alen, flags: int) -> int:
    main = _State.main
    if main is not None and fd != main:
        return _accept_one(fd, addr, alen, flags, ours=False, screen=False)
    with _State.window:
        budget = _State.budget
        screen = _State.screen and budget is not None and budget <= 0
        if budget is not None and budget <= 0 and not screen:
            ctypes.set_errno(errno.EAGAIN)
            return -1
        _State.inflight += 1  # the gate waits for it at a window's end (`settle`)
    try:
        return _accept_one(fd, addr, alen, flags, ours=True, screen=screen)
    finally:
        with _State.window:
            _State.inflight -= 1


def _accept_one(fd: int, addr, alen, flags: int, *, ours: bool, screen: bool) -> int:
    conn = _State.accept4(fd, addr, alen, flags)
    if conn >= 0 and _refused(conn):
        _hold(conn)
        ctypes.set_errno(errno.EAGAIN)  # libzmq sees nothing waiting
        return -1
    if conn >= 0:
        if not ours:
            _State.others.append(conn)
            return conn
        with _State.window:  # read again: the window may have closed during `_refused`
            if screen:
                _State.screen = False  # one past the budget: the gate makes room for it (`_screen`)
                _State.screened = conn
            elif _State.budget is not None:
                _State.budget -= 1
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


class _Image:
    """A mapped ELF file: where it is loaded and which of its ranges run."""

    def __init__(self, path: str, inode: int):
        self.path, self.inode = path, inode
        self.base = 0  # the mapping at file offset 0
        self.lo, self.hi = 1 << 64, 0
        self.code: list[tuple[int, int]] = []  # executable ranges


def _images() -> list[_Image]:
    """Mapped files whose name says libzmq (or pyzmq's backend, if it links
    libzmq in), as long as the file on disk is still the one mapped."""
    out: dict[str, _Image] = {}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.rstrip("\n").split(maxsplit=5)  # a path may hold spaces
            if len(parts) < 6 or parts[5].endswith(" (deleted)"):
                continue
            path = parts[5]
            name = os.path.basename(path)
            if not (name.startswith("libzmq") or name.startswith("_zmq.")):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            image = out.setdefault(path, _Image(path, int(parts[4])))
            image.lo, image.hi = min(image.lo, lo), max(image.hi, hi)
            if "x" in parts[1]:
                image.code.append((lo, hi))
            if int(parts[2], 16) == 0 and not image.base:
                image.base = lo
    return [i for i in out.values() if i.base and os.stat(i.path).st_ino == i.inode]


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
            for j in range(size // 24):  # Elf64_Rela
                r_offset, r_info, _ = struct.unpack_from("<QQq", data, off + j * 24)
                if r_info & 0xFFFFFFFF not in _SLOT_RELOCS[machine] or not r_info >> 32:
                    continue
                st_name = struct.unpack_from("<I", data, sym_off + (r_info >> 32) * 24)[0]  # Elf64_Sym
                start = str_off + st_name
                name = data[start:data.find(b"\0", start)]
                if name in _NAMES:
                    out.append((r_offset - first, name))
        return out


def _libc():
    """libc's functions the guard calls, through PyDLL (the GIL kept)."""
    libc = ctypes.PyDLL(None, use_errno=True)
    fns = {}
    for name, restype, argtypes in (
        ("accept4", ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]),
        ("close", ctypes.c_int, [ctypes.c_int]),
        ("open", ctypes.c_int, [ctypes.c_char_p, ctypes.c_int]),
        ("poll", ctypes.c_int, [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int]),
        ("mprotect", ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]),
    ):
        fn = getattr(libc, name)
        fn.restype, fn.argtypes = restype, argtypes
        fns[name] = fn
    real = {b"accept4": ctypes.cast(libc.accept4, ctypes.c_void_p).value,
            b"accept": ctypes.cast(libc.accept, ctypes.c_void_p).value}
    return fns, real


def install(on_refused: Callable[[], None] | None = None) -> bool:
    """Route libzmq's accept4()/accept() through the guard; True if every slot
    was, False (and none) otherwise. `on_refused()` is called on libzmq's I/O
    thread after each accept() that found no fd free. Counted: each install
    wants an `uninstall(on_refused)`, and the slots go back with the last."""
    with _State.lock:
        if not _State.patched and not _patch():
            return False
        _State.users += 1
        if on_refused is not None:
            _State.hooks.append(on_refused)
        return True


def _patch() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        fns, real = _libc()
        todo = []
        for image in _images():
            for off, name in _slots(image.path):
                slot = image.base + off
                if not image.lo <= slot < image.hi:
                    raise ValueError(f"the slot of {name.decode()} is outside {image.path}")
                now = ctypes.c_void_p.from_address(slot).value or 0
                # Bound to libc's, or still the lazy-binding stub in libzmq's own code.
                if now != real[name] and not any(lo <= now < hi for lo, hi in image.code):
                    raise ValueError(f"the slot of {name.decode()} in {image.path} holds {now:#x}: not libc's nor a stub")
                todo.append((slot, name, now))
        if not todo:
            raise ValueError("no slot for accept4 or accept in a mapped libzmq")
    except (OSError, ValueError, AttributeError, struct.error, IndexError) as exc:
        log.info("accept guard not installed (%s): the fd gate alone keeps libzmq's accept() from a full table", exc)
        return False
    _State.accept4, _State.close, _State.open, _State.poll = fns["accept4"], fns["close"], fns["open"], fns["poll"]
    _State.mprotect = fns["mprotect"]
    if _State.spare < 0:
        _take_spare()
    new = {b"accept4": ctypes.cast(_accept4, ctypes.c_void_p).value, b"accept": ctypes.cast(_accept, ctypes.c_void_p).value}
    for slot, name, now in todo:
        if not _write_slot(slot, new[name]):
            _restore()  # all or none: a slot left to libzmq would abort as before
            log.info("accept guard not installed (a GOT page could not be made writable)")
            return False
        _State.patched.append((slot, now))
    return True


def _write_slot(slot: int, value: int) -> bool:
    """Write a pointer into a GOT slot; a read-only page (full RELRO) is made
    writable for the write and read-only again after."""
    page = mmap.PAGESIZE
    start = slot & ~(page - 1)
    writable = _writable(slot)
    if not writable and _State.mprotect(start, page, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
        return False
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


def _restore() -> None:
    while _State.patched:
        slot, original = _State.patched.pop()
        _write_slot(slot, original)


def uninstall(on_refused: Callable[[], None] | None = None) -> None:
    """Undo one `install`: its hook goes; with the last, libzmq's own slots
    come back (the callback stays alive: an I/O thread may be inside it).
    Call it before the context's term: not from an interpreter finalizing."""
    with _State.lock:
        if on_refused in _State.hooks:
            _State.hooks.remove(on_refused)
        _State.users = max(0, _State.users - 1)
        if _State.users == 0:
            _restore()
            _State.hooks.clear()
            _State.refuse = None
            while _State.held:
                os.close(_State.held.popleft())
