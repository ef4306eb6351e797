"""A pool of local gloo ranks, started once and reused across many calls.

Multi-rank tests and scripts need N processes that each joined one
``torch.distributed`` process group. Starting them per check costs time
(each joins gloo; a spawned one imports torch too), so a
:class:`RankPool` starts its workers on the first call and keeps them:
each :meth:`RankPool.run` ships ``(fn, args, kwargs)`` to every rank over
a pipe and gathers the per-rank results.

Contract:

- ``fn`` must be picklable by reference (a module-level function in a module
  the children can import; they import what this process would, from its
  working directory). A script that uses a pool must guard its
  entry point with ``if __name__ == "__main__":`` because the children
  re-import it.
- Workers are forked by a fork server that imported torch and this
  project's packages once (``toolkit.child.host_rank_context``); each takes
  the parent's environment as it is when the pool starts, as a spawned child
  would.
- Arguments and return values travel as plain pickles (no shared memory).
- Workers run with ``torch.set_num_threads(1)`` and the standard env vars
  ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``; the default process group is gloo over loopback with
  the pool's ``timeout``.
- Health: a call that outlives ``call_timeout`` or loses a worker kills every
  worker and raises :class:`RankError`. A call whose ranks disagree (some
  returned, some raised) or where a rank raised anything outside
  :data:`CLEAN_ERRORS` leaves gloo possibly out of step, so the workers are
  killed right away. Either way the next call spawns a fresh group. A call
  where *every* rank raised a :data:`CLEAN_ERRORS` error keeps the workers.
- No orphans: pools are closed at interpreter exit, and each worker exits on
  its own once its parent process is gone.
"""
from __future__ import annotations

import atexit
import os
import pickle
import signal
import socket
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection
from typing import Any, Callable

from runtime.host_memory import keep_freed_host_memory
from toolkit import child

#: Errors raised uniformly by all ranks before any collective diverged (bad
#: arguments, unsupported op). They leave the process group usable.
CLEAN_ERRORS = (ValueError, TypeError, IndexError, KeyError, NotImplementedError)

_STOP = None  # sentinel message: leave the worker loop


class RankError(RuntimeError):
    """A multi-rank call failed: some rank raised, hung or died.

    ``outcomes`` holds every rank's :class:`Outcome` when all ranks answered;
    ``missing`` lists the ranks that did not answer (timeout or death).
    """

    def __init__(self, message: str, outcomes: list | None = None, missing: list | None = None):
        super().__init__(message)
        self.outcomes = outcomes or []
        self.missing = missing or []


@dataclass
class Outcome:
    """What one rank's call produced: a value (``ok``) or an exception."""

    rank: int
    ok: bool
    value: Any = None
    exc_type: str | None = None  # class name, e.g. "ValueError"
    message: str = ""  # str(exc)
    traceback: str = ""  # formatted in the worker
    clean: bool = True  # ok, or the exception is one of CLEAN_ERRORS


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _error_outcome(rank: int, exc: BaseException) -> Outcome:
    return Outcome(rank, False, exc_type=type(exc).__name__, message=str(exc),
                   traceback="".join(traceback.format_exception(exc)),
                   clean=isinstance(exc, CLEAN_ERRORS))


def _send(conn, outcome: Outcome) -> None:
    child.send(conn, outcome, lambda exc: _error_outcome(outcome.rank, exc))  # the value did not pickle: say so


def _worker(rank: int, world_size: int, port: int, timeout: float, parent_pid: int, conn, environ: dict) -> None:
    """Body of one worker process: join the group, then serve calls until told to stop."""
    # Ctrl-C reaches the whole terminal process group; let the parent handle it
    # and kill us, instead of every worker printing a KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_freed_host_memory()  # before any other thread: one malloc arena for all of them
    child.leave_with_parent(parent_pid)
    try:
        child.take_environment(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                               WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                               LOCAL_WORLD_SIZE=str(world_size),
                               # sbp_core builds its own groups; they time out like the default one.
                               SBP_TIMEOUT=str(timeout))
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
    except BaseException as exc:
        _send(conn, _error_outcome(rank, exc))
        return
    _send(conn, Outcome(rank, True, value=os.getpid()))  # ready
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:  # parent closed the pipe
            break
        except Exception as exc:  # fn or an argument failed to unpickle here
            _send(conn, _error_outcome(rank, exc))
            continue
        if message is _STOP:
            break
        fn, args, kwargs = message
        try:
            outcome = Outcome(rank, True, value=fn(*args, **kwargs))
        except BaseException as exc:
            outcome = _error_outcome(rank, exc)
        _send(conn, outcome)
    dist.destroy_process_group()


