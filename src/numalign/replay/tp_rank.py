"""One rank of a tensor-parallel replay group (``numalign.replay.tensor_parallel``), started
by torchrun: ``python -m torch.distributed.run --nproc-per-node N -m numalign.replay.tp_rank
--connect HOST:PORT``.

It joins the process group (gloo on CPU, the device's backend elsewhere), connects back to
the controller with the key in ``$NUMALIGN_TP_AUTHKEY``, receives the session's settings
(and imports its ``--device-plugin`` and ``--candidates`` modules), then runs every call the
controller sends until it sends None: each call's result (rank 0's) or the error with its
traceback goes back.
"""

from __future__ import annotations

import argparse
import importlib
import os
import threading
import time
import traceback
from multiprocessing.connection import Client
from typing import TYPE_CHECKING, Any

from numalign.replay.tensor_parallel import (
    AUTHKEY_ENV,
    BACKENDS,
    RANK,
    from_other_rank,
    rank_device,
    receive,
    send,
)

if TYPE_CHECKING:
    from numalign.session.settings import Settings


def _serve(connection: Any, rank: int) -> None:
    while True:
        try:
            message = receive(connection)
        except (EOFError, OSError):  # the controller is gone: nothing to clean up for it
            os._exit(1)
        if message is None:
            return
        fn, args = message
        try:
            value = fn(*args)
            send(connection, ("ok", value if rank == 0 else from_other_rank(value)))
        except BaseException as exc:  # every failure goes back to the controller
            if _rebuilds(exc):  # numalign's own: the test's outcome follows its kind
                try:
                    send(connection, ("raised", exc))  # pickled whole before any byte goes
                    continue
                except Exception:  # an argument that does not pickle: its text goes instead
                    pass
            text = "".join(traceback.format_exception(exc))
            send(connection, ("error", f"{type(exc).__name__}: {exc}\n{text}"))
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise


def _rebuilds(exc: BaseException) -> bool:
    """Whether ``exc`` goes back to the controller as itself: one of numalign's errors (a
    set not calibrated, a path not supported, a usage error) that its arguments rebuild, as
    the controller's unpickling does; any other goes back as its traceback's text."""
    from numalign.core.errors import NumalignError

    if not isinstance(exc, NumalignError):
        return False
    try:
        type(exc)(*exc.args)
    except Exception:  # a class whose constructor takes other arguments than it keeps
        return False
    return True


def _exit_with_launcher() -> None:
    """Ends this rank when its launcher dies (it is then reparented): a rank stuck in a
    collective or a thread never outlives its group."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="numalign-tp-watchdog").start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--connect", required=True, metavar="HOST:PORT")
    options = parser.parse_args(argv)
    host, _, port = options.connect.rpartition(":")

    import torch
    import torch.distributed as dist

    from numalign.ops.registry import load_candidate_modules
    from numalign.replay.model import ModelCache

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank = int(os.environ["RANK"])
    connection = Client((host, int(port)), authkey=bytes.fromhex(os.environ[AUTHKEY_ENV]))
    send(connection, (rank, int(os.environ["WORLD_SIZE"]), os.getpid()))
    _exit_with_launcher()
    settings: Settings = receive(connection)
    for name in settings.device_plugins:
        importlib.import_module(name)
    # the candidates a --swap names register where the swap runs: on every rank
    load_candidate_modules(settings.candidate_modules)
    RANK.settings, RANK.cache = settings, ModelCache(sharded=True)
    device = rank_device()
    if device.type != "cpu":
        getattr(torch, device.type).set_device(device)
    dist.init_process_group(BACKENDS.get(device.type, "gloo"))
    _serve(connection, rank)
    dist.destroy_process_group()  # not after a failure: a dead peer would hang it
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
