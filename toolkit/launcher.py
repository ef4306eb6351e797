"""Start the processes of a job and run ``main(cfg)`` on every rank.

:func:`launch` has three paths, chosen from the environment
(:func:`toolkit.config.environment.cluster_env`):

- **Launched** (torchrun, or ``srun`` under Slurm): this process is one rank.
  It joins the default process group from the environment (``env://``; for
  Slurm the ``MASTER_*``/``RANK`` variables are derived first), receives rank
  0's config (so every rank of every node runs with one config, e.g. one run
  directory even when nodes composed theirs at different seconds), calls
  ``main(cfg)`` and destroys the group. Failure handling is the launcher's
  (torchrun stops the other workers; the collective timeout bounds a hang).
- **Local, nprocs > 1**: starts ``nprocs`` processes on this machine (on
  CPU forked from a fork server that imported the project once,
  ``toolkit.child.host_rank_context``; CUDA ranks are spawned). The
  parent owns the rendezvous ``TCPStore`` on a port the OS picks (no
  free-port race); each child joins it as rank ``r`` (gloo on CPU; NCCL with
  ``torch.cuda.set_device(r)`` when there is a CUDA device per rank), calls
  ``main(cfg)`` and reports its result or its traceback over a pipe. The first
  failure (an exception, or a death without a report, e.g. ``os._exit`` or a
  signal) terminates every other rank (SIGTERM, SIGKILL after
  ``kill_grace`` seconds) and :func:`launch` raises :class:`LaunchError` with
  the failing rank's traceback. Children leave on their own if the parent dies.
- **Local, nprocs == 1**: runs ``main(cfg)`` in this process inside a 1-rank
  process group, so the code path equals the multi-rank one; the environment
  variables it sets are restored afterwards.

On CUDA each rank owns one GPU, ``LOCAL_RANK``, or the only one visible
where the launcher shows each task its own (``torch.cuda.set_device``
before anything is allocated; NCCL's communicators are built lazily, per
group, among its members: ``_join``). A collective that
times out raises on gloo; on NCCL torch's watchdog aborts the rank's
process after the same timeout. Either way the launcher (or torchrun) sees
the rank end and stops the others.

Every rank sees ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``SBP_TIMEOUT`` (the collective
timeout of sbp_core's groups; also the default group's timeout).

The config crosses process boundaries as a plain container
(``OmegaConf.to_container(cfg, resolve=True)``, so Hydra-only interpolations
such as the run directory are resolved in the parent) and is rebuilt as a
DictConfig, typed again when it was a structured config. ``main`` must be
picklable by reference (a module-level function); a script using
:func:`launch` must guard its entry point with ``if __name__ == "__main__":``
because children re-import it.
"""
from __future__ import annotations

import importlib
import os
import pickle
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import is_dataclass
from datetime import timedelta
from multiprocessing import connection, get_context
from typing import Any, Callable, Optional

from runtime.host_memory import keep_freed_host_memory
from toolkit import child
from toolkit.config.environment import ClusterEnv, cluster_env, device_index, resolve_device
from toolkit.config.errors import ConfigError

DEFAULT_TIMEOUT_S = 300.0
_REPORT_GRACE_S = 0.5  # after a first failure, how long other ranks' reports are still collected


class LaunchError(RuntimeError):
    """A rank of a local job raised or died; every rank was terminated.

    ``rank``: the first rank that failed. ``failures``: rank -> its report
    (the traceback text, or how it died) for every rank that failed before
    the others were terminated (later ones are usually consequences).
    """

    def __init__(self, message: str, rank: int, failures: dict[int, str]):
        super().__init__(message)
        self.rank = rank
        self.failures = failures

    def __reduce__(self):  # picklable with its fields (e.g. when re-raised through a pool)
        return (type(self), (self.args[0], self.rank, self.failures))


# -- config across processes --------------------------------------------------

def _pack(cfg: Any) -> tuple[Any, Optional[str], bool]:
    """``(plain container, "module:qualname" of its structured type or None, was a DictConfig)``."""
    from omegaconf import OmegaConf

    if not OmegaConf.is_config(cfg):
        return cfg, None, False
    kind = OmegaConf.get_type(cfg)
    type_path = f"{kind.__module__}:{kind.__qualname__}" if kind is not None and is_dataclass(kind) else None
    return OmegaConf.to_container(cfg, resolve=True), type_path, True


