"""Calls the tensor-parallel group tests send to their ranks (importable there by name)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from numalign.replay.shards import whole


def rank_and_sum() -> tuple[int, int, float]:
    """This rank, the number of ranks, and the sum over ranks of rank + 1 (an all-reduce)."""
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), float(value)


def gathered_shards() -> torch.Tensor:
    """Each rank holds columns [2r, 2r + 2) of a 3 x 4 tensor; ``whole`` gathers them."""
    full = torch.arange(12.0).reshape(3, 4)
    rank = dist.get_rank()
    return whole(full[:, 2 * rank : 2 * rank + 2], (3, 4))


def raise_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1's kernel rejected its shard")
    dist.barrier()  # rank 0 waits for rank 1, as in a collective


def unsupported_on_every_rank() -> None:
    """numalign's own error, raised alike on every rank (an uncalibrated point, a path a
    model cannot take), after a collective."""
    from numalign.replay.pipeline_split import PipelineUnsupported

    dist.barrier()
    raise PipelineUnsupported(f"rank {dist.get_rank()} cannot take this path")


def unsupported_on_rank_1() -> None:
    """numalign's own error on rank 1 alone, rank 0 waiting for it in a collective."""
    from numalign.replay.pipeline_split import PipelineUnsupported

    if dist.get_rank() == 1:
        raise PipelineUnsupported("rank 1 cannot take this path")
    dist.barrier()


def die_on_rank_1() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def hang_on_rank_1() -> None:
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.barrier()


def rank_pids() -> list[int]:
    """Every rank's process id, in rank order (an all-gather)."""
    pids: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    return [int(p) for p in pids]  # type: ignore[call-overload]


def linger_on_rank_1() -> None:
    """Rank 1 keeps a thread that never ends and ignores SIGTERM: asked to stop, it finishes
    its loop but its interpreter never exits (a stuck kernel thread, a hung destroy)."""
    import signal
    import threading

    if dist.get_rank() == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()


def streamed_shard_bytes(model_dir: str) -> tuple[int, int, list[str]]:
    """tiny-llama streamed on this rank with transformers' tensor-parallel plan: the most
    parameter bytes it held at once over one forward, the local rows of a column-parallel
    projection, and what stays resident after the forward."""
    from numalign.golden.stream import load_streamed

    model = load_streamed(model_dir, "float32", "cpu", tensor_parallel=True)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 17, 42, 9, 3, 77, 8, 2]]))
    streamer = model.numalign_streamer
    streamer.enter("model.layers.0")
    rows = streamer.model.get_parameter("model.layers.0.self_attn.q_proj.weight").to_local()
    streamer.exit("model.layers.0")
    return streamer.peak_bytes, rows.shape[0], streamer.resident()