class RankPool:
    """``world_size`` local worker processes, each one gloo rank, reused across calls.

    Workers start on the first :meth:`run`/:meth:`outcomes` and live until
    :meth:`close` (or interpreter exit). ``timeout`` is the process group's
    collective timeout in seconds; a call's own deadline defaults to
    ``timeout + 30``. Calls are serialized by a lock.
    """

    def __init__(self, world_size: int, timeout: float = 60.0):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        self.world_size = world_size
        self.timeout = float(timeout)
        self._ctx = child.host_rank_context()
        self._procs: list = []
        self._conns: list = []
        self._lock = threading.Lock()
        _LIVE_POOLS.add(self)

    # -- lifecycle ---------------------------------------------------------

    @property
    def alive(self) -> bool:
        """True while a started group of workers is up."""
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        """Worker process ids by rank (empty before the first call)."""
        return [p.pid for p in self._procs]

    def _start(self) -> None:
        try:
            self._spawn()
        except RankError as err:
            if not err.outcomes:  # timed out or died: retrying would not help
                raise
            # A rank reported an init error, most likely the port was taken
            # between free_port() and rank 0's bind; try once more on a fresh port.
            self._spawn()

    def _spawn(self) -> None:
        port = free_port()
        for rank in range(self.world_size):
            parent_end, child_end = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(
                target=_worker, name=f"rank-pool-{rank}", daemon=False,
                args=(rank, self.world_size, port, self.timeout, os.getpid(), child_end, dict(os.environ)))
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        ready = self._gather(self.timeout + 30.0, "init_process_group", stop_on_error=True)
        failed = [o for o in ready if not o.ok]
        if failed:
            self._kill()
            raise RankError(_describe("init_process_group", failed, self.world_size), ready)

    def _kill(self) -> None:
        """Terminate every worker now, without a graceful shutdown."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def close(self) -> None:
        """Stop the workers (graceful, then killed after 5 s). The pool may be reused."""
        with self._lock:
            for conn in self._conns:
                try:
                    conn.send_bytes(pickle.dumps(_STOP))
                except OSError:
                    pass
            deadline = time.monotonic() + 5.0
            for proc in self._procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
            self._kill()

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- calls -------------------------------------------------------------

    def outcomes(self, fn: Callable, *args, call_timeout: float | None = None, **kwargs) -> list[Outcome]:
        """Run ``fn(*args, **kwargs)`` on every rank; return each rank's :class:`Outcome`.

        Never raises for exceptions inside ``fn``. Raises :class:`RankError`
        only if a rank hangs past ``call_timeout`` or dies (workers are then
        killed and respawned on the next call).
        """
        try:
            message = pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(f"cannot send {fn!r} and its arguments to workers: {exc}; "
                            "use a module-level function and picklable arguments") from exc
        name = getattr(fn, "__qualname__", repr(fn))
        with self._lock:
            if not self.alive:
                self._kill()
                self._start()
            limit = self.timeout + 30.0 if call_timeout is None else call_timeout
            try:
                for conn in self._conns:
                    conn.send_bytes(message)
                results = self._gather(limit, name)
            except BaseException:
                # e.g. Ctrl-C while ranks still work: their late replies would
                # be read as the next call's, so this group cannot be reused.
                self._kill()
                raise
            if not all(o.ok for o in results) and not all(not o.ok and o.clean for o in results):
                self._kill()  # gloo may be out of step; respawn before the next call
            return results

    def run(self, fn: Callable, *args, call_timeout: float | None = None, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the values by rank.

        Raises :class:`RankError` if any rank raised (message: each failing
        rank, its exception type and the worker's traceback), hung past
        ``call_timeout`` (default ``timeout + 30`` s) or died.
        """
        results = self.outcomes(fn, *args, call_timeout=call_timeout, **kwargs)
        failed = [o for o in results if not o.ok]
        if failed:
            name = getattr(fn, "__qualname__", repr(fn))
            raise RankError(_describe(name, failed, self.world_size), results)
        return [o.value for o in results]

    def _exitcode(self, rank: int) -> int | None:
        # The sentinel closes a moment before the kernel makes the exit status
        # reapable, so wait briefly instead of polling once.
        self._procs[rank].join(timeout=1.0)
        return self._procs[rank].exitcode

    def _gather(self, limit: float, name: str, stop_on_error: bool = False) -> list[Outcome]:
        """One reply per rank within ``limit`` seconds, else kill all and raise.

        With ``stop_on_error`` the first failed reply ends the wait (the other
        ranks are killed), so a rank that failed to join does not leave its
        peers blocking until the timeout.
        """
        deadline = time.monotonic() + limit
        replies: dict[int, Outcome] = {}
        by_conn = {conn: rank for rank, conn in enumerate(self._conns)}
        by_sentinel = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        dead: dict[int, int | None] = {}
        while len(replies) < self.world_size:
            remaining = deadline - time.monotonic()
            waiting = [c for c, r in by_conn.items() if r not in replies and r not in dead]
            sentinels = [s for s, r in by_sentinel.items() if r not in replies and r not in dead]
            ready = connection.wait(waiting + sentinels, timeout=max(0.0, remaining)) if remaining > 0 else []
            for obj in ready:
                if obj in by_conn:
                    try:
                        replies[by_conn[obj]] = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError):  # the worker died mid-send
                        dead[by_conn[obj]] = self._exitcode(by_conn[obj])
            for obj in ready:
                rank = by_sentinel.get(obj)
                if rank is not None and rank not in replies and rank not in dead:
                    dead[rank] = self._exitcode(rank)
            failed = [o for o in replies.values() if not o.ok]
            if stop_on_error and failed and len(replies) < self.world_size:
                self._kill()
                raise RankError(_describe(name, failed, self.world_size), list(replies.values()),
                                missing=[r for r in range(self.world_size) if r not in replies])
            if dead or not ready:
                missing = [r for r in range(self.world_size) if r not in replies]
                self._kill()
                if dead:
                    why = ", ".join(f"rank {r} died (exit code {c})" for r, c in sorted(dead.items()))
                else:
                    why = f"no answer within {limit:g} s"
                raise RankError(f"{name}: {why}; ranks {missing} did not answer "
                                f"(of {self.world_size}); workers killed, the next call "
                                "starts a fresh group", missing=missing)
        return [replies[r] for r in range(self.world_size)]


