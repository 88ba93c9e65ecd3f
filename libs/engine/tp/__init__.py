"""Tensor parallelism inside one instance: N processes, one engine.

| module | concept |
|---|---|
| ``launch.py`` | rank 0 starts ranks 1..N-1 as processes and watches them |
| ``group.py`` | ``TensorParallelGroup``: joining, start-up agreements, shared staging, barrier, failure |
| ``runner.py`` | rank 0's runner: sends each step's plan (and block moves) before running it |
| ``worker.py`` | ranks 1..N-1: execute what rank 0 sends (``python -m libs.engine.tp.worker``) |

The model's split is libs/model/parallel.py; process groups and the message channel are
libs/dist. docs/TENSOR_PARALLEL.md has the design.
"""