def _rebuild(packed: tuple[Any, Optional[str], bool]) -> Any:
    """Inverse of :func:`_pack`: a (typed) DictConfig for what was one, the value itself otherwise."""
    from omegaconf import OmegaConf

    container, type_path, was_config = packed
    if not was_config:
        return container
    if type_path is None:
        return OmegaConf.create(container)
    module, _, qualname = type_path.partition(":")
    kind = importlib.import_module(module)
    for part in qualname.split("."):
        kind = getattr(kind, part)
    return OmegaConf.merge(OmegaConf.structured(kind), container)


# -- environment ----------------------------------------------------------------

def _timeout_s(timeout: Optional[float]) -> float:
    value = float(os.environ.get("SBP_TIMEOUT", DEFAULT_TIMEOUT_S)) if timeout is None else float(timeout)
    if not value > 0:
        raise ValueError(f"timeout={timeout!r}: must be positive seconds")
    return value


def _apply_sbp_timeout(timeout: float) -> Optional[float]:
    """Make sbp_core's groups use ``timeout`` even if it was imported before the env var was set.

    Returns sbp_core's previous timeout (``None`` if sbp_core is not imported yet).
    """
    os.environ["SBP_TIMEOUT"] = str(timeout)
    groups = sys.modules.get("sbp_core.process_groups")
    if groups is None:
        return None
    previous = groups.get_timeout()
    groups.set_timeout(timeout)
    return previous