def _describe(name: str, failed: list[Outcome], world_size: int) -> str:
    parts = [f"{name} failed on {len(failed)} of {world_size} ranks:"]
    for o in failed:
        parts.append(f"--- rank {o.rank}: {o.exc_type}: {o.message}\n{o.traceback.rstrip()}")
    return "\n".join(parts)


_LIVE_POOLS: "weakref.WeakSet[RankPool]" = weakref.WeakSet()
_SHARED: dict[tuple[int, float], RankPool] = {}


@atexit.register
def _close_all() -> None:
    for pool in list(_LIVE_POOLS):
        if pool._lock.acquire(timeout=1.0):
            pool._lock.release()
            pool.close()
        else:  # a daemon thread is stuck in a call; do not wait for it
            pool._kill()


def get_pool(world_size: int, timeout: float = 60.0) -> RankPool:
    """The process-wide shared pool for ``(world_size, timeout)``, created on first use."""
    key = (world_size, float(timeout))
    if key not in _SHARED:
        _SHARED[key] = RankPool(world_size, timeout)
    return _SHARED[key]


def launch(fn: Callable, world_size: int, *args, timeout: float = 60.0, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` once on the shared ``world_size``-rank pool; values by rank."""
    return get_pool(world_size, timeout).run(fn, *args, **kwargs)
