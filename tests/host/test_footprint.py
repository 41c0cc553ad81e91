"""The macOS footprint reader (kvd/host/footprint.py): its ctypes Structure and
call checked against the SDK header text the module quotes (runs anywhere), and
on a Mac the real reading against an allocation."""

from __future__ import annotations

import ctypes
import re
import sys

import pytest

from kvd.host import footprint, memory

C_TYPES = {"uint8_t": ctypes.c_uint8, "uint64_t": ctypes.c_uint64, "int": ctypes.c_int}
C_SIZES = {"uint8_t": 1, "uint64_t": 8}


def quote() -> str:
    doc = footprint.__doc__
    return doc[doc.index("SDK_QUOTE:"):doc.index("END_SDK_QUOTE")]


def quoted_struct() -> list[tuple[str, str, int]]:
    body = re.search(r"struct rusage_info_v2 \{(.*?)\};", quote(), re.S).group(1)
    fields = []
    for ctype, name, count in re.findall(r"(\w+)\s+(\w+)(?:\[(\d+)\])?;", body):
        fields.append((name, ctype, int(count) if count else 0))
    return fields


def test_the_structure_is_the_quoted_struct_field_for_field():
    fields = quoted_struct()
    assert len(fields) == 19 and fields[8][0] == "ri_phys_footprint"
    declared = footprint.RusageInfoV2._fields_
    assert [n for n, _ in declared] == [n for n, _, _ in fields]
    offset = 0
    for (name, ctype, count), (_, pytype) in zip(fields, declared):
        want = C_TYPES[ctype] * count if count else C_TYPES[ctype]
        assert pytype._type_ is want._type_ if count else pytype is want, name
        if count:
            assert pytype._length_ == count, name
        size = C_SIZES[ctype] * max(count, 1)
        offset = -(-offset // C_SIZES[ctype]) * C_SIZES[ctype]  # C alignment
        assert getattr(footprint.RusageInfoV2, name).offset == offset, name
        offset += size
    assert ctypes.sizeof(footprint.RusageInfoV2) == offset == 16 + 18 * 8
    assert footprint.RusageInfoV2.ri_phys_footprint.offset == 16 + 7 * 8


def test_the_flavor_is_the_quoted_constant():
    defines = dict(re.findall(r"#define (RUSAGE_INFO_V\d)\s+(\d+)", quote()))
    assert int(defines["RUSAGE_INFO_V2"]) == footprint.RUSAGE_INFO_V2 == 2
    assert [int(defines[f"RUSAGE_INFO_V{i}"]) for i in range(7)] == list(range(7))


def test_the_call_is_declared_as_the_prototype():
    proto = re.search(r"int proc_pid_rusage\(int pid, int flavor, rusage_info_t \*buffer\)", quote())
    assert proto, "the prototype quote changed: re-check ARGTYPES"
    assert "typedef void *rusage_info_t;" in quote()
    # what phys_footprint takes for success (and anything else for failure)
    assert "Returns 0 on success; or -1 on failure" in quote()
    # int, int, a pointer (the struct's address), returning int
    assert footprint.ARGTYPES == (ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
    assert footprint.RESTYPE is ctypes.c_int

    class Lib:  # a stand-in library: `bind` must set what the SDK declares
        proc_pid_rusage = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 0)

    fn = footprint.bind(Lib())
    assert tuple(fn.argtypes) == footprint.ARGTYPES and fn.restype is ctypes.c_int


def test_the_reading_is_the_footprint_field_of_what_the_kernel_wrote():
    seen = []

    def fake_kernel(pid, flavor, address):  # writes the struct as the kernel would
        seen.append((pid, flavor))
        info = footprint.RusageInfoV2.from_address(address)
        info.ri_resident_size, info.ri_phys_footprint = 1, 123 << 20
        return 0

    call = ctypes.CFUNCTYPE(*(footprint.RESTYPE,) + footprint.ARGTYPES)(fake_kernel)
    assert footprint.phys_footprint(call) == 123 << 20
    assert seen == [(__import__("os").getpid(), 2)]
    failing = ctypes.CFUNCTYPE(*(footprint.RESTYPE,) + footprint.ARGTYPES)(lambda *a: -1)
    assert footprint.phys_footprint(failing) is None


@pytest.mark.skipif(sys.platform == "darwin", reason="Linux: /proc/self/statm")
def test_off_a_mac_there_is_no_call():
    assert not footprint.available() and footprint.phys_footprint() is None


@pytest.mark.skipif(sys.platform != "darwin", reason="proc_pid_rusage exists only on macOS")
def test_on_a_mac_the_footprint_follows_an_allocation():
    assert footprint.available()
    before = memory.rss_bytes()
    assert before is not None and before > 1 << 20
    block = bytearray(256 << 20)
    block[:: 4096] = b"\1" * len(block[:: 4096])  # dirty every page
    after = memory.rss_bytes()
    assert after - before >= 200 << 20, (before, after)
    del block
