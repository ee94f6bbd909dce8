"""What a run of several ranks does when one of them dies or hangs: every other rank stops within a
bounded time, and one of them prints one line naming the rank that failed, its host, and the checkpoint
``--resume auto`` will take. No rank prints a traceback for it.

How it works. Each rank runs a watch thread beside training (:class:`PeerWatch`). Every ``interval``
seconds it adds one to its own heartbeat counter in the job's key-value store (the TCPStore that
torch.distributed rendezvoused through, reached over a connection of its own) and looks for a fault
record there. A failure shows up in one of three ways:

- a collective fails on some rank: a dead peer closes its connections at once (gloo: "Connection
  closed by peer"); a stopped or hung one lets the collective time out after the collective timeout.
  That rank reads every heartbeat twice, ``probe`` seconds apart: the ranks whose counters did not move
  are the failed ones; it publishes them as the fault record (the first record written wins);
- the store itself stops answering: its host (rank 0's process under SLURM or Fabric's own launcher)
  is gone or frozen; that names rank 0;
- on a machine where Fabric started the other ranks as child processes, rank 0 sees a child exit with
  an error or a signal.

Every rank that learns of the fault (from its own collective's error, or from its watch thread, which
also ends a rank whose main thread is stuck in a collective that will never complete) acknowledges it
and stops. The lowest-numbered surviving rank waits for the acknowledgements, prints the line, marks the
fault as reported and exits; the others wait for that mark and exit without a word. Exit status
:data:`EXIT_PEER_FAILURE` everywhere. A rank that was itself frozen (its watch thread saw time jump by
at least half the collective timeout: ``Timings.stalled``), or that finds itself named as failed, exits
quietly.

A rank's own error (a bad value, a missing file, a bug) is not a peer failure: that rank publishes a fault
naming itself, waits until the others have taken note (so they stay quiet instead of reporting it as a
dead peer), and lets the error propagate as usual (one line, or a traceback for a bug).

Bound. With ``T`` the collective timeout and ``h = min(2, max(0.5, T / 20))`` seconds the heartbeat,
every surviving rank exits within ``T + 6 h + 4`` seconds of starting to wait for the failed rank in a
collective (at most ``T + 16 s``; a rank that dies closes its connections, which the others see at once,
so they are gone within about ``6 h + 4`` seconds). :func:`timings` holds the numbers (``Timings.bound``
is the part past ``T``). ``T`` must be at least 10 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

EXIT_PEER_FAILURE = 4
PREFIX = "gdn2/peers"


@dataclass(frozen=True)
class Timings:
    """Seconds: ``interval`` between heartbeats, ``probe`` (two readings of the heartbeats this far apart
    tell the living from the dead), ``store`` (a store call that takes longer means its host is frozen),
    ``acks`` (how long the reporting rank waits for the others' acknowledgements), ``reported`` (how
    long the others wait for the report) and ``stalled`` (a gap this long in this rank's own heartbeat
    means this rank was frozen)."""

    timeout: float
    interval: float
    probe: float
    store: float
    acks: float
    reported: float
    stalled: float

    @property
    def bound(self) -> float:
        """The stated bound past the collective timeout: detection (probe), the reporter hearing of it
        (one heartbeat), the acknowledgements, and a second for printing and exiting."""
        return self.probe + self.interval + self.acks + 1.0


def timings(timeout_seconds: float) -> Timings:
    """The watch's timings for a collective timeout of ``timeout_seconds`` (see the module's text)."""
    interval = min(2.0, max(0.5, timeout_seconds / 20))
    probe = 2 * interval + 1.0
    store = min(60.0, max(5.0, timeout_seconds / 4))
    acks = 3 * interval + 2.0
    # a frozen rank is frozen for at least T (the others wait that long before they act); a living one's
    # last heartbeat may be a probe, a slow store call and a heartbeat or two old
    stalled = max(timeout_seconds / 2, probe + store + 2 * interval)
    return Timings(timeout=timeout_seconds, interval=interval, probe=probe, store=store, acks=acks,
                   reported=2 * (interval + acks) + 5.0, stalled=stalled)


class StoreLost(Exception):
    """The key-value store did not answer (its host is gone or frozen)."""


@dataclass
class Fault:
    """The fault record: which ranks failed, how (``kind``: ``"peer"`` died or hangs, ``"store"`` the
    store's host is gone, ``"error"`` the rank raised an error of its own), who wrote it."""

    failed: list[int]
    kind: str
    cause: str
    by: int

    def to_json(self) -> str:
        return json.dumps({"failed": self.failed, "kind": self.kind, "cause": self.cause, "by": self.by})

    @classmethod
    def from_json(cls, raw: bytes | str) -> "Fault":
        d = json.loads(raw)
        return cls(failed=[int(r) for r in d["failed"]], kind=str(d["kind"]), cause=str(d["cause"]), by=int(d["by"]))


@dataclass
class Peer:
    host: str
    pid: int
    ppid: int


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class _Quiet:
    """Keeps file descriptor 2 pointed at /dev/null for the duration of a store call: a call that fails
    because the store's host is gone makes torch print a C++ stack trace there, which would bury the one
    line this module exists to print. The line itself waits for the lock; whatever else the process
    writes to stderr during a call (a millisecond or so, every heartbeat) is lost. Used on the ranks
    whose process does not serve the store."""

    def __init__(self) -> None:
        self.lock = threading.RLock()

    def __call__(self, fn: Callable[[], Any]) -> Any:
        with self.lock:
            try:
                sys.stderr.flush()
            except Exception:  # noqa: BLE001 - a closed stderr must not stop a store call
                pass
            saved = os.dup(2)
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, 2)
                return fn()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                os.close(null)


