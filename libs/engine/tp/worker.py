"""``python -m libs.engine.tp.worker``: one rank (1..N-1) of a tensor-parallel instance.

Started by rank 0 (libs/engine/tp/launch.py), never by hand. It builds the same engine as
rank 0 (``LLMEngine`` with ``join``: its shard of the weights, a cache of its KV heads,
the shared staging, the same CUDA graphs captured in the same order), then executes what
rank 0 sends until told to stop (libs/engine/tp/runner.py has the sending side):

- ``forward``: a step's plan and forward inputs (libs/engine/tp/runner.py), copied into
  this rank's step staging and run; the logits are rank 0's to sample, so they are dropped;
- ``graphs``: capture the same graphs as rank 0, now;
- ``copy``: block copies; ``scatter`` / ``gather``: its heads of staging rows into or out
  of its cache; ``sync``: wait for those copies, then meet the others at a barrier;
- ``stop``: leave.

Anything unexpected ends the process with an error; rank 0 notices (its watcher, or the
collective it is in failing) and takes the instance down.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys

import torch

from libs.engine.engine import LLMEngine
from libs.engine.tp.group import JoinInfo, TensorParallelGroup
from libs.engine.tp.launch import config_from_json
from libs.engine.tp.runner import ForwardPlan, receive_views

log = logging.getLogger("tidepool.tp")


def serve(engine: LLMEngine) -> int:
    """Execute rank 0's messages until ``stop``; the number of messages handled."""
    tp: TensorParallelGroup = engine.tp  # type: ignore[assignment]
    runner, swapper = engine.runner, engine.swapper
    handled = 0
    runner._bind()  # this rank's model writes this rank's cache
    with torch.inference_mode():
        while True:
            msg = tp.channel.recv()
            handled += 1
            a = msg.args
            if msg.op == "forward":
                plan = ForwardPlan.from_args(a)
                runner.forward_pass(plan, receive_views(runner.staging, plan.layout, msg.tensors))
            elif msg.op == "graphs":
                runner.enable_graphs(a["max_batch"], a["prefill_max_tokens"], a["prefill_seqs"], emulate=a["emulate"])
            elif msg.op == "copy":
                runner.copy_blocks([tuple(c) for c in a["copies"]])
            elif msg.op == "scatter":
                swapper.scatter_from(a["index"], a["ids"], first_row=a["first_row"])
            elif msg.op == "gather":
                swapper.gather_into(a["index"], a["ids"])
            elif msg.op == "sync":
                if engine.device.type == "cuda":
                    torch.cuda.current_stream(engine.device).synchronize()
                tp.barrier()
            elif msg.op == "stop":
                return handled
            else:
                raise RuntimeError(f"unknown tensor-parallel message {msg.op!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m libs.engine.tp.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--staging", required=True)
    parser.add_argument("--config", required=True, help="the instance's EngineConfig as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [tp rank {args.rank}] %(name)s: %(message)s", stream=sys.stderr)
    config = config_from_json(args.config)
    engine = LLMEngine(config, join=JoinInfo(args.rank, args.init_method, args.staging))
    # The model and its cache live as long as the process: out of the collector's full
    # scans, which would hold up this rank and with it every collective (the services do
    # the same at startup: services/common/gc_heap.py says why and what it measured).
    gc.collect()
    gc.freeze()
    try:
        n = serve(engine)
        log.info("stopped after %d messages", n)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
