"""The daemon: the ZeroMQ loop (daemon.py) and the handler it calls (handler.py,
with prefix.py and chains.py for matching and explain.py, evictions.py for the
records it keeps); who gets in and in what order (admission/); the
shared-memory data plane (shm/); the RAM budget under memory pressure
(governor.py); the loop's housekeeping (parking.py, collector.py) and what it
reports (metrics.py, latency.py, ratelog.py). What the OS says is asked
through kvd.host."""
