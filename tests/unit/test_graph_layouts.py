"""The CUDA-graph step layouts, checked on the CPU by running them eagerly (``emulate``).

A decode graph runs a padded batch (padding rows write to slot -1 and have length 0); a
prefill graph runs every row, decode rows included, as queries of the prefill kernel
over a padded token bucket and padded sequence slots. Run eagerly on those exact
layouts, the engine must produce what it produces without them (tests/gpu replays the
real graphs against eager), even with NaN in the bucket's rows past its last sequence,
which a GPU graph's memory may hold.
"""

import pytest

from libs.engine import SamplingParams
from tests.models import tiny_engine
from tests.unit.test_async_scheduling import drive, mixed_workload


def test_graph_layouts_run_eagerly_equal_the_plain_layouts():
    reqs = mixed_workload(4)[:12]
    cfg = dict(num_blocks=96, max_num_batched_tokens=64, max_num_seqs=12)
    plain = drive(tiny_engine(**cfg), reqs)
    eng = tiny_engine(**cfg, async_scheduling="on")
    eng.enable_graphs(emulate=True)
    assert eng.builder.decode_graph_sizes[-1] == 12 and eng.builder.prefill_graph_tokens[-1] == 64
    padded = drive(eng, reqs)
    replays = eng.runner.graphs.replays
    assert replays["decode"] > 10 and replays["prefill"] > 5
    for key in plain:
        assert plain[key]["ids"] == padded[key]["ids"] and plain[key]["reason"] == padded[key]["reason"], key
    assert eng.block_manager.num_free_blocks == 96
    eng.close()
    assert eng.runner.graphs is None  # closing releases the graphs (ForwardGraphs.release)


def test_steps_too_big_for_a_graph_run_eagerly():
    eng = tiny_engine(num_blocks=200, max_num_batched_tokens=256, max_num_seqs=4, graph_max_batch=2, prefill_graph_max_tokens=32)
    eng.enable_graphs(emulate=True)
    paths = []
    build = eng.builder.build

    def spy(*a):
        step = build(*a)
        paths.append((step.path, step.num_decodes, step.num_tokens))
        return step

    eng.builder.build = spy
    p = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 6, 10)]
    prompts = [list(range(100, 140)), list(range(300, 310)), list(range(500, 503))]
    ref = tiny_engine(num_blocks=200).generate(prompts, p)
    got = eng.generate(prompts, p)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert ("eager", 0, 53) in paths  # 53 prompt tokens > the 32-token bucket
    assert any(path == "eager" and nd == 3 and t == 3 for path, nd, t in paths)  # 3 decodes > the largest graph (2)
    assert any(path == "decode_graph" and nd == 1 for path, nd, _ in paths)  # the last one alone
    eng.close()


def test_a_step_whose_inputs_do_not_fit_the_graph_buffers_runs_eagerly():
    """A graph reads only the device packs; a step whose pack is larger (here min_tokens
    bans thousands of stop ids) gets temporary buffers, so it must not replay a graph:
    it would compute on the inputs of the last step that fitted (the H100 async test's
    greedy row that took other requests' tokens). The emulation reads the device packs
    as a graph does, so this shows on the CPU."""
    stops = tuple(range(0, 49152, 7))
    prompts = [list(range(10 + 7 * i, 40 + 9 * i)) for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params = [greedy] * 3 + [SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=stops)]
    ref = tiny_engine(num_blocks=128, max_num_seqs=8, max_num_batched_tokens=128).generate(prompts, params)
    eng = tiny_engine(num_blocks=128, max_num_seqs=8, max_num_batched_tokens=128)
    eng.enable_graphs(emulate=True)
    paths = []
    build = eng.builder.build

    def spy(*a):
        step = build(*a)
        paths.append((step.path, step.layout))
        return step

    eng.builder.build = spy
    got = eng.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    paths = [(path, eng.runner.staging.fits_device(layout)) for path, layout in paths]
    assert ("eager", False) in paths  # the banning steps did not fit
    assert all(fits for path, fits in paths if path != "eager")
    assert eng.runner.graphs.replays["decode"] > 0  # graphs ran once the bans were over
    eng.close()