class PeerWatch:
    """See the module's text. ``PeerWatch.start`` on every rank after the process group exists;
    ``on_error`` from the except clause around training (it returns only for this rank's own error,
    which the caller re-raises); ``close`` when training ended normally."""

    def __init__(self, rank: int, world_size: int, peers: list[Peer], store: Any, namespace: str, t: Timings,
                 checkpoint_dir: Path, store_host: Optional[str], serves_store: bool,
                 children: dict[int, Any]) -> None:
        self.rank, self.world_size, self.peers, self.store, self.t = rank, world_size, peers, store, t
        self.namespace, self.checkpoint_dir, self.store_host = namespace, Path(checkpoint_dir), store_host
        self.children = children  # global rank -> subprocess.Popen, the ranks this process started
        # the store runs in this process: a slow answer is load, never a dead host
        self.serves_store = serves_store
        self._quiet = None if serves_store else _Quiet()
        self._calls: queue.Queue = queue.Queue()
        self._store_dead = False
        self._stop = threading.Event()
        self._claim_lock = threading.Lock()
        self._claimed = False
        self._last_beat = time.monotonic()
        self._was_frozen = False
        self.active = True
        threading.Thread(target=self._serve_calls, name="gdn2-peer-store", daemon=True).start()
        self._thread = threading.Thread(target=self._watch, name="gdn2-peer-watch", daemon=True)

    # ---------------------------------------------------------------------------------------------
    # setup

    @classmethod
    def start(cls, fabric: Any, checkpoint_dir: Path, timeout_seconds: float) -> Optional["PeerWatch"]:
        """Start watching (every rank calls this at the same point); None on one rank."""
        if fabric.world_size <= 1:
            return None
        import torch.distributed as dist

        t = timings(timeout_seconds)
        rank = fabric.global_rank
        # torchrun's own store outlives a restart of the workers: each attempt has its keys
        namespace = f"{PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        store = _connect(t) or dist.distributed_c10d._get_default_store()
        watch_key = f"{namespace}/hb/{rank}"
        store.add(watch_key, 1)  # every heartbeat exists before anyone can read them (the gather waits)
        gathered: list[Any] = [None] * fabric.world_size
        dist.all_gather_object(gathered, (socket.gethostname(), os.getpid(), os.getppid()))
        peers = [Peer(host=g[0], pid=int(g[1]), ppid=int(g[2])) for g in gathered]
        store_host = os.environ.get("MASTER_ADDR", peers[0].host)
        children = _children(fabric, peers) if rank == 0 else {}
        watch = cls(rank, fabric.world_size, peers, store, namespace, t, checkpoint_dir,
                    f"torchrun's rendezvous on {store_host}" if agent_store else None,
                    rank == 0 and not agent_store, children)
        if children:
            _retire_fabric_observer()  # this watch takes over its job (ending the children on a failure)
        watch._thread.start()
        return watch

    def _key(self, name: str) -> str:
        return f"{self.namespace}/{name}"

    # ---------------------------------------------------------------------------------------------
    # store calls, each with a deadline (a TCPStore call to a frozen host never returns on its own)

    def _serve_calls(self) -> None:
        while True:
            fn, box, done = self._calls.get()
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))
            done.set()

    def _call(self, fn: Callable[[], Any]) -> Any:
        if self._store_dead:
            raise StoreLost("the store stopped answering earlier")

        def run() -> Any:
            box: list = []
            done = threading.Event()
            self._calls.put((fn, box, done))
            if not done.wait(self.t.store):
                raise StoreLost(f"no answer in {self.t.store:.0f} s")
            ok, value = box[0]
            if not ok:
                raise StoreLost(str(value))
            return value

        try:
            return self._quiet(run) if self._quiet is not None else run()
        except StoreLost:
            self._store_dead = not self.serves_store
            raise

    def _read_fault(self) -> Optional[Fault]:
        key = self._key("fault")
        if not self._call(lambda: self.store.check([key])):
            return None
        return Fault.from_json(self._call(lambda: self.store.get(key)))

    def _publish(self, fault: Fault) -> Fault:
        """Write ``fault`` unless a record exists already; the record that holds (the first one)."""
        key = self._key("fault")
        return Fault.from_json(self._call(lambda: self.store.compare_set(key, "", fault.to_json())))

    def _count(self, name: str) -> int:
        key = self._key(name)
        return int(self._call(lambda: self.store.add(key, 0)))

    # ---------------------------------------------------------------------------------------------
    # the watch thread

    def _watch(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.t.interval):
            now = time.monotonic()
            gap, last = now - last, now
            if gap > self.t.timeout:  # frozen for longer than the others wait: they are gone or going
                self._exit()
            if gap > self.t.stalled:
                self._was_frozen = True
            self._last_beat = now
            try:
                self._call(lambda: self.store.add(self._key(f"hb/{self.rank}"), 1))
                fault = self._read_fault()
                if fault is None:
                    dead = self._dead_children()
                    if dead:
                        fault = self._publish(Fault(dead, "peer", self._child_cause(dead), self.rank))
            except StoreLost:
                if self.serves_store:
                    continue  # an answer that came late from our own store: beat again next time
                fault = self._store_fault()
            if self._stop.is_set():
                return
            if fault is not None:
                if self._claim():
                    self._settle(fault)
                return

    def _dead_children(self) -> list[int]:
        return sorted(r for r, proc in self.children.items() if proc.poll() not in (None, 0))

    def _child_cause(self, dead: list[int]) -> str:
        codes = [self.children[r].poll() for r in dead]
        what = [f"was killed by {_signal_name(c)}" if c < 0 else f"exited with status {c}" for c in codes]
        return what[0] if len(set(what)) == 1 else "ended (" + ", ".join(what) + ")"

    def _store_fault(self) -> Fault:
        where = "it serves" if self.store_host is None else f"({self.store_host})"
        return Fault([0], "store", f"stopped answering (the job's key-value store {where} is gone)", self.rank)

    # ---------------------------------------------------------------------------------------------
    # the main thread

    def on_error(self, error: BaseException) -> None:
        """Called with the error that ended training on this rank. Returns (for the caller to re-raise)
        when the error is this rank's own; ends the process when a peer failed."""
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            self._halt()
            return
        if not self._claim():
            while True:  # the watch thread is ending this process (it claimed the fault first)
                time.sleep(1)
        if not self.active:  # the watch had stopped already
            return
        try:
            fault = self._read_fault()
            if fault is None and _may_be_a_peer(error):
                failed = self._dead_children()
                cause = self._child_cause(failed) if failed else ""
                if not failed:
                    failed = self._probe()
                    cause = (f"stopped answering (no heartbeat in {self.t.probe:.0f} s: its process died, was "
                             "stopped or is cut off)")
                if failed:
                    fault = self._publish(Fault(failed, "peer", cause, self.rank))
            if fault is None:
                fault = self._publish(Fault([self.rank], "error", f"{type(error).__name__}", self.rank))
                if fault.by == self.rank and fault.failed == [self.rank]:
                    # our own error: the others take note and stop quietly; then it is ours to print
                    self._wait(lambda: self._count("acks") >= self.world_size - 1, self.t.acks)
                    self._halt()
                    self._mark_reported()
                    return
        except StoreLost:
            if self.serves_store:  # our own store did not answer in time: nothing to tell the error from
                self._halt()
                return
            if self._stopped_by_freeze():
                self._exit()
            fault = self._store_fault()
        self._settle(fault)

    def _probe(self) -> list[int]:
        """The ranks whose heartbeats did not move during ``probe`` seconds."""
        keys = [self._key(f"hb/{r}") for r in range(self.world_size)]
        before = self._call(lambda: self.store.multi_get(keys))
        time.sleep(self.t.probe)
        after = self._call(lambda: self.store.multi_get(keys))
        return [r for r in range(self.world_size) if r != self.rank and before[r] == after[r]]

    def close(self) -> None:
        """Training ended normally: stop beating, and leave only once every rank has stopped (rank 0's
        process serves the store, and a watch that outlived it would take its exit for a failure)."""
        if not self.active:
            return
        self._halt()
        try:
            self._call(lambda: self.store.add(self._key("closed"), 1))
            if self.rank == 0:
                self._wait(lambda: self._count("closed") >= self.world_size, self.t.acks + self.t.store)
        except StoreLost:
            pass

    # ---------------------------------------------------------------------------------------------
    # ending

    def _claim(self) -> bool:
        with self._claim_lock:
            if self._claimed:
                return False
            self._claimed = True
            return True

    def _halt(self) -> None:
        self.active = False
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.t.interval + self.t.store + 1)

    def _stopped_by_freeze(self) -> bool:
        return self._was_frozen or time.monotonic() - self._last_beat > self.t.stalled

    def _wait(self, condition: Callable[[], bool], seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while True:
            try:
                if condition():
                    return True
            except StoreLost:
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def _settle(self, fault: Fault) -> None:
        """Stop this rank for ``fault``: acknowledge it; the reporter waits for the others, prints the
        line and marks it reported; the others wait for that mark. Never returns."""
        self.active = False
        self._stop.set()
        if self.rank in fault.failed or self._stopped_by_freeze():
            self._exit()  # named as failed, or frozen meanwhile: the others have it in hand
        survivors = [r for r in range(self.world_size) if r not in fault.failed]
        try:
            self._call(lambda: self.store.add(self._key("acks"), 1))
            store_ok = True
        except StoreLost:
            store_ok = False
        reporter = min(survivors) if fault.kind != "error" else None  # an error is printed by its own rank
        if reporter == self.rank:
            if store_ok:
                self._wait(lambda: self._count("acks") >= len(survivors), self.t.acks)
            self._print(self._line(fault, survivors))
            if store_ok:
                self._mark_reported()
            self._end_children(fault)
        elif store_ok:
            self._wait(lambda: self._call(lambda: self.store.check([self._key("reported")])), self.t.reported)
        else:
            time.sleep(min(2.0, self.t.acks))  # no store: give the reporter time to print first
        self._exit()

    def _mark_reported(self) -> None:
        try:
            self._call(lambda: self.store.set(self._key("reported"), "1"))
        except StoreLost:
            pass

    def _line(self, fault: Fault, survivors: list[int]) -> str:
        who = ", ".join(f"rank {r} (pid {self.peers[r].pid} on {self.peers[r].host})" for r in fault.failed)
        done = list_checkpoints_quietly(self.checkpoint_dir)
        resume = (f"--resume auto will continue from {done}" if done is not None
                  else f"no checkpoint in {self.checkpoint_dir} yet: --resume auto starts afresh")
        others = f"{len(survivors)} other rank{'s' if len(survivors) != 1 else ''}"
        return f"gdn2 pretrain: error: {who} {fault.cause}; the {others} stopped. {resume}"

    def _print(self, line: str) -> None:
        with self._quiet.lock if self._quiet is not None else contextlib.nullcontext():
            try:
                sys.stdout.flush()
            except Exception:  # noqa: BLE001
                pass
            os.write(2, (line + "\n").encode())

    def _end_children(self, fault: Fault) -> None:
        """A failed rank that this process started (Fabric's launcher on one machine) and that is still
        there, stopped or hung, is ended, so that the run ends; the surviving children are given the
        time to leave on their own, then ended too."""
        for r in fault.failed:
            if r in self.children and self.children[r].poll() is None:
                self.children[r].kill()
        deadline = time.monotonic() + self.t.reported
        for proc in self.children.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
                proc.kill()

    def _exit(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(EXIT_PEER_FAILURE)


def set_collective_timeout(seconds: float) -> None:
    """Give every process group of this process the run's collective timeout. The groups made after the
    rendezvous (a device mesh's, for hybrid sharding) otherwise keep torch's default (30 minutes; 10 for
    NCCL) whatever the run asked for, and the rendezvous itself is given longer (``build_fabric``)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_available() or not dist.is_initialized():
        return
    timeout = timedelta(seconds=seconds)
    for group in list(getattr(getattr(c10d, "_world", None), "pg_map", None) or {}):
        try:
            c10d._set_pg_timeout(timeout, group)
        except (ValueError, AssertionError):  # not a member, or a backend without a settable timeout
            pass


def list_checkpoints_quietly(root: Path) -> Optional[Path]:
    """The newest complete checkpoint under ``root`` (the one ``--resume auto`` takes when it is
    intact), or None."""
    from gdn2.checkpoint.format import list_checkpoints

    try:
        found = list_checkpoints(root)
    except OSError:
        return None
    return found[-1][1] if found else None


def _may_be_a_peer(error: BaseException) -> bool:
    """Errors that a failed peer may cause: gloo's RuntimeErrors, torch's own errors (torch.distributed's,
    and the checkpoint writer's, which derives from BaseException), broken connections, timeouts. gdn2's
    own errors (a bad value, too many non-finite steps) and the operating system's (a full disk) are not."""
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    module = type(error).__module__
    return module.split(".")[0] == "torch" or (module == "builtins" and isinstance(error, RuntimeError))


def _connect(t: Timings) -> Any:
    """A connection of our own to the rendezvous store (so that a call of ours never waits behind the
    process group's), or None when its address is not in the environment."""
    from datetime import timedelta

    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    try:
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=t.store),
                             wait_for_workers=False)
    except Exception:  # noqa: BLE001 - fall back to the process group's own connection
        return None


def _children(fabric: Any, peers: list[Peer]) -> dict[int, Any]:
    """Global rank -> Popen of the ranks that Fabric's launcher started from this process."""
    procs = getattr(getattr(fabric.strategy, "launcher", None), "procs", None) or []
    by_pid = {p.pid: p for p in procs}
    me = os.getpid()
    host = socket.gethostname()
    return {r: by_pid[p.pid] for r, p in enumerate(peers) if p.ppid == me and p.host == host and p.pid in by_pid}


def _retire_fabric_observer() -> None:
    """Fabric's launcher watches its child processes from a thread that kills every process of the run,
    this one included, a few seconds after a child fails. It would cut the report short; the watch
    ends the children itself instead (:meth:`PeerWatch._end_children`), so the observer is told to stop
    at its next look."""
    for thread in threading.enumerate():
        if type(thread).__name__ == "_ChildProcessObserver" and hasattr(thread, "_run"):
            thread._run = lambda: True  # "all children done": its loop ends without acting
