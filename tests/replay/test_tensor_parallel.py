"""The tensor-parallel group (``numalign.replay.tensor_parallel``) on two real gloo ranks
under torchrun: calls run on every rank and rank 0 answers, shards gather whole, and a rank
that raises, dies or hangs fails the call with the rank's error within the timeout, after
which the next call starts a fresh group. What cannot be split is refused before any rank
starts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import tp_calls

from numalign.replay.shards import whole
from numalign.replay.tensor_parallel import (
    NoTensorParallelPlan,
    RankCrashed,
    RankFailed,
    RankGroup,
    RankTimeout,
    TensorParallelUsageError,
    check_shardable,
)
from numalign.session.settings import Settings

ZOO = Path(__file__).resolve().parents[2] / "golden" / "models"
#: Seconds a call may run in the hang test: rank 1 never answers, so the call times out at
#: any limit; 5 s keeps the test quick (the limit is not what the test measures).
HANG_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def group() -> RankGroup:
    group = RankGroup(2, Settings(device="cpu"), timeout=120.0)
    yield group
    group.close()


def test_a_streamed_rank_holds_its_shard_of_each_unit_alone(group: RankGroup) -> None:
    from numalign.golden.stream import load_streamed

    peak, rows, resident = group.call(tp_calls.streamed_shard_bytes, str(ZOO / "tiny-llama"))
    whole_model = load_streamed(ZOO / "tiny-llama", "float32", "cpu")
    with torch.no_grad():
        whole_model(input_ids=torch.tensor([[5, 17, 42, 9, 3, 77, 8, 2]]))
    unsharded = whole_model.numalign_streamer.peak_bytes
    # the projections are split in two, the norms (a few hundred bytes) replicated: a rank's
    # largest unit is a little over half the unsharded one's, never more than 0.6 of it
    assert unsharded / 2 <= peak <= 0.6 * unsharded, (peak, unsharded)
    assert rows == whole_model.config.hidden_size // 2  # q_proj's rows, split by column
    assert resident == []


def test_calls_run_on_every_rank_and_rank_0_answers(group: RankGroup) -> None:
    # ranks 0 and 1 contribute 1 + 2 = 3 to the all-reduce
    assert group.call(tp_calls.rank_and_sum) == (0, 2, 3.0)
    assert torch.equal(group.call(tp_calls.gathered_shards), torch.arange(12.0).reshape(3, 4))


def test_a_rank_that_raises_fails_the_call_with_its_error(group: RankGroup) -> None:
    with pytest.raises(RankFailed, match=r"rank 1 of 2 raised: ValueError: rank 1's kernel"):
        group.call(tp_calls.raise_on_rank_1)
    assert group.process is None  # stopped: rank 0 was waiting in a collective
    assert group.call(tp_calls.rank_and_sum) == (0, 2, 3.0)  # a fresh group


def test_numalign_s_own_errors_reach_the_test_as_themselves(group: RankGroup) -> None:
    from numalign.core.errors import Unsupported

    pids = group.call(tp_calls.rank_pids)
    # raised on every rank: the test skips as on one process, and the group, idle, goes on
    with pytest.raises(Unsupported, match=r"rank \d cannot take this path"):
        group.call(tp_calls.unsupported_on_every_rank)
    assert group.call(tp_calls.rank_pids) == pids
    # raised on rank 1 alone while rank 0 waits in a collective: the same error, and the
    # group is stopped (rank 0 would wait forever); the next call starts a fresh one
    with pytest.raises(Unsupported, match="rank 1 cannot take this path"):
        group.call(tp_calls.unsupported_on_rank_1)
    assert group.process is None
    assert group.call(tp_calls.rank_and_sum) == (0, 2, 3.0)


def test_a_rank_that_dies_is_a_crash(group: RankGroup) -> None:
    with pytest.raises(RankCrashed, match=r"rank 1 of 2 died|launcher exited") as caught:
        group.call(tp_calls.die_on_rank_1)
    assert caught.value.crashed
    assert group.call(tp_calls.rank_and_sum) == (0, 2, 3.0)


def test_a_rank_that_hangs_is_stopped_at_the_timeout(group: RankGroup) -> None:
    group.call(tp_calls.rank_and_sum)  # started, so the timeout covers the call alone
    group.timeout = HANG_TIMEOUT_S
    try:
        began = time.monotonic()
        with pytest.raises(RankTimeout, match=r"did not answer within --tp-timeout 5 s"):
            group.call(tp_calls.hang_on_rank_1)
        # bounded: the timeout plus the few seconds stopping the group takes, not the hour
        # the rank sleeps
        assert time.monotonic() - began < HANG_TIMEOUT_S + 60
    finally:
        group.timeout = 120.0
    assert group.call(tp_calls.rank_and_sum) == (0, 2, 3.0)


def test_whole_leaves_a_tensor_alone_outside_a_group() -> None:
    shard = torch.ones(3, 2)
    assert whole(shard, (3, 4)) is shard  # no process group: nothing to gather from


def test_a_model_without_a_plan_is_skipped_with_the_reason() -> None:
    with pytest.raises(NoTensorParallelPlan, match=r"no tensor-parallel plan .* GPT2LMHeadModel"):
        check_shardable(ZOO / "tiny-gpt2", 2)


def test_heads_that_do_not_divide_are_a_usage_error_naming_the_numbers() -> None:
    check_shardable(ZOO / "tiny-llama", 2)  # 4 heads, 2 key/value heads
    with pytest.raises(
        TensorParallelUsageError,
        match=r"tiny-llama cannot be split over --tp 3 ranks: its 4 attention heads .*, "
        r"2 key/value heads .* do not divide by 3",
    ):
        check_shardable(ZOO / "tiny-llama", 3)
    with pytest.raises(TensorParallelUsageError, match=r", 8 experts \(num_experts\) do not"):
        check_shardable(ZOO / "tiny-qwen3-moe", 3)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_launcher_of_its_own_starts_the_ranks() -> None:
    """--tp-launcher: the command of a multi-machine launch (c10d rendezvous at an endpoint,
    as torchrun runs on each node), here with one node of two processes."""
    import sys

    torchrun = f"{sys.executable} -m torch.distributed.run --nnodes 1 --rdzv-backend c10d"
    endpoint = f"--rdzv-endpoint 127.0.0.1:{free_port()}"
    settings = Settings(device="cpu", tp_launcher=f"{torchrun} --nproc-per-node 2 {endpoint}")
    group = RankGroup(2, settings, timeout=120.0)
    try:
        assert group.call(tp_calls.rank_and_sum) == (0, 2, 3.0)
    finally:
        group.close()
    # a launcher that starts another number of ranks than --tp is a usage error
    settings = Settings(device="cpu", tp_launcher=f"{torchrun} --nproc-per-node 1 {endpoint}")
    with pytest.raises(TensorParallelUsageError, match="started 1 ranks where --tp asks for 2"):
        RankGroup(2, settings, timeout=120.0).call(tp_calls.rank_and_sum)


def test_a_launcher_that_is_not_there_says_so() -> None:
    settings = Settings(device="cpu", tp_launcher="/nonexistent/srun -N2 torchrun")
    with pytest.raises(TensorParallelUsageError, match="'/nonexistent/srun' cannot start"):
        RankGroup(2, settings, timeout=10.0).call(tp_calls.rank_and_sum)


#: Seconds the ranks of a stopped group may take to be gone: the controller's grace before it
#: kills them (5 s) and a loaded 2-core machine's scheduling.
REAP_S = 30.0


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + REAP_S
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(_alive(p) for p in pids)


def test_no_rank_outlives_a_rank_s_death_or_the_group(group: RankGroup) -> None:
    """Issue 27, item 12: after a test killed a rank, its peer (waiting in a collective) was
    alive 37 minutes later."""
    pids = group.call(tp_calls.rank_pids)
    assert len(pids) == 2
    with pytest.raises(RankCrashed):
        group.call(tp_calls.die_on_rank_1)
    assert _gone(pids), [p for p in pids if _alive(p)]
    pids = group.call(tp_calls.rank_pids)  # a fresh group, stopped at the session's end
    group.close()
    assert _gone(pids), [p for p in pids if _alive(p)]
    pids = group.call(tp_calls.rank_pids)
    group.call(tp_calls.linger_on_rank_1)  # a rank that does not exit when asked
    group.close()
    assert _gone(pids), [p for p in pids if _alive(p)]
