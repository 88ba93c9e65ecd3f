"""CPU: speculative decoding against decoding without it, same engine, same run.

Real SmolLM2-135M-Instruct, float32 (the exact mode), greedy, each answer up to its EOS
(at most ``--max-tokens``); every speculative run's tokens are checked against the plain
run's (speculation must not change greedy output).
Decode tokens/s counts the tokens after each request's first (the prompt's step is not
decode) over the wall time of those steps. Off and on alternate, ``--reps`` times, and
each figure is the median.

- ``ngram`` on a workload that copies from its prompt (code edits, extraction, quoting):
  goal >= 1.8x decode tokens/s;
- ``ngram`` on chat with little repetition: goal >= 0.95x (no loss);
- a batch of four where one sequence pays little (three copy requests and one chat
  request) against the same batch without speculation: the adaptive switch-off must keep
  the bad sequence from slowing the batch;
- what a verify step costs against a decode step, for k = 1, 2, 4, 8 (drafts from a
  proposer that costs nothing, acceptance forced to 0: every step verifies ``k`` drafts
  and emits one token), batch 1 (``verify_cost``);
- ``replay`` (no timing): the n-gram lookup replayed over the plain answers for k 2 / 4 / 8
  and lookup ranges 1-4, 2-4, 3-5, 5-5 (vLLM's default): steps, the share of them that
  find drafts, mean acceptance length; what a free verify step would give;
- ``self_draft`` (the target's first layers) with and without a pruned draft vocabulary
  (built with the documented count over the model's own generations): mean acceptance
  length, speedup, and the draft head's cost with and without pruning (ms per call).

    python -m bench.spec_bench [--threads 2] [--max-tokens 128] [--reps 3] [--ngram-config JSON] [--out bench/results/spec_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import numpy as np
import torch

from bench.common import save_results, table
from libs.engine import EngineConfig, LLM, SamplingParams
from libs.engine.spec.proposer import Drafts
from libs.engine.spec.vocab import DraftVocab, count_generations

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''
TEXT = (
    "The harbour of Saint-Malo is one of the busiest on the coast of Brittany. Ferries leave for "
    "England and the Channel Islands several times a day, and in summer the quays are crowded with "
    "travellers, fishermen and merchants. The old town, rebuilt after the war, is surrounded by "
    "granite ramparts from which visitors can watch the tide, among the highest in Europe, rise by "
    "more than twelve metres."
)
# Code edits and extractions this model carries out by copying (checked by replaying the
# n-gram lookup over its own outputs; a "copy, then translate" prompt of an earlier version
# was dropped: the model translates the whole paragraph instead of copying it).
TYPOS = TEXT.replace("busiest", "busyest").replace("travellers", "travelers").replace("merchants", "merchnts")
COPY = [
    f"Rename the variable `items` to `products` in this code and show the full result:\n```python\n{CODE}```",
    f"Add a docstring to each function in this code and show the full result:\n```python\n{CODE}```",
    f"Add a comment above each line of this code and show the full result:\n```python\n{CODE}```",
    f"Add type hints to this code and show the full result:\n```python\n{CODE}```",
    f"Quote the sentence about the ramparts from this text, then summarise it:\n\n{TEXT}",
    f"Fix the spelling mistakes in this paragraph and write it out in full:\n\n{TYPOS}",
]
CHAT = [
    "Write a short story about a dragon who learns to paint.",
    "Explain how photosynthesis works to a ten-year-old.",
    "What are three good habits for staying healthy in winter?",
    "Describe the city of Lisbon in a few sentences.",
]
VOCAB_PROMPTS = [  # the draft vocabulary is counted on other prompts than the measured ones
    "Tell me about the history of the bicycle.", "How do I bake bread at home?", "Write a poem about autumn rain.",
    "What is a prime number?", "Give me tips for learning a new language.", "Explain what a database index is.",
    "Write a Python function that reverses a string.", "What causes the seasons on Earth?",
    "Describe a day at the beach.", "How does a refrigerator work?", "Summarise the plot of a detective story.",
    "What should I pack for a hiking trip?", "Explain recursion with an example.", "Write a letter to a friend.",
    "What is the difference between weather and climate?", "List some uses of vinegar around the house.",
]


# KV blocks per engine: 4096 tokens, room for a batch of four (about 0.2 GB each; three
# engines live at once, on a shared machine).
NUM_BLOCKS = 256


def engine(loaded, spec: dict | None, threads: int) -> LLM:
    return LLM(
        EngineConfig(device="cpu", dtype="float32", num_threads=threads, num_blocks=NUM_BLOCKS, enable_prefix_caching=False,
                     speculative_config=json.dumps(spec) if spec else None),
        loaded=loaded,
    )


def decode_run(eng: LLM, prompts: list[list[int]], max_tokens: int, batch: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s over ``prompts`` run ``batch`` at a time; and the tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)  # the model's answer: up to EOS
    tokens: list[list[int]] = []
    n_decode, seconds = 0, 0.0
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        outs = {f"r{j}": [] for j in range(len(group))}
        for j, p in enumerate(group):
            eng.add_request(f"r{j}", p, params)
        while not all(outs.values()):  # the prompt steps: each request's first token
            for o in eng.step():
                outs[o.request_id].extend(o.outputs[0].new_token_ids)
        first = sum(len(v) for v in outs.values())
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            for o in eng.step():
                outs[o.request_id].extend(o.outputs[0].new_token_ids)
        seconds += time.perf_counter() - t
        n_decode += sum(len(v) for v in outs.values()) - first
        tokens.extend(outs[f"r{j}"] for j in range(len(group)))
    return n_decode / seconds, tokens


def compare(loaded, prompts, spec: dict, *, threads: int, max_tokens: int, batch: int, reps: int) -> dict:
    off, on = engine(loaded, None, threads), engine(loaded, spec, threads)
    decode_run(off, prompts[:1], 8, 1)  # warm-up
    decode_run(on, prompts[:1], 8, 1)
    off_tps, on_tps, ref = [], [], None
    m0 = on.spec.metrics.snapshot()
    for _ in range(reps):
        tps, ref = decode_run(off, prompts, max_tokens, batch)
        off_tps.append(tps)
        tps, got = decode_run(on, prompts, max_tokens, batch)
        on_tps.append(tps)
        assert got == ref, "speculation changed greedy output"
    m = on.spec.metrics.snapshot()
    drafts = m["num_drafts"] - m0["num_drafts"]
    accepted = m["num_accepted_tokens"] - m0["num_accepted_tokens"]
    off_m, on_m = statistics.median(off_tps), statistics.median(on_tps)
    out = {
        "off_tok_s": round(off_m, 1), "on_tok_s": round(on_m, 1), "speedup": round(on_m / off_m, 3),
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "drafts": drafts, "draft_tokens": m["num_draft_tokens"] - m0["num_draft_tokens"], "accepted": accepted,
        "paused_sequences": on.spec.adaptive.num_disabled,
        "off_runs": [round(x, 1) for x in off_tps], "on_runs": [round(x, 1) for x in on_tps],
    }
    off.close()
    on.close()
    return out


class FreeDrafts:
    """Drafts at no cost: the last token, ``max_drafts`` times (bench/gpu_spec.py's too)."""

    name = "free"

    def propose(self, requests) -> Drafts:
        return Drafts([[r.seq.token_ids[-1]] * r.max_drafts for r in requests])

    def forget(self, seq_id: int) -> None:
        pass


def verify_cost(loaded, prompt: list[int], threads: int, ks=(1, 2, 4, 8), tokens: int = 32, reps: int = 3) -> dict:
    """Median ms per step of plain decoding and of verify steps with ``k`` drafts (all
    rejected: one token per step either way), alternating, ``reps`` times."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engines = {"off": engine(loaded, None, threads)}
    for k in ks:
        engines[f"k{k}"] = engine(loaded, {"method": "ngram", "num_speculative_tokens": k, "forced_acceptance": 0.0, "min_acceptance_length": 0}, threads)
        engines[f"k{k}"].spec.proposer = FreeDrafts()
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(reps):
        for name, eng in engines.items():
            eng.add_request("v", prompt, params)
            eng.step()  # the prompt
            while eng.has_unfinished_requests():
                t = time.perf_counter()
                eng.step()
                times[name].append(time.perf_counter() - t)
    ms = {name: statistics.median(ts[:-1]) * 1e3 for name, ts in times.items()}  # (the last step cannot draft)
    for eng in engines.values():
        eng.close()
    return {"decode_step_ms": round(ms["off"], 2), **{f"verify_k{k}_ms": round(ms[f"k{k}"], 2) for k in ks},
            **{f"verify_k{k}_over_decode": round(ms[f"k{k}"] / ms["off"], 2) for k in ks}}


def lookup_replay(loaded, workloads: dict[str, list[list[int]]], configs: list[tuple[int, int, int]], max_tokens: int, threads: int) -> dict:
    """The n-gram lookup replayed over the plain greedy answers (no timing): for each
    ``(k, prompt_lookup_min, prompt_lookup_max)``, the steps speculation takes, the share of
    them that verify drafts, and the mean acceptance length. A step emits the accepted
    drafts plus one token, exactly as greedy verification does."""
    from libs.engine.spec.ngram import ngram_lookup

    eng = engine(loaded, None, threads)
    out = {}
    for name, prompts in workloads.items():
        _, answers = decode_run(eng, prompts, max_tokens, 1)
        plain = sum(len(a) - 1 for a in answers)
        rows = {}
        for k, lo, hi in configs:
            steps = verifies = 0
            for prompt, answer in zip(prompts, answers):
                i = 1  # the first token is the prompt step's
                while i < len(answer):
                    d = ngram_lookup(np.asarray(prompt + answer[:i], dtype=np.int64), lo, hi, min(k, len(answer) - i))
                    a = next((j for j, t in enumerate(d) if t != answer[i + j]), len(d))
                    steps, verifies, i = steps + 1, verifies + bool(d), i + a + 1
            rows[f"k{k}_lookup{lo}-{hi}"] = {"steps": steps, "verify_share": round(verifies / steps, 3),
                                             "mean_acceptance_length": round(1 + (plain - steps) / max(verifies, 1), 2),
                                             "tokens_per_step": round(plain / steps, 3)}
        out[name] = {"plain_steps": plain, **rows}
    eng.close()
    return out


def head_cost(loaded, vocab: DraftVocab, threads: int, reps: int = 50) -> dict:
    """ms per LM-head call of the draft at batch 1 and 8: full vocabulary vs pruned."""
    torch.set_num_threads(threads)
    model = loaded.model
    full = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    pruned = vocab.prune_head(full)
    out = {}
    for b in (1, 8):
        h = torch.randn(b, full.shape[1])
        for name, w in (("full", full), ("pruned", pruned)):
            torch.nn.functional.linear(h, w)
            t = time.perf_counter()
            for _ in range(reps):
                torch.nn.functional.linear(h, w).float()
            out[f"{name}_b{b}_ms"] = round((time.perf_counter() - t) / reps * 1e3, 3)
        out[f"saving_b{b}"] = round(out[f"full_b{b}_ms"] / out[f"pruned_b{b}_ms"], 2)
    # For scale: one layer of the draft at batch 1.
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--self-draft-layers", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--only", nargs="*", default=None, help="run only these cases (copy, chat, mixed, verify_cost, self_draft, replay)")
    ap.add_argument("--min-acceptance-length", type=float, default=None, help="the n-gram cases' adaptive threshold (default: the config's, 1.3)")
    ap.add_argument("--ngram-config", default=None, help="the n-gram cases' speculative config, JSON (default: the issue's example, k 4, lookup 2..4)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = LLM(EngineConfig(device="cpu", dtype="float32", num_threads=args.threads, num_blocks=NUM_BLOCKS))
    tok = base.tokenizer
    enc = lambda msgs: [tok.encode_chat([{"role": "user", "content": m}]) for m in msgs]  # noqa: E731
    copy, chat = enc(COPY), enc(CHAT)
    ngram = json.loads(args.ngram_config) if args.ngram_config else {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if args.min_acceptance_length is not None:
        ngram["min_acceptance_length"] = args.min_acceptance_length
    want = set(args.only or ["copy", "chat", "mixed", "verify_cost", "replay", "self_draft"])
    results: dict = {
        "device": platform.processor() or platform.machine(), "threads": args.threads, "max_tokens": args.max_tokens,
        "reps": args.reps, "min_acceptance_length": args.min_acceptance_length, "ngram_config": ngram, "load_before": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    }
    kw = dict(threads=args.threads, max_tokens=args.max_tokens, reps=args.reps)

    def record(name: str, value: dict) -> None:  # printed and saved as each case ends
        results[name] = value
        print(name, json.dumps(value), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    if "copy" in want:
        record("ngram_copy", compare(base.loaded, copy, ngram, batch=1, **kw))
    if "chat" in want:
        record("ngram_chat", compare(base.loaded, chat, ngram, batch=1, **kw))
    if "mixed" in want:
        record("ngram_mixed_batch", compare(base.loaded, copy[:3] + chat[:1], ngram, batch=4, **kw))
        record("ngram_chat_batch", compare(base.loaded, chat, ngram, batch=4, **kw))
    if "replay" in want:
        configs = [(k, lo, hi) for k in (2, 4, 8) for lo, hi in ((1, 4), (2, 4), (3, 5), (5, 5))]
        record("lookup_replay", lookup_replay(base.loaded, {"copy": copy, "chat": chat}, configs, args.max_tokens, args.threads))
    if "verify_cost" in want:
        record("verify_cost", verify_cost(base.loaded, copy[0], args.threads))
    if "self_draft" in want:
        t = time.perf_counter()
        counts = count_generations(base, VOCAB_PROMPTS, max_tokens=96, temperature=1.0, seed=0)
        vocab = DraftVocab.from_counts(counts, args.vocab_size, always=tok.eos_token_ids)
        path = "/tmp/tidepool-spec-bench-vocab.safetensors"
        vocab.save(path)
        covered = float(counts[vocab.target_ids].sum()) / float(counts.sum())
        record("vocab", {"size": vocab.size, "counted_tokens": int(counts.sum()), "coverage_of_counted": round(covered, 4), "build_s": round(time.perf_counter() - t, 1)})
        record("draft_head_cost", head_cost(base.loaded, vocab, args.threads))
        for layers in args.self_draft_layers:
            for pruned in (False, True):
                spec = {"method": "self_draft", "num_draft_layers": layers, "num_speculative_tokens": 3, "min_acceptance_length": 0}
                if pruned:
                    spec["draft_vocab"] = path
                name = f"self_draft_L{layers}" + ("_pruned" if pruned else "")
                record(name, compare(base.loaded, chat[:2] + copy[:2], spec, batch=1, **{**kw, "reps": max(1, args.reps - 1)}))
    rows = [[k, v["off_tok_s"], v["on_tok_s"], f"{v['speedup']}x", v["mean_acceptance_length"]] for k, v in results.items() if isinstance(v, dict) and "speedup" in v]
    print(table(["case", "off tok/s", "on tok/s", "speedup", "mean acceptance length"], rows))
    if "draft_head_cost" in results:
        print(json.dumps({"vocab": results["vocab"], "draft_head_cost": results["draft_head_cost"]}))
    save_results(results, args.out)


if __name__ == "__main__":
    main()
