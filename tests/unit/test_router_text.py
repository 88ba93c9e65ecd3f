"""services/router: stop strings, incremental text with the real tokenizer, token bytes."""

from __future__ import annotations

import random

import pytest

from libs.protocol.messages import TokenLogprobs
from services.router.detok import LOGPROB_FLOOR, TextAssembler, TokenRenderer
from services.router.stop import StopScanner
from tests.router_harness import tokenizer


def feed_all(scanner: StopScanner, pieces: list[str]) -> str:
    out = "".join(scanner.feed(p) for p in pieces)
    return out + ("" if scanner.stopped else scanner.flush())


@pytest.mark.parametrize(
    ("pieces", "stops", "expected", "stopped"),
    [
        (["Hello", " wor", "ld"], [], "Hello world", False),
        (["Hello", " wor", "ld", "!"], ["world"], "Hello ", True),
        (["ab", "cE", "N", "Dxyz"], ["END"], "abc", True),  # split over three pieces
        (["E", "N", "D"], ["END"], "", True),
        (["EN", "X", "END"], ["END"], "ENX", True),  # a false start is released
        (["one. two", ". three"], [". t", "wo."], "one", True),  # the earliest match wins
        (["xx", "yy"], ["yyy", "zz"], "xxyy", False),  # held-back prefix released at the end
        (["aaa"], ["aab"], "aaa", False),
    ],
)
def test_stop_scanner(pieces: list[str], stops: list[str], expected: str, stopped: bool) -> None:
    scanner = StopScanner(stops)
    assert feed_all(scanner, pieces) == expected
    assert scanner.stopped == stopped


def test_stop_scanner_holds_back_only_possible_prefixes() -> None:
    scanner = StopScanner(["STOP"])
    assert scanner.feed("abc S") == "abc "  # "S" could start STOP
    assert scanner.feed("T") == ""
    assert scanner.feed("x") == "STx"  # it did not
    assert scanner.feed("ST") == ""
    assert scanner.feed("OP and more") == ""
    assert scanner.stopped and scanner.text == "abc STx"
    assert scanner.feed("ignored") == "" and scanner.flush() == ""


def naive_stop(pieces: list[str], stops: list[str]) -> str:
    """The reference: after each piece, search the whole text; cut at the earliest match."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [p for p in (text.find(s) for s in stops) if p >= 0]
        if hits:
            return text[: min(hits)]
    return text


def test_stop_scanner_agrees_with_a_naive_search_for_any_split() -> None:
    rng = random.Random(7)
    for _ in range(1000):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        scanner = StopScanner(stops)
        released = [scanner.feed(p) for p in pieces]
        out = "".join(released) + ("" if scanner.stopped else scanner.flush())
        assert out == naive_stop(pieces, stops), (text, stops, pieces)
        # nothing released is ever taken back: each release extends the output
        assert out.startswith("".join(released))


def test_stop_scanner_refuses_empty_stop() -> None:
    with pytest.raises(ValueError):
        StopScanner([""])


def test_assembler_text_matches_decode_and_never_splits_a_character() -> None:
    tok = tokenizer()
    text = " naïve café 😀 done"
    ids = tok.encode(text)
    asm = TextAssembler(TokenRenderer(tok), tok.encode("Prompt:"), [], logprobs=False)
    deltas = [asm.add([t], None).text for t in ids]
    assert "".join(deltas) + asm.finish() == text
    assert all("\ufffd" not in d for d in deltas)


def test_assembler_stop_string_split_across_tokens() -> None:
    tok = tokenizer()
    ids = tok.encode(" The quick brown fox jumps over")
    assert tok.decode(ids[3:4]) == " fox" and tok.decode(ids[4:5]) == " jumps"
    asm = TextAssembler(TokenRenderer(tok), [], ["x ju"], logprobs=True)
    pieces = [asm.add([t], None) for t in ids[:4]]
    assert not asm.stopped and pieces[-1].text == " fo"  # the "x" of " fox" may start "x ju": held back
    last = asm.add(ids[4:], None)  # " jumps" completes the match; " over" must be ignored
    assert "".join(p.text for p in pieces) + last.text == " The quick brown fo"
    assert asm.stopped and asm.finish() == ""
    assert last.num_tokens == 1 and len(last.logprobs) == 1


def test_assembler_logprobs_are_rendered_per_token() -> None:
    tok = tokenizer()
    renderer = TokenRenderer(tok)
    ids = tok.encode(" café")
    lps = [TokenLogprobs(token_id=t, logprob=-1.5, top_ids=[t, 28], top_logprobs=[-1.5, float("-inf")]) for t in ids]
    asm = TextAssembler(renderer, [], [], logprobs=True)
    piece = asm.add(ids, lps)
    assert [e.token.logprob for e in piece.logprobs] == [-1.5] * len(ids)
    assert piece.logprobs[0].top[1].logprob == LOGPROB_FLOOR  # -inf is not JSON
    assert b"".join(bytes(e.token.bytes) for e in piece.logprobs) == " café".encode()
    missing = asm.add([ids[0]], None).logprobs[0]
    assert missing.token.logprob is None and missing.top == ()


def test_token_bytes_of_a_split_character_are_its_raw_bytes() -> None:
    tok = tokenizer()
    renderer = TokenRenderer(tok)
    ids = tok.encode(" 😀")
    raw = [renderer.text_and_bytes(t)[1] for t in ids]
    assert len(ids) > 1 and b"".join(bytes(r) for r in raw) == " 😀".encode()
    text, special = renderer.text_and_bytes(tok.eos_token_ids[0])
    assert text == "<|im_end|>" and bytes(special) == b"<|im_end|>"
