"""Streamed PD export (libs/engine/kv_export.py): a chunked prompt's full blocks are handed
out after the step that completed them, the rest at the end, on a tiny random model."""

import pytest
import torch

from libs.engine import SamplingParams
from tests.models import tiny_engine

ONE = SamplingParams(temperature=0, max_tokens=1)
BS = 16


def prompt(n: int, offset: int = 300) -> list[int]:
    return [offset + 3 * i for i in range(n)]


def run(eng, rid: str, ids: list[int], *, stream: bool, release: bool = True):
    """Step ``rid`` to the end; its outputs in order (exported pieces copied out, released)."""
    eng.add_request(rid, ids, ONE, export_kv=True, stream_export=stream)
    outs = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id != rid:
                continue
            piece = None
            if o.exported_kv is not None:
                e = o.exported_kv
                piece = (e.first_block, [(b.clone(), n) for b, n in e.blocks()])
                if release:
                    e.release()
            outs.append((o, piece))
    return outs


def blocks_of(outs) -> list[tuple[int, torch.Tensor, int]]:
    flat = []
    for _, piece in outs:
        if piece is not None:
            first, blocks = piece
            flat += [(first + i, b, n) for i, (b, n) in enumerate(blocks)]
    return flat


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_chunks_hand_out_full_blocks_before_the_prompt_finishes_and_match_the_end_export(async_scheduling):
    """With async scheduling a chunk's blocks go out once its step is read back (the next
    chunk already launched): the same pieces, a step later."""
    ids = prompt(150)  # 9 full blocks + a 6-token tail; 40-token chunks: 4 steps
    eng = tiny_engine(max_num_batched_tokens=40, enable_prefix_caching=False, async_scheduling=async_scheduling)
    streamed = run(eng, "s", ids, stream=True)
    at_end = run(eng, "e", ids, stream=False)

    early = [(o, p) for o, p in streamed if not o.finished]
    assert early and all(p is not None and not o.outputs for o, p in early)  # pieces only, no tokens
    # After a step computing tokens [0, 40k), the blocks fully inside are handed out.
    assert [p[0] for _, p in early] == [0, 2, 5]
    assert [len(p[1]) for _, p in early] == [2, 3, 2]
    final, piece = streamed[-1]
    assert final.finished and piece[0] == 7 and len(piece[1]) == 3  # blocks 7, 8 and the partial tail

    got, want = blocks_of(streamed), blocks_of(at_end)
    assert [i for i, _, _ in got] == list(range(10)) == [i for i, _, _ in want]
    assert [n for _, _, n in got] == [BS] * 9 + [6] == [n for _, _, n in want]
    for (_, a, _), (_, b, _) in zip(got, want):
        assert torch.equal(a, b)
    first_tokens = [[t for c in o.outputs for t in c.new_token_ids] for o, _ in (streamed[-1], at_end[-1])]
    assert first_tokens[0] == first_tokens[1] and len(first_tokens[0]) == 1
    assert eng.exports.num_streamed_blocks == 7
    assert eng.swapper.in_use == 0 and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_a_prompt_done_in_one_chunk_exports_everything_at_the_end():
    eng = tiny_engine(max_num_batched_tokens=512)
    outs = run(eng, "s", prompt(70), stream=True)
    assert len(outs) == 1 and outs[0][0].finished
    assert [i for i, _, _ in blocks_of(outs)] == list(range(5))
    assert eng.exports.num_streamed_blocks == 0


def test_no_staging_defers_pieces_and_the_end_picks_up_where_they_stopped():
    ids = prompt(150)
    eng = tiny_engine(max_num_batched_tokens=40, swap_buffers=1, enable_prefix_caching=False)
    eng.add_request("s", ids, ONE, export_kv=True, stream_export=True)
    held = None
    pieces = []
    steps = 0
    while eng.has_unfinished_requests():
        steps += 1
        for o in eng.step():
            if o.exported_kv is not None:
                pieces.append((o.exported_kv.first_block, o.exported_kv.num_blocks, o.finished))
                if held is None:
                    held = o.exported_kv  # the one staging buffer stays lent for a while
                else:
                    o.exported_kv.release()
        if steps == 5 and held is not None:
            held.release()  # the prompt finished at step 4 and has been waiting for staging
        assert steps < 50
    # Only the first piece went early; everything after it waited for the end.
    assert pieces == [(0, 2, False), (2, 8, True)]
    assert eng.swapper.in_use == 0 and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_abort_mid_stream_frees_blocks_and_staging():
    eng = tiny_engine(max_num_batched_tokens=40)
    eng.add_request("s", prompt(150), ONE, export_kv=True, stream_export=True)
    outs = eng.step() + eng.step()
    assert any(o.exported_kv is not None for o in outs)
    eng.abort_request("s")
    outs += eng.step()
    for o in outs:
        if o.exported_kv is not None:
            o.exported_kv.release()
    assert outs[-1].finished
    assert eng.swapper.in_use == 0 and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert eng.exports._handed_out == {}


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_preempted_stream_hands_out_each_block_once(async_scheduling):
    eng = tiny_engine(num_blocks=14, max_num_batched_tokens=32, enable_prefix_caching=False, async_scheduling=async_scheduling)
    long_ids = prompt(150)
    rival = prompt(60, offset=2000)
    eng.add_request("r", rival, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    eng.add_request("s", long_ids, ONE, export_kv=True, stream_export=True)  # arrived last: preempted first
    got = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.exported_kv is not None:
                got += [o.exported_kv.first_block + i for i in range(o.exported_kv.num_blocks)]
                o.exported_kv.release()
    assert eng.scheduler.num_preemptions > 0
    assert got == list(range(10))
    eng.close()
