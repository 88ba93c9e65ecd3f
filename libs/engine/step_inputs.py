"""A step's inputs: written by the host into pinned staging, moved with one copy per dtype.

Everything a step needs from the host (positions, slots, block tables, sampling
parameters, ...) is packed into three flat buffers (int64, int32, float32) whose layout
is a pure function of a few sizes (``Layout``). The host fills the pack with vectorised
reads of the persistent batch (libs/engine/input_batch.py); the device gets it with one
non-blocking copy per dtype and reads named views of it. Input ids of decoding rows do
not come from the host at all: they are gathered on the device from the tokens the last
step sampled (``decode_slots``), so a step can be launched before the previous one's
tokens have been read back (async scheduling).

The forward's inputs come first in each pack and their offsets depend only on the
capacities ``(tokens, seqs, width)``: a CUDA graph captured on the views of one capacity
reads the right memory whenever a step is laid out with that capacity again
(libs/engine/cuda_graphs.py). Unused capacity is padding that writes nowhere (slot -1)
and attends to nothing (length 0).

Staging is double-buffered: the pack of step N is only rewritten for step N + 2, after
step N's results have been read (so its copy and its kernels are done). On the CPU the
"device" pack is the staging itself: no copy (unless graphs are emulated, which read
device packs as captured graphs do). A graph reads only the device packs, so a step whose
pack does not fit them runs eagerly (``StepStaging.fits_device``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from libs.engine.sampler import bias_and_bans
from libs.model.attention import AttentionMetadata

if TYPE_CHECKING:
    from libs.engine.input_batch import InputBatch
    from libs.engine.sequence import Sequence

_I64 = ("input_ids", "positions", "slot_mapping")  # x tokens
_I64_SEQS = ("decode_slots",)  # x seqs
_I64_SAMPLES = ("logits_indices", "sample_slots", "top_k")  # x samples
_I32_SEQS = ("seq_lens",)
_F32_SAMPLES = ("temperature", "top_p", "min_p", "presence", "frequency", "repetition")


class Layout(NamedTuple):
    """Capacities of one step's pack; every offset follows from them (a tuple: built and
    hashed every step)."""

    tokens: int
    seqs: int
    width: int  # block-table columns
    samples: int = 0
    bans: int = 0  # (row, token) pairs banned this step (min_tokens, logit_bias -100)
    biases: int = 0  # (row, token, value) logit_bias additions this step
    logprob_rows: int = 0

    def sizes(self) -> tuple[int, int, int]:
        i64 = 3 * self.tokens + self.seqs + 3 * self.samples + 2 * self.bans + 2 * self.biases + self.logprob_rows
        i32 = self.seqs + (self.seqs + 1) + self.seqs * self.width
        return i64, i32, len(_F32_SAMPLES) * self.samples + self.biases

    def views(self, i64: torch.Tensor | np.ndarray, i32, f32) -> "PackViews":
        """Named views of packs laid out by this layout (numpy on the host side, torch on
        the device side: the same offsets)."""
        T, B, S = self.tokens, self.seqs, self.samples
        v: dict = {}
        o = 0
        for name in _I64:
            v[name] = i64[o : o + T]
            o += T
        v["decode_slots"] = i64[o : o + B]
        o += B
        for name in _I64_SAMPLES:
            v[name] = i64[o : o + S]
            o += S
        for name, n in (("ban_rows", self.bans), ("ban_cols", self.bans), ("bias_rows", self.biases), ("bias_cols", self.biases), ("logprob_rows", self.logprob_rows)):
            v[name] = i64[o : o + n]
            o += n
        v["seq_lens"] = i32[:B]
        v["query_start_loc"] = i32[B : 2 * B + 1]
        v["block_tables"] = i32[2 * B + 1 : 2 * B + 1 + B * self.width].reshape(B, self.width)
        v["sampling_params"] = f32[: len(_F32_SAMPLES) * S].reshape(len(_F32_SAMPLES), S)
        for i, name in enumerate(_F32_SAMPLES):
            v[name] = v["sampling_params"][i]
        o = len(_F32_SAMPLES) * S
        v["bias_vals"] = f32[o : o + self.biases]
        return PackViews(**v)


@dataclass
class PackViews:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    decode_slots: torch.Tensor
    logits_indices: torch.Tensor
    sample_slots: torch.Tensor
    top_k: torch.Tensor
    ban_rows: torch.Tensor
    ban_cols: torch.Tensor
    bias_rows: torch.Tensor
    bias_cols: torch.Tensor
    bias_vals: torch.Tensor
    logprob_rows: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    sampling_params: torch.Tensor  # [6, S]: the six rows above (the batch's FLOAT_PARAMS order)

    def metadata(self, num_decodes: int, num_prefill_tokens: int, max_seq_len: int, num_verify_tokens: int = 0) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
            query_start_loc=self.query_start_loc,
            num_decodes=num_decodes,
            num_prefill_tokens=num_prefill_tokens,
            max_seq_len=max_seq_len,
            num_verify_tokens=num_verify_tokens,
        )


class _ViewCache:
    """Views of fixed buffers per layout: a decode step has the same layout as the one
    before it unless the batch changed, so its views are reused rather than re-sliced."""

    def __init__(self, buffers: tuple, size: int = 8):
        self.buffers = buffers
        self._views: dict[Layout, PackViews] = {}
        self._size = size

    def get(self, layout: Layout) -> PackViews:
        v = self._views.get(layout)
        if v is None:
            if len(self._views) >= self._size:
                self._views.pop(next(iter(self._views)))
            v = self._views[layout] = layout.views(*self.buffers)
        return v


class HostPack:
    """One staging slot: three flat host buffers (pinned on CUDA) and their numpy views."""

    def __init__(self, sizes: tuple[int, int, int], pinned: bool):
        self.tensors = tuple(
            torch.empty(max(n, 1), dtype=dt, pin_memory=pinned) for n, dt in zip(sizes, (torch.int64, torch.int32, torch.float32))
        )
        self.arrays = tuple(t.numpy() for t in self.tensors)
        self.array_views = _ViewCache(self.arrays)
        self.tensor_views = _ViewCache(self.tensors)

    def fits(self, sizes: tuple[int, int, int]) -> bool:
        return all(n <= t.numel() for n, t in zip(sizes, self.tensors))


class StepStaging:
    """The double-buffered host packs and, on CUDA, the device packs they are copied to.

    The device packs are sized once for the largest layout of any captured graph (their
    views must not move); a larger eager step gets temporary device buffers."""

    def __init__(self, device: torch.device, device_sizes: tuple[int, int, int] = (0, 0, 0)):
        self.device = device
        self.pinned = device.type == "cuda"
        self._slots = [HostPack((1024, 1024, 256), self.pinned) for _ in range(2)]
        self._next = 0
        self.device_packs: tuple[torch.Tensor, ...] | None = None
        if device.type == "cuda":
            self.set_device_packs(tuple(
                torch.zeros(max(n, 1), dtype=dt, device=device) for n, dt in zip(device_sizes, (torch.int64, torch.int32, torch.float32))
            ))

    def set_device_packs(self, packs: tuple[torch.Tensor, ...]) -> None:
        self.device_packs = packs
        self._device_views = _ViewCache(packs, size=64)

    def host(self, layout: Layout) -> tuple[HostPack, "PackViews"]:
        """The next staging slot, grown to fit ``layout``, and its numpy views."""
        k = self._next
        self._next ^= 1
        sizes = layout.sizes()
        if not self._slots[k].fits(sizes):
            self._slots[k] = HostPack(tuple(max(2 * n, 1024) for n in sizes), self.pinned)  # type: ignore[arg-type]
        pack = self._slots[k]
        return pack, pack.array_views.get(layout)

    def fits_device(self, layout: Layout) -> bool:
        """Whether a step of ``layout`` lands in the device packs, the only memory a
        captured graph reads (always, where there are none: the host pack is read then).
        A layout that does not fit gets temporary device buffers, so it must run eagerly."""
        return self.device_packs is None or all(n <= p.numel() for n, p in zip(layout.sizes(), self.device_packs))

    def upload(self, pack: HostPack, layout: Layout, *, params: bool = True) -> PackViews:
        """Device views of ``pack`` (call on the device queue, in step order). ``params``:
        whether the float32 sampling parameters are read (no copy for them otherwise)."""
        if self.device_packs is None:
            return pack.tensor_views.get(layout)
        sizes = layout.sizes()
        fits = self.fits_device(layout)
        dev = self.device_packs if fits else tuple(torch.empty(n, dtype=p.dtype, device=self.device) for n, p in zip(sizes, self.device_packs))
        for i, (n, host, target) in enumerate(zip(sizes, pack.tensors, dev)):
            if n and (params or i < 2):
                target[:n].copy_(host[:n], non_blocking=True)
        return self._device_views.get(layout) if fits else layout.views(*dev)

    def device_views(self, layout: Layout) -> PackViews:
        """Views of the device packs for ``layout`` (graph capture)."""
        assert self.device_packs is not None
        return self._device_views.get(layout)


# -- one step, laid out -------------------------------------------------------------------


@dataclass
class Chunk:
    """A prefill row of the step: ``num_tokens`` prompt tokens of ``seq`` from ``start``,
    then (when the chunk reaches the end) one sample for the sequence and one for each of
    ``children`` (``n > 1`` siblings drawn from the same logits row).

    A *verify* chunk (speculative decoding, libs/engine/spec) feeds ``token_ids`` instead of
    the sequence's own tokens (its last token and its drafts) and samples at every one of
    its ``num_tokens`` positions. Verify chunks come before prompt chunks: their tokens are
    generated ones, which the 4-bit path runs as decode rows (``num_verify_tokens``)."""

    seq: "Sequence"
    start: int
    num_tokens: int
    num_samples: int
    children: list["Sequence"]
    token_ids: list[int] | None = None
    verify: bool = False


@dataclass(slots=True)
class Step:
    """One step, laid out on the host: everything its device work reads. Immutable once
    submitted (the device queue may run it on another thread)."""

    index: int
    layout: Layout
    pack: HostPack
    num_slots: int  # device slots in use (the device state grows to hold them)
    path: str  # "eager", "decode_graph" or "prefill_graph"
    num_decodes: int
    num_tokens: int
    num_seqs: int
    num_prefill_seqs: int
    max_seq_len: int
    sample_seqs: list["Sequence"]
    chunks: list[Chunk]
    # sampling
    all_greedy: bool = True
    any_greedy: bool = True
    any_top_k: bool = False
    any_top_p: bool = False
    any_min_p: bool = False
    any_penalties: bool = False
    any_repetition: bool = False
    params: bool = False  # the float sampling parameters were laid out (some stage reads them)
    max_logprobs: int = -1  # -1: no row wants logprobs
    logprob_samples: list[int] | None = None  # sample rows that want them, and their k
    logprob_ks: list[int] | None = None
    generators: list[tuple[int, "torch.Generator"]] | None = None
    captures: list[int] | None = None  # sample rows whose logits are kept (tests)
    bitmask: tuple | None = None  # (constrained sample rows, future of their grammar masks)
    num_verify_tokens: int = 0  # tokens of verify chunks (sample rows nd .. nd + this)
    spec: object | None = None  # the verification's sampling (libs/engine/spec/verify.py)
    prompt_rows: list | None = None  # prompt logprobs scored from this step's hidden states (libs/engine/prompt_logprobs.py)
    score_spans: tuple = ()  # their (first row, rows): every tensor-parallel rank runs the LM head on them
    # for the engine's bookkeeping after launch
    decode_rows: "slice | np.ndarray | None" = None
    new_decodes: list["Sequence"] | None = None

    @property
    def num_samples(self) -> int:
        return self.layout.samples


class StepBuilder:
    """Lays out steps from the persistent batch: the decode rows as whole-array slices,
    each prefill chunk with a few numpy calls, sampling parameters gathered by row."""

    def __init__(self, batch: "InputBatch", staging: StepStaging, block_size: int, vocab_size: int):
        self.batch = batch
        self.vocab_size = vocab_size
        self.staging = staging
        self.block_size = block_size
        self.decode_graph_sizes: list[int] = []  # set when decode graphs are captured
        self.prefill_graph_tokens: list[int] = []  # set when prefill graphs are captured
        self.graph_seqs = 0  # sequence capacity of the prefill graphs
        self.graph_width = 0  # block-table width of every graph
        self._aranged = np.arange(256, dtype=np.int64)

    def _arange(self, n: int) -> np.ndarray:
        if self._aranged.shape[0] < n:
            self._aranged = np.arange(2 * n, dtype=np.int64)
        return self._aranged[:n]

    def build(self, index: int, decode_rows: "slice | np.ndarray", num_decodes: int, chunks: list[Chunk]) -> Step:
        b, bs = self.batch, self.block_size
        nd = num_decodes
        if chunks:
            rows_p = np.asarray([c.seq.row for c in chunks], dtype=np.int64)
            n_p = np.asarray([c.num_tokens for c in chunks], dtype=np.int64)
            starts = np.asarray([c.start for c in chunks], dtype=np.int64)
            T = nd + int(n_p.sum())
        else:
            T = nd
        B = nd + len(chunks)
        # Sample rows: the decode rows, then each finishing chunk's row and its children's.
        tail_rows: list[int] = []
        tail_logits: list[int] = []
        ends = (nd + np.cumsum(n_p) - 1).tolist() if chunks else []
        num_verify = 0
        for c, end in zip(chunks, ends):
            if c.verify:  # a sample at every position
                tail_rows.extend([c.seq.row] * c.num_tokens)
                tail_logits.extend(range(end - c.num_tokens + 1, end + 1))
                num_verify += c.num_tokens
            elif c.num_samples:
                tail_rows.append(c.seq.row)
                tail_rows.extend(ch.row for ch in c.children)
                tail_logits.extend([end] * (1 + len(c.children)))
        S = nd + len(tail_rows)
        sample_rows = decode_rows if not tail_rows else np.concatenate([self._arange(b.num_rows)[decode_rows], np.asarray(tail_rows, dtype=np.int64)])

        pos_d = b.num_computed[decode_rows]
        seq_lens_d = pos_d + 1
        max_seq_len = max(int(seq_lens_d.max()) if nd else 0, int((starts + n_p).max()) if len(chunks) else 0)
        max_blocks = max(int(b.num_blocks[decode_rows].max()) if nd else 0, int(b.num_blocks[rows_p].max()) if len(chunks) else 0, 1)

        # Optional sampling inputs.
        seqs_all = b.seqs
        sample_seqs = seqs_all[:nd] if isinstance(decode_rows, slice) else [seqs_all[r] for r in decode_rows.tolist()]
        if tail_rows:
            sample_seqs = sample_seqs + [seqs_all[r] for r in tail_rows]
        bans: list[tuple[int, int]] = []
        adds: list[tuple[int, int, float]] = []
        if b.num_bias:
            adds, bans = bias_and_bans([s.params for s in sample_seqs], self.vocab_size)
        if b.num_min_tokens:
            # A verify chunk's position j samples the token after j accepted drafts.
            ahead = [0] * nd
            for c in chunks:
                ahead.extend(range(c.num_tokens) if c.verify else [0] * (bool(c.num_samples) * (1 + len(c.children))))
            for i, s in enumerate(sample_seqs):
                if b.num_tokens[s.row] - s.num_prompt_tokens + ahead[i] < s.params.min_tokens:
                    bans.extend((i, t) for t in sorted(s.stop_ids) if t < self.vocab_size)
        lp_samples: list[int] = []
        if b.num_logprobs:
            lp_samples = np.flatnonzero(b.logprobs[sample_rows] >= 0).tolist()
        # Path and capacities. A graph reads its inputs from the device packs only: a step
        # whose pack does not fit them (e.g. min_tokens banning thousands of stop ids) runs
        # eagerly, or the graph would replay the inputs of whatever step fitted last.
        extra = (S, len(bans), len(adds), len(lp_samples))
        path, layout = "eager", Layout(T, B, max_blocks, *extra)
        if not chunks and self.decode_graph_sizes and nd <= self.decode_graph_sizes[-1]:
            size = next(s for s in self.decode_graph_sizes if s >= nd)
            path, layout = "decode_graph", Layout(size, size, self.graph_width, *extra)
        elif chunks and self.prefill_graph_tokens and T <= self.prefill_graph_tokens[-1] and B <= self.graph_seqs:
            size = next(t for t in self.prefill_graph_tokens if t >= T)
            path, layout = "prefill_graph", Layout(size, self.graph_seqs, self.graph_width, *extra)
        if path != "eager" and not self.staging.fits_device(layout):
            path, layout = "eager", Layout(T, B, max_blocks, *extra)
        tokens, seqs, width = layout.tokens, layout.seqs, layout.width
        pack, v = self.staging.host(layout)

        # Decode rows.
        bt = b.block_table
        # (decode rows' input ids are gathered on the device from the last sampled tokens)
        v.positions[:nd] = pos_d
        row_ids = self._arange(b.num_rows)[decode_rows]
        v.slot_mapping[:nd] = bt[row_ids, pos_d // bs] * bs + pos_d % bs
        v.decode_slots[:nd] = b.slot[decode_rows]
        v.seq_lens[:nd] = seq_lens_d
        v.block_tables[:nd] = bt[decode_rows, :width]
        # Prefill rows.
        all_prefill = path == "prefill_graph"
        qsl = v.query_start_loc
        q0 = 0
        if all_prefill:  # decode rows are length-1 queries of the prefill kernel
            qsl[: nd + 1] = np.arange(nd + 1)
            q0 = nd
        else:
            qsl[0] = 0
        t = nd
        for j, c in enumerate(chunks):
            n, start, row = c.num_tokens, c.start, c.seq.row
            v.input_ids[t : t + n] = c.seq.token_ids[start : start + n] if c.token_ids is None else c.token_ids
            pos = np.arange(start, start + n)
            v.positions[t : t + n] = pos
            v.slot_mapping[t : t + n] = bt[row, pos // bs] * bs + pos % bs
            v.seq_lens[nd + j] = start + n
            v.block_tables[nd + j] = bt[row, :width]
            t += n
            qsl[(nd if all_prefill else 0) + j + 1] = t - (0 if all_prefill else nd)
        # Padding (graph layouts): tokens write nowhere, sequences attend to nothing.
        if tokens > T:
            v.input_ids[T:] = 0
            v.positions[T:] = 0
            v.slot_mapping[T:] = -1
        if seqs > B:
            v.decode_slots[nd:] = 0
            v.seq_lens[B:] = 0
            v.block_tables[B:] = 0
        num_q = (B if all_prefill else B - nd) + 1
        if num_q <= seqs:
            qsl[num_q:] = qsl[num_q - 1]
        # Samples.
        v.logits_indices[:nd] = self._arange(nd)
        v.logits_indices[nd:] = tail_logits
        v.sample_slots[:] = b.slot[sample_rows]
        # Parameters only the stages that run read (an all-greedy batch reads none).
        if b.num_random or b.num_penalized:
            v.sampling_params[:] = b.sampling_params[sample_rows].T
        if b.num_top_k:
            v.top_k[:] = b.top_k[sample_rows]
        if bans:
            v.ban_rows[:], v.ban_cols[:] = zip(*bans)
        if adds:
            v.bias_rows[:], v.bias_cols[:], v.bias_vals[:] = zip(*adds)
        step = Step(
            index, layout, pack, b.num_slots, path, nd, T, B, B - nd, max_seq_len, sample_seqs, chunks,
            all_greedy=b.num_random == 0, any_greedy=b.num_greedy > 0, any_top_k=b.num_top_k > 0,
            any_top_p=b.num_top_p > 0, any_min_p=b.num_min_p > 0, any_penalties=b.num_penalized > 0,
            any_repetition=b.num_repetition > 0, params=bool(b.num_random or b.num_penalized),
            num_verify_tokens=num_verify,
        )
        if lp_samples:
            v.logprob_rows[:] = lp_samples
            step.logprob_samples = lp_samples
            step.logprob_ks = b.logprobs[sample_rows][lp_samples].tolist()
            step.max_logprobs = max(step.logprob_ks)
        if b.num_seeded:
            step.generators = [(i, s.generator) for i, s in enumerate(sample_seqs) if s.generator is not None]
        return step
