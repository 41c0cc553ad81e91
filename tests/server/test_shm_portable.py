"""The portable host (`host = portable`, KVD_HOST): the POSIX-only mechanisms
macOS runs, selected on Linux so these tests run macOS's code. Against a
real `kvd serve`: the selection takes effect (`kvd stats --json`'s `host`
section)."""

from __future__ import annotations

import numpy as np

from support import assert_prefix_hit, prefix_snapshot


def test_the_host_section_names_each_concerns_mechanism(daemon_factory):
    auto = daemon_factory("--ram-mb", "64")
    portable = daemon_factory("--ram-mb", "64", env={"KVD_HOST": "portable"})
    with auto.client() as c:
        assert c.stats()["host"] == {"host": "auto", "shared_memory": "memfd"}
    with portable.client() as c:
        assert c.stats()["host"] == {"host": "portable", "shared_memory": "shm_open"}
