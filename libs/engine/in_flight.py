"""Steps in flight: launched on the device queue, their sampled ids not yet read.

With async scheduling (``EngineConfig.async_scheduling``) the engine launches step N + 1
before it reads step N, so the host has to lay out N + 1 from what it *expects* N to
have done. ``InFlight.launch`` keeps that expectation: right after a step is submitted,
``advance`` moves the persistent batch on as if the step had run (KV computed, one token
in flight per sampled row), prompts that reached their end start decoding, ``n > 1``
siblings attach to their parent's blocks, and (async) sequences that reached their
length limit are retired at launch, never scheduled again (vLLM v1's async scheduling
makes the same one-step-late corrections). Without async scheduling a step is read
right after its launch and at most one is ever in flight.

When a step's device work raises, ``drain`` hands back every step that will not come
back (the failed one first), so the engine can abort their requests.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable

import numpy as np

from libs.engine.device_queue import Pending
from libs.engine.step_inputs import Step

if TYPE_CHECKING:
    from libs.engine.forks import Forks
    from libs.engine.input_batch import InputBatch
    from libs.engine.scheduler import Scheduler


class InFlight:
    """The launched steps, oldest first, and the batch's bookkeeping at launch."""

    def __init__(self, batch: "InputBatch", scheduler: "Scheduler", forks: "Forks", *, async_scheduling: bool, on_copy: Callable[[tuple[int, int]], None]):
        """``on_copy``: a fork's block copy, to run before the next step's forward (after
        this step has written the parent's last block)."""
        self.batch, self.scheduler, self.forks = batch, scheduler, forks
        self.async_scheduling = async_scheduling
        self.on_copy = on_copy
        self.steps: deque[tuple[Step, Pending]] = deque()
        self.num_prompt_tokens_computed = 0

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def newest(self) -> Step | None:
        return self.steps[-1][0] if self.steps else None

    def launch(self, step: Step, pending: Pending) -> None:
        """``step`` was submitted: remember it, and advance the batch past it."""
        self.steps.append((step, pending))
        self.advance(step)

    def pop(self) -> tuple[Step, Pending]:
        """The oldest step in flight (the next to read)."""
        return self.steps.popleft()

    def advance(self, step: Step) -> None:
        """Right after launch: the batch as if ``step`` had run (KV computed, one token in
        flight per sampled row), prompts that reached their end start decoding, forks
        attach, and (async) sequences at their length limit retire."""
        b, sched = self.batch, self.scheduler
        rows = step.decode_rows
        b.num_computed[rows] += 1
        b.num_tokens[rows] += 1
        for seq in step.new_decodes or ():
            sched.start_decoding(seq)
        for c in step.chunks:
            if c.verify:  # its computed tokens are known once its burst is read (settle)
                continue
            seq = c.seq
            b.num_computed[seq.row] += c.num_tokens
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                self.num_prompt_tokens_computed += c.num_tokens
            if not c.num_samples:
                continue
            b.num_tokens[seq.row] += 1
            b.to_decode(seq)
            sched.start_decoding(seq)
            for child in c.children:
                b.num_tokens[child.row] += 1
                attached, copy = self.forks.attach(seq, child)
                if not attached:  # no block for it now: it recomputes its prompt later
                    b.remove(child)
                    continue
                if copy is not None:
                    self.on_copy(copy)
                b.sync_blocks(child)
                b.to_decode(child)
                sched.start_decoding(child)
        if self.async_scheduling:
            nd = b.num_decodes
            for r in np.flatnonzero(b.num_tokens[:nd] >= b.max_len[:nd])[::-1].tolist():
                seq = b.seqs[r]
                sched.retire(seq)
                b.remove(seq)

    def drain(self, failed: Step) -> list[Step]:
        """``failed``'s device work raised: wait out the steps launched after it (their
        errors are dropped; the first one is the one raised) and return all of them."""
        steps = [failed]
        while self.steps:
            step, pending = self.steps.popleft()
            steps.append(step)
            try:
                pending.result()
            except BaseException:  # noqa: BLE001 - the first error is the one raised
                pass
        return steps