@contextmanager
def _environ(values: dict[str, str]):
    """Set environment variables for the duration of the block, then restore the old values."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rank_env(rank: int, world: int, local_rank: int, local_world: int, addr: str, port: int,
              timeout: float) -> dict[str, str]:
    return dict(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_world), SBP_TIMEOUT=str(timeout))


def _join(kind: str, **init) -> None:
    """Join the default process group (``init``: ``init_process_group``'s arguments): gloo on CPU, NCCL on
    this rank's GPU (``torch.cuda.set_device`` just before).

    NCCL is deliberately not bound to the device (no ``device_id``). Bound,
    torch builds each later group's communicator by splitting the world's,
    a split every rank of the world must join; a rank outside a *gloo* group
    (sbp_core's control twins) joins one while the group's members do not,
    so from 3 ranks on the later groups' splits pair up wrongly and a
    group's communicator holds the wrong ranks, or hangs (pytorch#197568).
    Unbound, each group's communicator is built among its members when it
    first communicates (Megatron-LM's setup too). The world's is built
    here, by one all-reduce that every rank joins: torch requires every
    member in a group's first operation when that is a batch of sends and
    receives (``batch_isend_irecv``), as a world group's first boxing may be.
    """
    import torch
    import torch._dynamo  # noqa: F401  (a rank imports it at its first optimizer step, a second or more of CPU:
    import torch.distributed as dist  # here, before the rendezvous, it keeps that out of any timed wait)

    dist.init_process_group("nccl" if kind == "cuda" else "gloo", **init)
    if kind == "cuda":
        dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())))


def _require_no_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("launch: a default process group already exists in this process; "
                           "call launch() from a process that has not joined one")


# -- public entry point -----------------------------------------------------------

def launch(main: Callable[[Any], Any], cfg: Any, nprocs: int, *, device: Optional[str] = None,
           timeout: Optional[float] = None, kill_grace: float = 5.0) -> Any:
    """Run ``main(cfg)`` on ``nprocs`` ranks; returns what ``main`` returned on rank 0.

    - ``device``: ``auto`` / ``cpu`` / ``cuda``; ``None`` reads ``cfg.device``
      (``auto`` if absent). ``auto`` uses CUDA only with a device per local rank.
    - ``timeout``: collective timeout in seconds (``None``: ``$SBP_TIMEOUT`` or 300).
    - ``kill_grace``: seconds between SIGTERM and SIGKILL when stopping ranks.

    Under torchrun/Slurm, the return value is this rank's own. Raises
    :class:`ConfigError` when the launched world size differs from
    ``nprocs``, :class:`LaunchError` when a local rank fails.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r}: must be a positive int (dp * cp * tp * pp)")
    if device is None:
        device = (cfg.get("device") if hasattr(cfg, "get") else None) or "auto"
    timeout = _timeout_s(timeout)
    env = cluster_env()
    if env is not None:
        return _run_launched(main, cfg, nprocs, env, device, timeout)
    if nprocs == 1:
        return _run_in_process(main, cfg, device, timeout)
    return _run_spawned(main, cfg, nprocs, device, timeout, kill_grace)


def _run_launched(main, cfg, nprocs: int, env: ClusterEnv, device: str, timeout: float):
    """One rank of a torchrun / Slurm job (see module docstring)."""
    import torch
    import torch.distributed as dist

    if env.world_size != nprocs:
        raise ConfigError(f"{env.kind} started {env.world_size} processes, but the layout needs "
                          f"nprocs={nprocs}; valid: launch {nprocs} processes, or choose a layout whose "
                          f"dp*cp*tp*pp is {env.world_size}")
    _require_no_group()
    kind = resolve_device(device, env.sharing_devices(env.world_size))
    if kind == "cuda":
        torch.cuda.set_device(device_index(env.local_rank, torch.cuda.device_count()))
    if env.kind == "slurm":  # torchrun already set these; Slurm names them its own way
        os.environ.update(_rank_env(env.rank, env.world_size, env.local_rank, env.local_world_size or 1,
                                    env.master_addr, env.master_port, timeout))
    _apply_sbp_timeout(timeout)
    _join(kind, init_method="env://", rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=timeout))
    packed = [_pack(cfg) if env.rank == 0 else None]
    dist.broadcast_object_list(packed, src=0)
    value = main(_rebuild(packed[0]))
    # Only after a success: a failed rank's peers may still be inside collectives with it, and NCCL's
    # destroy finalizes communicators, waiting for them. The failure ends this process, and the launcher
    # (torchrun, Slurm) then stops the others.
    dist.destroy_process_group()
    return value


def _run_in_process(main, cfg, device: str, timeout: float):
    """A 1-rank process group in this process around ``main(cfg)``."""
    import torch
    import torch.distributed as dist

    _require_no_group()
    kind = resolve_device(device, 1)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)
    with _environ(_rank_env(0, 1, 0, 1, "127.0.0.1", store.port, timeout)):
        previous = _apply_sbp_timeout(timeout)
        try:
            if kind == "cuda":
                torch.cuda.set_device(0)
            _join(kind, store=store, rank=0, world_size=1, timeout=timedelta(seconds=timeout))
            try:
                return main(_rebuild(_pack(cfg)))
            finally:
                dist.destroy_process_group()
        finally:
            if previous is not None:  # this process outlives the job: leave sbp_core as it was
                sys.modules["sbp_core.process_groups"].set_timeout(previous)


# -- local spawning -----------------------------------------------------------------

def _send(conn, message: tuple) -> None:
    # A main whose return value does not pickle: report that instead.
    child.send(conn, message, lambda exc: ("error", message[1], time.time(),
                                           f"rank {message[1]}: main's return value cannot be sent to the parent: "
                                           f"{type(exc).__name__}: {exc}"))


def _child(rank: int, nprocs: int, port: int, kind: str, timeout: float, parent_pid: int, conn,
           main, packed, environ: dict) -> None:
    """Body of one local rank: join the group, run ``main``, report over ``conn``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    keep_freed_host_memory()  # before any other thread: one malloc arena for all of them
    child.leave_with_parent(parent_pid)
    try:
        # main's module and sbp_core may be imported already (by the fork server, or while unpickling our
        # arguments): take_environment pushes the timeouts into sbp_core too.
        child.take_environment(environ, **_rank_env(rank, nprocs, rank, nprocs, "127.0.0.1", port, timeout))
        import torch
        import torch.distributed as dist

        if kind == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // nprocs))
        if kind == "cuda":
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=timeout))
        _join(kind, store=store, rank=rank, world_size=nprocs, timeout=timedelta(seconds=timeout))
        value = main(_rebuild(packed))
    except SystemExit as exc:
        if exc.code in (None, 0):
            value = None
        else:
            _send(conn, ("error", rank, time.time(), f"rank {rank} called sys.exit({exc.code!r})\n"
                         + "".join(traceback.format_exception(exc))))
            return
    except BaseException as exc:
        _send(conn, ("error", rank, time.time(), "".join(traceback.format_exception(exc))))
        return
    dist.destroy_process_group()
    _send(conn, ("ok", rank, value))


def _stop(procs, grace: float) -> None:
    """SIGTERM every live process, SIGKILL what is left after ``grace`` seconds, reap all."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)


