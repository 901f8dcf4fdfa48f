"""Tensor-parallel replay: a group of ranks of ``torch.distributed``, launched by torchrun,
that replays golden sets on a model sharded with transformers' ``tp_plan``.

How it coexists with pytest (and ``pytest -n auto``): the process that runs a test (the
session, or each xdist worker) is the group's controller. On its first tensor-parallel
replay it starts ``torchrun --standalone --nproc-per-node N -m numalign.replay.tp_rank``
(the real launcher and rendezvous; gloo on CPU, nccl/xccl/hccl where the device provides
them; ``--tp-launcher`` replaces it with a launcher of several machines), and every rank
connects back to the controller over a socket authenticated with a random key per group
(calls and results travel pickled over it, between the controller and its own ranks only).
The group stays up for the controller's session: each replay is one call that every rank
runs (``numalign.replay.model.replay_on_rank``: the same replay functions as one process,
on the rank's shard of the model); rank 0's result comes back and the controller records
it. Workers never share a group: ``-n W --tp N`` runs W x N ranks.

Failures never hang the session: a rank that raises fails the call with its traceback; a
rank that dies, or a call that outlives the timeout, stops the whole group (its processes
are killed) and fails the call with the launcher's log; the next call starts a fresh group.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import pickle
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.core.errors import Crashed, Unsupported, UsageError

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from numalign.golden.store import GoldenSet
    from numalign.runtime.compiled import CompileStats
    from numalign.session.settings import Settings

#: Seconds the ranks may take to start (import torch and transformers, rendezvous) and
#: connect back.
START_TIMEOUT_S = 180.0
#: Seconds the controller waits, after a rank raised, to see whether another rank died
#: (a dead peer breaks the collectives of the living, which then raise).
DEATH_GRACE_S = 3.0
#: Lines of the launcher's log an error quotes.
LOG_LINES = 30
#: torch.distributed backends by device type.
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl", "npu": "hccl"}
AUTHKEY_ENV = "NUMALIGN_TP_AUTHKEY"
#: The address ranks connect back to, where the default (this machine's name for a
#: --tp-launcher, loopback otherwise) does not reach it.
HOST_ENV = "NUMALIGN_TP_HOST"


def send(connection: Connection, message: Any) -> None:
    """``message`` to the other end, by value: plain pickle, not multiprocessing's, which
    torch teaches to pass tensors as shared-memory handles the other process cannot open."""
    connection.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(connection: Connection) -> Any:
    return pickle.loads(connection.recv_bytes())


class TensorParallelError(Crashed, RuntimeError):
    """A tensor-parallel replay that did not return: ``crashed`` when a rank died or hung
    (the group was stopped), else a rank raised."""

    crashed = False


class RankFailed(TensorParallelError):
    """A rank raised; the message holds its traceback."""


class RankCrashed(TensorParallelError):
    """A rank died, or the group did not start."""

    crashed = True


class RankTimeout(TensorParallelError):
    """A rank did not answer within the timeout (a hang, or a deadlocked collective)."""

    crashed = True


class TensorParallelUsageError(UsageError, ValueError):
    """The model cannot be split over the asked-for number of ranks."""


class NoTensorParallelPlan(Unsupported, RuntimeError):
    """transformers has no tensor-parallel plan for the model: it is replayed on one process
    only (the model suites skip it with this reason)."""


@dataclass
class RankState:
    """What a rank of a group holds (``numalign.replay.tp_rank`` fills it): the session's
    settings and its model cache (a ``ModelCache`` that loads shards)."""

    settings: Settings | None = None
    cache: Any = None

    def golden(self, path: str) -> GoldenSet:
        """The set at ``path``, opened once per manifest version (``GoldenSet.open_shared``;
        the controller checks it fresh before every call, the set verifies its shards as it
        reads them)."""
        from numalign.golden.store import GoldenSet

        return GoldenSet.open_shared(path)


#: This process's rank state (empty outside a rank).
RANK = RankState()


def rank_device() -> torch.device:
    """This rank's device: the session's device type, indexed by the local rank."""
    import torch

    from numalign.runtime.devices import resolve_device

    if RANK.settings is None:
        raise RuntimeError("rank_device() is for the ranks of a tensor-parallel group")
    kind = resolve_device(RANK.settings.device).type
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cpu") if kind == "cpu" else torch.device(kind, local)


@functools.lru_cache(maxsize=64)
def check_shardable(model_dir: str | Path, ranks: int) -> None:
    """That transformers has a tensor-parallel plan for the model and that its attention
    heads, key/value heads and experts divide by ``ranks``: NoTensorParallelPlan (the suites
    skip) for a model without a plan, TensorParallelUsageError naming the numbers otherwise."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "base_model_tp_plan", None):
        arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
        raise NoTensorParallelPlan(
            f"transformers has no tensor-parallel plan (base_model_tp_plan) for {arch}: it "
            "replays on one process only"
        )
    counts = {
        "attention heads (num_attention_heads)": getattr(text, "num_attention_heads", None),
        "key/value heads (num_key_value_heads)": getattr(text, "num_key_value_heads", None),
    }
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(text, name, None):
            counts[f"experts ({name})"] = getattr(text, name)
            break
    wrong = [f"{n} {what}" for what, n in counts.items() if n and int(n) % ranks]
    if wrong:
        raise TensorParallelUsageError(
            f"{Path(model_dir).name} cannot be split over --tp {ranks} ranks: its "
            f"{', '.join(wrong)} do not divide by {ranks}; choose a --tp that divides them"
        )


