"""The shared remote tier: a Redis/Valkey server behind the local tiers.

Modules: `tier` (RemoteTier: the connections, the write-behind thread, the
reads and the failure rules), `layered` (WithRemote: the local store in
front of it, a `Store` itself), `get` (pipelined GETs read straight into
buffers), `cluster` (`remote_cluster`: reads grouped by the node owning
each slot, per-node failures, the slot map's watcher), `url` (the URL forms
and their redaction). Only this package
imports redis, and only inside functions. This file imports nothing, so
the settings table can check a URL (`url`) without loading the tier.

Theory of operation
-------------------
Several daemons (one per machine) point `remote_url` at one server. Each
keeps serving from its own RAM and SSD tiers; the remote only adds what
another machine computed. `WithRemote` wraps the local store (a TieredStore
or a RamStore) and is itself a `Store`:

    PUT      local first; an entry the local tiers newly STORED is offered to
             the write-behind backlog and the PUT returns. Nothing remote is
             on its path.
    LOOKUP   `held`: the local answer; the ids the local tiers lack are asked
             of the remote in ONE pipelined round trip of EXISTS (a block of
             at most 64 chunks and their boundaries, see kvd.server.prefix).
             Tails hanging off the last matched chunk: `tails_for` asks the
             parent's tail hash (HMGET) only for the tails the query could
             match; `tails` (no query) one bounded HSCAN page. A listed tail
             is remembered only once the matcher asks for it (`contains`):
             a popular prefix's thousands of tails never crowd out the ids a
             LOOKUP promised.
    GET      local, else the remote: the wanted chunk and the remote-known
             chunks after it in the chain the GET's own walk asked about
             (`held` records each walk's chunks in order) are a *stream*,
             fetched in pipelined batches on the reader threads
             (kvd.store.remote_get: each value read from the socket straight
             into its buffer, in the daemon's heap: private, so the bytes
             checked are the bytes kept), checked (remote_value.decode),
             promoted into the local tiers and served. A value that fails its checks -- a header
             promising more than this daemon takes, a reply of a length the
             header did not promise, a key of another Redis type -- is a miss
             plus a counter (`checksum_failures`), never served, never a
             reason to mark the server down.
    EVICT    left to the server (`maxmemory-policy allkeys-lru`), plus an
             optional TTL on every key. `kvd gc` touches only local tiers.

Write-behind (`RemoteTier`): a thread owns a bounded backlog (an ordered map
by entry id; over `backlog_bytes` the oldest entry is dropped and counted),
takes batches of `batch_entries` and writes each as one pipeline of SETs
(parts and tail-hash updates included). Entries promoted from the remote are
never offered back.

Failure rules:
1. Unreachable (refused, reset, timeout, a reply too slow, a server that is
   loading): the tier is *degraded*: one warning line for the episode, reads
   skip the remote at once (a local miss is then just a miss), and the writer
   probes with PING on a backoff (0.25 s doubling to 10 s); the first good
   PING ends the episode with one info line and writes resume. An episode
   that starts again within a minute of the last one's end resumes its
   backoff instead of starting over: a server that fails every request it is
   given but answers PING is probed ever less often.
2. Full (a write answered OOM, or READONLY, MISCONF, NOPERM: the server
   refuses writes but answers reads): reads go on; the writer keeps its
   backlog and retries ONE entry on the same doubling backoff, then writes
   one entry at a time while they are taken; `batch_entries` taken in a row
   end the episode. One warning line when writes are first refused, one info
   line when they are taken again; `writes_refused` in the stats meanwhile.
3. An error reply about one key (WRONGTYPE: another program's key of another
   type under our name) is that key's refusal: a miss and `checksum_failures`
   on a read, a lost tail shortcut on a write; never rule 1.
Off the serving thread: in the daemon, a LOOKUP's, GET's or EXPLAIN's round trips
(EXISTS, the tails hash, a GET's batches, boundary state) run on the reader
threads, never on the loop thread. `WithRemote.reading("defer")` makes a
read that needs the server start it on a reader thread and raise `Pending`
(pending.py); the handler parks the request as a write-through PUT is parked
(kvd/server/parking.py: its reply waits under a token that `queued` holds),
the reader's completion posts the token to the daemon's wakeup pipe, and
the loop's next `tick` serves the request again from the start, on the loop
thread: the answers a reader thread brought serve that request (and none
that came after it was asked), promotion and the page are the loop's as
before. One that needs the server again waits again under the same token.
At most 64 requests wait so; past that a request is served from the local
tiers alone. A GET page whose next chunk is still on its way ends before it
(the client asks for the rest). A stream's batch a parked GET waits for is
never abandoned by another client's stream: it finishes aside. In-process
callers (no daemon to tell) read in "block" mode, as below. A GET the local tiers
already hit does not wait for the server to extend it (`local_first`): it
takes an answer a reader thread brought within 2 s (any request's), else
serves the local prefix while a reader thread asks, for the requests after
it: one question in flight per prefix, none while 8 tails questions (or 8
presence checks) are out, so a server that stops answering gathers no
queue of them (one per GET) for the reader threads to work through once it
resumes; a LOOKUP always waits for the server's answer.
A read on the daemon's loop thread ("block") waits at most `timeout` seconds in all
(for a batch on the reader threads as for its own round trips; every
pipeline of GETs has that deadline however slowly its bytes trickle in), once
per episode: a wait that runs out is a miss, the batch is abandoned (its
connection dropped, never read by another) and rule 1 applies.

Read-ahead: a stream's batches are queued on two reader threads up to ~2 x
`fetch_bytes` ahead of the GET that consumes them, and topped up after every
GET, so the server's reply, the checksum and the page's trip to the client
overlap instead of taking turns. Batch sizes follow the entries of THIS
stream: its first batch is one entry (nothing overlaps it, and another
model's entries say nothing about this one's), then as many as fit in
`fetch_bytes` / 4 by the largest entry the stream has shown. Two threads,
two connections: while one reads a batch, the other's GETs are already with
the server, which otherwise sits idle between one batch's last byte and the
next request (measured: ~15-20 ms per 32 MiB value on loopback). Promotion
into the local tiers stays on the loop thread, which alone touches them. A
GET of an id no queued batch holds starts a new stream (the old one's batches
are abandoned); boundary state is read alone on the loop thread and leaves
the stream be.

On a cluster (`remote_cluster`) the same rules hold per node: one value's
keys share a slot (their hash tag), the reads of a batch go out as one
pipeline per node, and a node that fails or redirects is a miss for its
keys only, never rule 1 for the tier (kvd/store/remote/cluster.py has the
rules). Writes go through redis-py's cluster pipeline, which groups them by
node and follows MOVED/ASK; one that fails is treated as rule 2 (reads go
on, the batch is retried on the backoff once the slot map is refreshed).
The tier is degraded (rule 1) only when no node answers CLUSTER INFO.

Thread rules: the loop thread reads with its own connections, the reader
threads (read-ahead) with the same pool, the writer thread with another; they
share only the backlog and the counters, under its condition (the writer's
`bytes_out` and the loop thread's `exists_queries` and `promotions` have one
writer each and are plain). On a cluster a watcher thread refreshes the slot
map (redis-py's, under its own lock) and reads cluster_state.
"""
