"""The daemon's side of the shared-memory data plane (PROTOCOL.md section 14;
the sans-I/O halves are kvd.protocol.shm): the plane's proof and leases
(plane.py, with its rules), GET replies as slot descriptors (reads.py),
SLOTS/COMMIT (writes.py), the segment arena (arena.py) and its free ranges
(freespace.py), the plane's folder (folders.py), segments with no name
handed to clients by fd (handout.py) and attaching it to a daemon
(startup.py). Segments themselves are made by kvd.host.segments."""