@dataclass
class RankGroup:
    """N ranks under torchrun, serving calls from this process (see the module's doc)."""

    size: int
    settings: Settings
    timeout: float
    process: subprocess.Popen[bytes] | None = None
    ranks: list[Connection] = field(default_factory=list)
    log: Path | None = None
    #: the ranks' process ids, as they said on connecting (this machine's ranks only: a
    #: --tp-launcher's may run elsewhere)
    pids: list[int] = field(default_factory=list)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on every rank (``fn`` importable by name, arguments picklable);
        rank 0's result. A failure stops the group; the next call starts a fresh one."""
        return self.call_all(fn, *args)[0]

    def call_all(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(*args)`` on every rank, as :meth:`call`; every rank's result, in rank
        order."""
        if self.process is None or self.process.poll() is not None:
            self.start()
        try:
            for rank in self.ranks:
                send(rank, (fn, args))
            return self._answers(time.monotonic() + self.timeout)
        except TensorParallelError:
            self.close()
            raise
        except (OSError, EOFError) as exc:
            message = f"the tensor-parallel group went away: {exc}{self._log()}"
            self.close()
            raise RankCrashed(message) from None

    def start(self) -> None:
        self.close()
        authkey = secrets.token_bytes(16)
        launcher = self.settings.tp_launcher
        # ranks on this machine connect over loopback; a launcher's may run elsewhere
        bind = "0.0.0.0" if launcher else "127.0.0.1"
        listener = Listener((bind, 0), authkey=authkey)
        handle, log = tempfile.mkstemp(prefix="numalign-tp-", suffix=".log")
        self.log = Path(log)
        env = dict(os.environ)
        env[AUTHKEY_ENV] = authkey.hex()
        env.setdefault("OMP_NUM_THREADS", "1")
        # the ranks import what this process can (plugins, candidates, test helpers)
        paths = [p for p in sys.path if p]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).strip(os.pathsep)
        port = listener.address[1]
        host = os.environ.get(HOST_ENV) or (socket.getfqdn() if launcher else "127.0.0.1")
        start = shlex.split(launcher) if launcher else [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={self.size}",
        ]  # fmt: skip
        command = [*start, "-m", "numalign.replay.tp_rank", "--connect", f"{host}:{port}"]
        with os.fdopen(handle, "wb") as out:
            try:
                self.process = subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            except OSError as exc:
                listener.close()
                self.close()
                raise TensorParallelUsageError(
                    f"the tensor-parallel launcher {command[0]!r} cannot start: {exc}; check "
                    "--tp-launcher"
                ) from None
        _GROUPS.append(self)
        try:
            self.ranks = self._accept(listener)
            for rank in self.ranks:
                send(rank, self.settings)
        finally:
            listener.close()

    def _accept(self, listener: Listener) -> list[Connection]:
        """The ranks' connections in rank order; RankCrashed when the group did not come up
        within START_TIMEOUT_S."""
        accepted: dict[int, Connection] = {}
        wrong: list[int] = []

        def accept_all() -> None:
            try:
                while len(accepted) < self.size:
                    connection = listener.accept()
                    rank, world, pid = receive(connection)
                    if int(world) != self.size:
                        wrong.append(int(world))
                        return
                    accepted[int(rank)] = connection
                    if not self.settings.tp_launcher:
                        self.pids.append(int(pid))
            except (OSError, EOFError):  # the listener closed on a timeout
                return

        thread = threading.Thread(target=accept_all, daemon=True)
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while thread.is_alive() and time.monotonic() < deadline:
            thread.join(0.2)
            if self.process is not None and self.process.poll() is not None:
                break
        if wrong:
            listener.close()
            self.close()
            raise TensorParallelUsageError(
                f"the tensor-parallel launcher started {wrong[0]} ranks where --tp asks for "
                f"{self.size}: make its process count (nodes x processes per node) {self.size}"
            )
        if len(accepted) < self.size:
            listener.close()
            message = (
                f"the tensor-parallel group of {self.size} ranks did not start ({len(accepted)} "
                f"connected within {START_TIMEOUT_S:.0f} s){self._log()}"
            )
            self.close()
            raise RankCrashed(message)
        return [accepted[r] for r in range(self.size)]

    def _answers(self, deadline: float) -> list[Any]:
        """Every rank's answer, in rank order. A rank's error is raised as soon as it
        arrives (the others may be waiting for it in a collective)."""
        pending = {connection: rank for rank, connection in enumerate(self.ranks)}
        results: list[Any] = [None] * len(self.ranks)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankTimeout(
                    f"rank {', '.join(map(str, sorted(pending.values())))} of {self.size} did not "
                    f"answer within --tp-timeout {self.timeout:g} s (a hang or a deadlocked "
                    f"collective); the group was stopped{self._log()}"
                )
            for connection in wait(list(pending), timeout=min(left, 1.0)):
                rank = pending.pop(connection)  # type: ignore[call-overload]
                try:
                    kind, value = receive(connection)  # type: ignore[arg-type]
                except (EOFError, OSError):
                    raise RankCrashed(
                        f"rank {rank} of {self.size} died during the replay (exit status "
                        f"{self._status()}){self._log()}"
                    ) from None
                if kind == "raised":  # numalign's own error: its kind decides, as on one rank
                    if not self._drained(pending):
                        self.close()  # a rank still busy, or dead: the next call starts afresh
                    raise value
                if kind == "error":
                    dead = self._dead(pending)
                    if dead is not None:  # its peers' collectives broke because it died
                        raise RankCrashed(
                            f"rank {dead} of {self.size} died during the replay (exit status "
                            f"{self._status()}); rank {rank} then raised: {value}{self._log()}"
                        )
                    raise RankFailed(f"rank {rank} of {self.size} raised: {value}")
                results[rank] = value
            if self.process is not None and self.process.poll() is not None and pending:
                raise RankCrashed(
                    f"the tensor-parallel launcher exited (status {self.process.returncode}) "
                    f"before rank {', '.join(map(str, sorted(pending.values())))} answered"
                    f"{self._log()}"
                )
        return results

    def _drained(self, pending: dict[Connection, int]) -> bool:
        """Whether every ``pending`` rank answers within the grace of :data:`DEATH_GRACE_S`
        (their answers dropped): the group is then idle and serves the next call."""
        left = dict(pending)
        deadline = time.monotonic() + DEATH_GRACE_S
        while left and (wait_s := deadline - time.monotonic()) > 0:
            for connection in wait(list(left), timeout=wait_s):
                left.pop(connection)  # type: ignore[call-overload]
                try:
                    receive(connection)  # type: ignore[arg-type]
                except (EOFError, OSError):
                    return False
        return not left

    def _dead(self, pending: dict[Connection, int]) -> int | None:
        """The first of the ``pending`` ranks whose connection closes within a grace of a
        few seconds (a rank that died), or None: they are alive (waiting, or still busy)."""
        for connection in wait(list(pending), timeout=DEATH_GRACE_S):
            try:
                receive(connection)  # type: ignore[arg-type]
            except (EOFError, OSError):
                return pending[connection]  # type: ignore[index]
        return None

    def _status(self) -> str:
        if self.process is None:
            return "unknown"
        try:
            return str(self.process.wait(timeout=10))
        except subprocess.TimeoutExpired:
            return "still running"

    def _log(self) -> str:
        if self.log is None or not self.log.exists():
            return ""
        lines = self.log.read_text(errors="replace").splitlines()[-LOG_LINES:]
        return "\nlast lines of the ranks' log:\n" + "\n".join(lines)

    def close(self) -> None:
        """Stops the ranks (asks them to finish, then kills what is left)."""
        for rank in self.ranks:
            try:
                send(rank, None)
                rank.close()
            except OSError:
                pass
        self.ranks = []
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        _reap(self.pids)  # torchrun starts each rank in a session of its own
        self.pids = []
        if self.log is not None:
            self.log.unlink(missing_ok=True)
            self.log = None
        if self in _GROUPS:
            _GROUPS.remove(self)


def _reap(pids: list[int], grace_s: float = 5.0) -> None:
    """Kills the ranks among ``pids`` still running after ``grace_s`` seconds (their
    launcher stopped them, or they finish on their own meanwhile)."""
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _running(pid):
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs and is a rank (a zombie does not run; a reused id is another
    program's, left alone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X") and b"numalign.replay.tp_rank" in command


_GROUPS: list[RankGroup] = []


@atexit.register
def _close_all() -> None:
    for group in list(_GROUPS):
        group.close()


@dataclass(frozen=True)
class RankAnswer:
    """What a rank returns from a replay: its result, which only rank 0 sends back (the
    others' is rank 0's: the ranks merge their judgements), and what compiling cost this
    rank in it (``--compile``; None: nothing compiled), which every rank sends."""

    result: Any
    compile_stats: CompileStats | None = None


def from_other_rank(value: Any) -> Any:
    """What a rank other than 0 sends back of a call's value: a replay's compile cost
    alone, nothing of anything else."""
    return RankAnswer(None, value.compile_stats) if isinstance(value, RankAnswer) else None


@dataclass
class ShardedModel:
    """The controller's handle on a model the ranks of ``group`` hold, sharded: what
    ``ModelCache.load`` returns under ``--tp N``; ``ModelCache.run`` sends replays to it.
    ``compile_stats``: what compiling cost on the ranks (``--compile``), until a test takes
    it (``runtime.compiled_model.take_stats``)."""

    group: RankGroup
    path: str
    dtype: str
    compile_stats: CompileStats | None = None
