"""The daemon's memo of recent key chains (kvd/server/chains.py): always the
keys `keys.chain` gives, hashing only what no recent sequence shares."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.protocol import keys
from kvd.server.chains import Chains

CT = 4


def toks(values) -> bytes:
    return keys.token_bytes(np.asarray(values, dtype=np.uint32))


# A query: start from one of a few base sequences (so queries share prefixes),
# keep a prefix of it, append some tokens; in one of two namespaces, one of two
# chunk sizes; taken whole or only its first few keys (a LOOKUP that misses).
_query = st.tuples(
    st.integers(0, 3),  # base
    st.integers(0, 40),  # prefix length kept
    st.lists(st.integers(0, 3), max_size=12),  # appended (small values: accidental sharing)
    st.sampled_from(["a", "b"]),
    st.sampled_from([CT, 3]),
    st.one_of(st.none(), st.integers(0, 6)),  # keys taken (None: all)
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_query, min_size=1, max_size=25), st.sampled_from([1 << 20, 600, 200]))
def test_the_memo_gives_the_keys_of_the_chain_whatever_came_before(queries, max_bytes):
    rng = np.random.default_rng(0)
    bases = [rng.integers(0, 4, 40) for _ in range(4)]
    chains = Chains(max_bytes=max_bytes, max_seqs=4)
    for base, keep, extra, ns, ct, take in queries:
        tokens = toks(list(bases[base][:keep]) + extra)
        want = keys.chain(ns, ct, tokens)
        if take is None:
            assert chains.chain(ns, ct, tokens) == want
        else:
            known, rest = chains.walk(ns, ct, tokens)
            got = known[:take]
            for key in rest:
                if len(got) >= take:
                    break
                got.append(key)
            assert got == want[:take]
        assert chains.bytes <= max([max_bytes, *(s.cost for s in chains._seqs)])
        assert chains.bytes == sum(s.cost for s in chains._seqs)


def test_a_prompt_asked_again_is_not_hashed_again():
    chains = Chains()
    prompt = toks(np.arange(1000) % 97)  # 250 chunks
    chains.chain("ns", CT, prompt)
    assert chains.hashed == 250
    # LOOKUP, then the GET pages: nothing hashed
    for _ in range(3):
        known, rest = chains.walk("ns", CT, prompt)
        assert len(known) == 250 and list(rest) == []
    assert chains.hashed == 250
    # next turn: the prompt and 10 more tokens (two whole chunks and a tail of 2)
    turn = prompt + toks(range(10))
    assert chains.chain("ns", CT, turn) == keys.chain("ns", CT, turn)
    assert chains.hashed == 250 + 3
    # a regenerated answer parts from it inside the first new chunk
    other = prompt + toks([0, 1, 2, 9, 4, 9, 9])
    assert chains.chain("ns", CT, other) == keys.chain("ns", CT, other)
    assert chains.hashed == 250 + 3 + 2  # that chunk, then its tail
    # the same tokens in another namespace share no key
    assert chains.chain("other", CT, prompt) == keys.chain("other", CT, prompt)
    assert chains.hashed == 250 + 3 + 2 + 250


def test_a_walk_that_stops_early_records_what_it_hashed_and_no_more():
    chains = Chains()
    prompt = toks(range(400))  # 100 chunks
    known, rest = chains.walk("ns", CT, prompt)
    first = [next(rest) for _ in range(4)]  # the first block misses: the walk ends
    assert known == [] and first == keys.chain("ns", CT, prompt)[:4]
    assert chains.hashed == 4
    known, rest = chains.walk("ns", CT, prompt)
    assert known == first  # the next LOOKUP asks those at once, then hashes on
    assert known + list(rest) == keys.chain("ns", CT, prompt)
    assert chains.hashed == 100


def test_the_memo_stays_within_its_budget_and_skips_huge_sequences():
    chains = Chains(max_bytes=64 << 10, max_seqs=8)
    rng = np.random.default_rng(1)
    for _ in range(50):
        chains.chain("ns", CT, toks(rng.integers(0, 1 << 20, 2000)))  # 8 KiB each
        assert chains.bytes <= 64 << 10 and len(chains._seqs) <= 8
    huge = toks(rng.integers(0, 1 << 20, 5000))  # 20 KiB: over a quarter of the budget
    before = list(chains._seqs)
    assert chains.chain("ns", CT, huge) == keys.chain("ns", CT, huge)
    assert chains._seqs == before  # not kept: it would push out everything else


@pytest.mark.parametrize("media", [True, False])
def test_media_spans_are_hashed_as_keys_does(media):
    chains = Chains()
    tokens = toks(range(64))
    spans = (keys.MediaSpan(4, 12, bytes(32)),) if media else ()
    for _ in range(2):
        assert chains.chain("ns", CT, tokens, spans) == keys.chain("ns", CT, tokens, spans)
    assert chains.reused == (0 if media else 16)


def test_a_sequence_that_ended_in_a_tail_then_grew_keeps_no_tail_key():
    chains = Chains()
    short, longer = toks(range(6)), toks(range(10))  # a whole chunk and a tail of 2; then 2 chunks and a tail
    for tokens in (short, longer, longer, toks(range(13))):
        assert chains.chain("ns", CT, tokens) == keys.chain("ns", CT, tokens)


def test_two_walks_of_the_same_tokens_taken_in_turns_record_each_key_once():
    chains = Chains()
    tokens, want = toks(range(40)), keys.chain("ns", CT, toks(range(40)))
    _, a = chains.walk("ns", CT, tokens)
    got_a = [next(a) for _ in range(3)]
    known, b = chains.walk("ns", CT, tokens)  # starts from a's three keys
    got_b = known + [next(b) for _ in range(5)]
    got_a += list(a)  # a goes on past what b recorded
    assert got_a == want and got_b == want[:8]
    known, rest = chains.walk("ns", CT, tokens)
    assert known == want and list(rest) == []


def test_the_memo_forgets_what_it_drops():
    chains = Chains(max_bytes=1 << 20, max_seqs=3)
    for i in range(20):
        tokens = toks([i % 5] * (i % 7 + 1) + list(range(i)))
        assert chains.chain("ns", CT, tokens) == keys.chain("ns", CT, tokens)
        assert sorted(map(id, chains._seqs)) == sorted(id(s) for same in chains._heads.values() for s in same)
        assert len(chains._seqs) <= 3