def _run_spawned(main, cfg, nprocs: int, device: str, timeout: float, kill_grace: float):
    """``nprocs`` local ranks; see the module docstring for the failure contract."""
    import torch.distributed as dist

    try:
        pickle.dumps(main)
    except Exception as exc:
        raise TypeError(f"launch: main={main!r} cannot be sent to child processes ({exc}); valid: a "
                        "module-level function of an importable module") from exc
    kind = resolve_device(device, nprocs)
    packed = _pack(cfg)
    # CUDA ranks are spawned: the fork server's ranks have only been run on CPU.
    ctx = child.host_rank_context() if kind == "cpu" else get_context("spawn")
    # The parent owns the rendezvous store: the OS picks its port, so no rank can lose a port race.
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)
    procs, conns = [], []
    try:
        for rank in range(nprocs):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, name=f"rank-{rank}", daemon=False,
                               args=(rank, nprocs, store.port, kind, timeout, os.getpid(), child_end,
                                     main, packed, dict(os.environ)))
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
        return _supervise(procs, conns, kill_grace)
    finally:
        _stop(procs, kill_grace)
        for conn in conns:
            conn.close()


def _supervise(procs, conns, kill_grace: float) -> Any:
    """Wait for every rank's report; on the first failure stop all ranks and raise :class:`LaunchError`."""
    nprocs = len(procs)
    results: dict[int, Any] = {}
    failures: dict[int, tuple[float, str]] = {}
    silent: set[int] = set()  # ranks that died without a report
    first_failure_at: Optional[float] = None

    def read(rank: int) -> None:
        try:
            message = pickle.loads(conns[rank].recv_bytes())
        except (EOFError, OSError):
            return  # died without a report; the sentinel branch records it
        if message[0] == "ok":
            results[rank] = message[2]
        else:
            failures[rank] = (message[2], message[3])

    def open_ranks() -> list[int]:
        return [r for r in range(nprocs) if r not in results and r not in failures]

    while open_ranks():
        waiting = open_ranks()
        limit = None
        if first_failure_at is not None:
            limit = first_failure_at + _REPORT_GRACE_S - time.monotonic()
            if limit <= 0:
                break
        ready = connection.wait([conns[r] for r in waiting] + [procs[r].sentinel for r in waiting],
                                timeout=limit)
        for rank in waiting:
            if conns[rank] in ready or (procs[rank].sentinel in ready and conns[rank].poll()):
                read(rank)
        for rank in waiting:
            if procs[rank].sentinel in ready and rank not in results and rank not in failures:
                procs[rank].join(timeout=1.0)
                code = procs[rank].exitcode
                how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                failures[rank] = (time.time(), f"rank {rank} died ({how}) without reporting an error")
                silent.add(rank)
        if failures and first_failure_at is None:
            first_failure_at = time.monotonic()
    if failures:
        _stop(procs, kill_grace)
        # A rank that died without a report is the likelier cause (an exception in main would have
        # been reported); reported failures follow in the order they happened.
        order = sorted(failures, key=lambda r: (r not in silent, failures[r][0]))
        first = order[0]
        text = f"launch: rank {first} of {nprocs} failed; all ranks were stopped.\n" \
               f"--- rank {first}:\n{failures[first][1].rstrip()}"
        for rank in order[1:]:
            text += f"\n--- rank {rank} (after rank {first}):\n{failures[rank][1].rstrip()}"
        raise LaunchError(text, first, {r: failures[r][1] for r in order})
    deadline = time.monotonic() + kill_grace  # every rank reported: let them exit on their own
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    return results[0]
