"""The adapter's salted keys for media requests (kvd_client.vllm_mlx._media), no vllm-mlx needed."""

from __future__ import annotations

from kvd.protocol.keys import MediaSpan
from kvd_client.vllm_mlx import _media

D1, D2 = bytes(range(32)), bytes(range(1, 33))
TOKENS = [5, 6, 9, 9, 9, 7, 9, 9, 8]  # 9: the image placeholder; two runs


def test_salt_and_unsalt_round_trip_with_spans():
    key = _media.salt(TOKENS, [(2, 5), (6, 8)], D1)
    assert all(v < 0 for v in key[2:5] + key[6:8]) and key[:2] == (5, 6) and key[8] == 8
    tokens, spans = _media.unsalt(key)
    assert tokens == TOKENS
    assert spans == [MediaSpan(2, 5, D1), MediaSpan(6, 8, D1)]


def test_another_digest_gives_another_key_and_text_keys_are_unchanged():
    assert _media.salt(TOKENS, [(2, 5)], D1) != _media.salt(TOKENS, [(2, 5)], D2)
    assert _media.salt(TOKENS, [], D1) == tuple(TOKENS)
    assert _media.unsalt(tuple(TOKENS)) == (TOKENS, [])


def test_a_key_cut_inside_a_run_keeps_the_part_it_holds():
    key = _media.salt(TOKENS, [(2, 5)], D1)[:4]
    assert _media.unsalt(key) == ([5, 6, 9, 9], [MediaSpan(2, 4, D1)])


def test_adjacent_runs_of_different_media_stay_apart():
    a = _media.salt([9, 9], [(0, 2)], D1)
    b = _media.salt([9, 9], [(0, 2)], D2)
    tokens, spans = _media.unsalt(a + b)
    assert tokens == [9, 9, 9, 9] and spans == [MediaSpan(0, 2, D1), MediaSpan(2, 4, D2)]
