"""The one-shot all-reduce's choices on the CPU (libs/dist/one_shot.py): which tensors it
takes, that it is refused without CUDA, and what the TP group's all-reduce does with each
``all_reduce`` setting over gloo. Its sums are tested against NCCL on two GPUs
(tests/gpu/test_tp_gpu.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from libs.dist.one_shot import fits, unavailable_reason
from libs.engine import EngineConfig
from services.launch.processes import free_port
from tests.ranks import start_rank


def test_fits_small_contiguous_bf16_and_fp32_only():
    assert fits(torch.zeros(4, 384, dtype=torch.bfloat16), 1 << 20)
    assert fits(torch.zeros(4, 384), 1 << 20)
    assert not fits(torch.zeros(4, 384, dtype=torch.float16), 1 << 20)  # the kernel has bf16 and fp32
    assert not fits(torch.zeros(1024, 512), 1 << 20)  # 2 MiB: NCCL's
    assert fits(torch.zeros(512, 512), 1 << 20)  # exactly the buffer
    assert not fits(torch.zeros(3, dtype=torch.bfloat16), 1 << 20)  # 6 bytes: not whole 16-byte vectors
    assert not fits(torch.zeros(384, 4).t(), 1 << 20)  # not contiguous
    assert not fits(torch.zeros(385)[1:], 1 << 20)  # misaligned start
    assert not fits(torch.zeros(0), 1 << 20)


def test_unavailable_without_cuda():
    assert "CUDA" in unavailable_reason(torch.device("cpu"))


def test_config_names_the_choices():
    with pytest.raises(ValueError, match="tp_all_reduce must be auto, one_shot or nccl"):
        EngineConfig(tp_all_reduce="custom")
    with pytest.raises(ValueError, match="one_shot needs CUDA devices"):
        EngineConfig(device="cpu", tensor_parallel_size=2, tp_all_reduce="one_shot")
    assert EngineConfig(device="cpu", tp_all_reduce="one_shot").tensor_parallel_size == 1  # one rank: nothing to sum


@pytest.mark.parametrize("flag, value", [([], "auto"), (["--tp-all-reduce", "nccl"], "nccl"), (["--tp-all-reduce", "one_shot"], "one_shot")])
def test_the_worker_flag_reaches_the_engine(flag, value):
    from services.common.settings import parse_settings
    from services.worker.runtime import engine_config
    from services.worker.settings import WorkerSettings

    assert engine_config(parse_settings(WorkerSettings, flag), "decode").tp_all_reduce == value
    with pytest.raises(SystemExit):
        parse_settings(WorkerSettings, ["--tp-all-reduce", "custom"])


def group_worker(rank: int, world: int, port: int, out_dir: str, mode: str) -> None:
    start_rank(rank, "cpu")
    from libs.dist import ParallelLayout, init_parallel, shutdown_parallel

    result: dict = {}
    try:
        groups = init_parallel(ParallelLayout(world_size=world, tp_size=world), rank=rank, init_method=f"tcp://127.0.0.1:{port}",
                               timeout_s=30, all_reduce=mode)
        result["one_shot"] = groups.tp.one_shot is not None
        x = torch.full((2, 8), float(rank + 1))
        result["sum"] = groups.tp.all_reduce(x)
        result["in_place"] = result["sum"].data_ptr() == x.data_ptr()
    except RuntimeError as e:
        result["error"] = str(e)
    finally:
        shutdown_parallel()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.parametrize("mode", ["auto", "nccl", "one_shot"])
def test_group_all_reduce_by_setting(tmp_path, mode):
    """``auto`` and ``nccl`` sum over gloo on the CPU; ``one_shot`` is refused on every
    rank alike (they agree first), with the reason, instead of one rank waiting."""
    mp.spawn(group_worker, args=(2, free_port(), str(tmp_path), mode), nprocs=2, join=True)
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        if mode == "one_shot":
            assert r == {"error": "the one-shot all-reduce is not available: needs CUDA (the device is cpu)"}
        else:
            assert not r["one_shot"] and r["in_place"]
            assert torch.equal(r["sum"], torch.full((2, 8), 3.0))