def test_greedy_decode_steps_take_the_graphs_argmax_unless_the_logits_are_processed():
    """A decode graph computes each row's argmax of the raw logits. A decode step of
    greedy rows whose logits nothing processes takes it (the sampler launches no argmax
    of its own); a step with a logit bias or a penalty takes the argmax of the processed
    logits. Either way the tokens equal those of the engine without graphs (the bias
    forces a token the raw argmax would not pick)."""
    prompts = [list(range(100, 120)), list(range(300, 310))]
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cases = {
        "plain": [plain, plain],
        "processed": [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={4321: 100.0}),
                      SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, frequency_penalty=1.5)],
    }
    for name, params in cases.items():
        ref = tiny_engine(num_blocks=64).generate(prompts, params)
        eng = tiny_engine(num_blocks=64)
        eng.enable_graphs(emulate=True)
        given = []  # per decode-graph step: whether pick got the graph's argmax
        pick, build = eng.runner.sampler.pick, eng.builder.build
        paths = []

        def spy_build(*a):
            step = build(*a)
            paths.append(step.path)
            return step

        def spy_pick(logits, st, *a, greedy=None, **k):
            if paths[-1] == "decode_graph":
                given.append(greedy is not None)
            return pick(logits, st, *a, greedy=greedy, **k)

        eng.builder.build, eng.runner.sampler.pick = spy_build, spy_pick
        got = eng.generate(prompts, params)
        assert [r.token_ids for r in got] == [r.token_ids for r in ref], name
        assert len(given) >= 4, name
        assert all(given) if name == "plain" else not any(given), (name, given)
        eng.close()
    assert ref[0].token_ids == [4321] * 6  # the bias decided every token of the first request


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on the NaN rows
@pytest.mark.parametrize("tma", [False, True], ids=["row-loads", "tma"])
def test_prefill_graph_padding_rows_never_reach_the_real_rows(tma, monkeypatch):
    """A prefill graph's token bucket has rows past the last sequence, which no attention
    kernel writes: on a GPU they hold whatever the graph's memory held, and from the next
    layer on so do their K and V. On two H200s that was NaN, and a TP=2 engine sampled
    token 0 at every position: the fresh prompts' attention kernel loaded those rows in a
    TMA box and met them in P @ V. Here the Triton attention runs in the interpreter (TMA
    boxes as Hopper takes them, or row loads) on the emulated graph layouts, with
    attention's padding rows set to NaN after every prefill: the tokens equal the plain
    engine's."""
    from kernels.attention import triton_prefill
    from libs.model.attention import triton_backend

    monkeypatch.setattr(triton_prefill, "_use_tma", lambda q, k, v: tma)
    prompts = [list(range(100, 106)), list(range(300, 321)), list(range(500, 503))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ref = tiny_engine(num_blocks=64).generate(prompts, params)
    eng = tiny_engine(num_blocks=64, max_num_batched_tokens=64)
    backend = triton_backend()
    prefill = backend._prefill
    poisoned = []

    def prefill_with_garbage_padding(q, k_cache, v_cache, tables, starts, lens, scale, new_kv=None):
        out = prefill(q, k_cache, v_cache, tables, starts, lens, scale, new_kv)
        end = int(starts[-1])
        if end < out.shape[0]:
            out[end:] = float("nan")
            poisoned.append(out.shape[0] - end)
        return out

    backend._prefill = prefill_with_garbage_padding
    for layer in eng.runner.model.layers:
        layer.self_attn.backend = backend
    eng.enable_graphs(emulate=True)
    got = eng.generate(prompts, params)
    assert poisoned and eng.runner.graphs.replays["prefill"] > 0  # padded buckets ran
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    eng.close()
