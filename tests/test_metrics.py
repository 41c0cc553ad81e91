"""/metrics of a running daemon after a known sequence of requests."""

from __future__ import annotations


import numpy as np

from support import free_port, prefix_snapshot, scrape


def test_metrics_count_exactly_what_happened(daemon_factory):
    port = free_port()
    d = daemon_factory("--ram-mb", "64", "--metrics-port", str(port))
    toks = np.arange(600)
    with d.client("met", strict=True, transport="frames") as c:  # message counts of the frame path
        assert c.put(toks, prefix_snapshot(toks))  # LOOKUP + HELLO + PUT (3 chunks)
        assert c.get(toks).n == 600  # GET hit
        assert c.get(toks + 1) is None  # GET miss
        assert c.probe(toks[:300]).n == 256  # LOOKUP: whole chunks only
    m = scrape(port)
    req = {labels[0][1]: v for (name, labels), v in m.items() if name == "kvd_requests_total"}
    assert req == {"PING": 1, "LOOKUP": 2, "HELLO": 1, "PUT": 1, "GET": 2}  # PING: the fixture's readiness probe
    ns = lambda key: m[(f"kvd_namespace_{key}", (("namespace", "met"),))]
    assert (ns("gets_total"), ns("hits_total"), ns("misses_total"), ns("puts_total")) == (2, 1, 1, 1)
    assert ns("chunks_stored_total") == 3 and ns("tokens_served_total") == 600 and ns("entries") == 3
    assert m[("kvd_tier_entries", (("tier", "ram"),))] == 3
    assert m[("kvd_tier_budget_bytes", (("tier", "ram"),))] == 64 << 20
    assert m[("kvd_tier_hits_total", (("tier", "ram"),))] == 3
    assert m[("kvd_request_duration_seconds_count", (("type", "GET"),))] == 2
    assert m[("kvd_request_duration_seconds_bucket", (("le", "+Inf"), ("type", "PUT")))] == 1
    # an error is counted by name
    import zmq

    s = zmq.Context.instance().socket(zmq.DEALER)
    s.connect(d.endpoint)
    s.send(b"\xc1")
    assert s.poll(3000)
    s.recv_multipart()
    s.close(0)
    assert scrape(port)[("kvd_errors_total", (("error", "MALFORMED"),))] == 1


def test_metrics_listen_on_loopback_only(daemon_factory):
    port = free_port()
    d = daemon_factory("--metrics-port", str(port))
    assert f"metrics on http://127.0.0.1:{port}/metrics" in d.log()
