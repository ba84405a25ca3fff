"""Process-level plumbing shared by the stage harness, artifact I/O, tracking and prediction.

* **Owners.**  A temporary artifact and a running MLflow run record which process made them:
  :func:`owner_tag` (pid and a short host hash, for file names) and :data:`HOST`.
  :func:`pid_gone` says whether such a process is certainly gone.  Reading: a pid is only
  meaningful on its own machine, so a leftover of *another* host is never called gone (it is left
  in place and reported; on a cluster the next run may land on another node, and removing a live
  job's files there would be worse than leaving a stale one).  A live pid may be an unrelated
  process that reused the number: that errs on the side of keeping the file.

* **Orphans.**  A stage started by Snakemake must not outlive it: Snakemake killed with ``kill -9``
  (or an out-of-memory kill, or a lost SSH session without ``nohup``) would otherwise leave its
  stages computing for hours, holding GPU memory and writing into ``results/``.  Snakemake runs a
  rule's shell line through ``bash -c``, and bash either execs the stage (its parent is then the
  Snakemake process) or waits for it (the parent is bash, and bash survives Snakemake's death).
  :func:`guard_against_orphaning` therefore (1) asks Linux for ``SIGTERM`` when the direct parent
  dies (``prctl(PR_SET_PDEATHSIG)``; immediate and independent of Python's GIL, but it only sees
  the direct parent), and (2) starts a daemon thread that every ``XMC_ORPHAN_POLL_S`` seconds
  (default 1) checks the chain of ancestors from the parent up to the first one that is not a
  command wrapper (a shell running a ``-c`` command string, ``time``, ``env``, ``nice`` ...): when
  any link of that chain is broken (a process of it is gone, or was re-parented because its own
  parent died: the kernel re-parents children at their parent's exit, before the dead parent is
  even reaped), the stage logs why and sends itself ``SIGTERM`` (the neural trainers checkpoint
  on it).  Ancestors above the starter (the user's shell, tmux, sshd) are not watched: Snakemake
  may legitimately outlive them (``nohup snakemake``).  A stage typed by hand in a terminal (its
  starter is an interactive shell) is left to the terminal's own rules (SIGHUP, ``nohup``): nothing
  is armed then.  Both see only the ancestors alive when the stage starts: a Snakemake killed while the
  stage's interpreter was still starting (imports take seconds on a busy machine) has already left it
  re-parented to pid 1.  So (3) every Snakemake process reading the Snakefile names itself in
  ``XMC_WORKFLOW`` (:func:`mark_workflow`: pid, host, start time), which its stages inherit; a stage whose
  named Snakemake is gone stops before any work, and the watchdog checks it too (:func:`workflow_gone`; a
  process of another host, a cluster job, is not checked).  ``XMC_ORPHAN_GUARD=0`` turns all three off.

* **Snakemake's locks.**  Snakemake records the files an invocation works on in ``.snakemake/locks``
  and removes them when it ends; a ``kill -9`` (or an out-of-memory kill, a power loss) leaves them,
  and the next plain ``snakemake`` then stops with ``LockException`` until someone runs ``--unlock``.
  The lock files say nothing about their owner, so :func:`claim_snakemake_folder` (called by the
  workflow's main process while it reads the Snakefile, before Snakemake takes its locks) registers
  the invocation in ``.snakemake/xmc-instances/`` (a file named by :func:`owner_tag`, holding the
  process's start time), removes the registrations of instances that are gone, and removes the lock
  files only when **no other registered invocation is alive** (every invocation registers before
  Snakemake locks, so the lock files are then an ended one's): each registered one on this host
  ended (its pid gone, or reused by a process that started later) and none registered from another
  host (a shared file system: its liveness cannot be seen from here).  Otherwise the locks stay and
  Snakemake's own message (and ``--unlock``) apply.  Reading: that is ``--unlock`` done for the user
  exactly when it cannot break a running invocation.  Snakemake 9 removes the whole ``locks``
  folder when *any* invocation ends (``FilePersistence._delete_locks``), so its locks never were a
  per-invocation guarantee; what protects concurrent invocations here is that they work on
  disjoint outputs (README, "Concurrent invocations").

* **stdout.**  :func:`stdout_to_stderr` sends file descriptor 1 to stderr for a while: native
  libraries (omikuji's Rust logger) write to the descriptor, below ``sys.stdout``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import socket
import sys
import threading
import zlib
from pathlib import Path
from typing import Iterator

__all__ = ["HOST", "owner_tag", "parse_owner_tag", "pid_alive", "pid_gone", "starter_chain", "chain_broken",
           "guard_against_orphaning", "guard_log", "stdout_to_stderr", "SHELLS", "COMMAND_WRAPPERS",
           "process_started", "claim_snakemake_folder", "snakemake_instances", "WORKFLOW_ENV", "mark_workflow",
           "workflow_gone"]

HOST = socket.gethostname()
_HOST_HASH = f"{zlib.crc32(HOST.encode('utf-8', 'replace')):08x}"

#: Shells: a wrapper when running a ``-c`` command string (as Snakemake runs a rule's shell line), the
#: starter when running a script, a terminal session when interactive.
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "ash", "busybox"})
#: Programs that only run the command after them (the process above them started the stage).
COMMAND_WRAPPERS = frozenset({"time", "env", "nice", "ionice", "timeout", "stdbuf", "taskset", "numactl"})


def owner_tag(pid: int | None = None) -> str:
    """``p<pid>-<host hash>``: who made a temporary file (part of its name)."""
    return f"p{os.getpid() if pid is None else int(pid)}-{_HOST_HASH}"


def parse_owner_tag(tag: str) -> tuple[int, bool] | None:
    """``(pid, made on this host)`` of an :func:`owner_tag`, or None if ``tag`` is not one."""
    if not tag.startswith("p") or "-" not in tag:
        return None
    pid, _, host = tag[1:].partition("-")
    if not pid.isdigit() or len(host) != 8:
        return None
    return int(pid), host == _HOST_HASH


def pid_alive(pid: int) -> bool:
    """True if a process ``pid`` exists on this machine (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # someone else's process: it exists
        return True
    try:
        import psutil

        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except Exception:  # noqa: BLE001 - psutil missing or the process just went: trust kill(0)
        return True


def pid_gone(pid: int, host: str | None = None) -> bool:
    """True only when the process ``pid`` of ``host`` (default: this one) has certainly ended."""
    if host is not None and host != HOST:
        return False
    return not pid_alive(pid)


def process_started(pid: int) -> float | None:
    """The start time (seconds since the epoch) of process ``pid`` on this machine, or None if unknown."""
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # noqa: BLE001 - gone, not ours to read, or no psutil
        return None


# --------------------------------------------------------------------------- orphans


#: the environment variable naming the Snakemake process that starts the stages (:func:`mark_workflow`)
WORKFLOW_ENV = "XMC_WORKFLOW"


def mark_workflow(pid: int | None = None) -> str:
    """Name process ``pid`` (default: this one, a Snakemake reading the Snakefile) in :data:`WORKFLOW_ENV` as
    ``<owner tag> <start time>``: the stages it starts inherit it and stop when that process is gone, even when
    it died before they could see their parent (:func:`workflow_gone`).  Returns the value."""
    pid = os.getpid() if pid is None else int(pid)
    value = f"{owner_tag(pid)} {process_started(pid) or 0:.3f}"
    os.environ[WORKFLOW_ENV] = value
    return value


def workflow_gone(value: str | None = None) -> str | None:
    """Why the Snakemake process named in :data:`WORKFLOW_ENV` (or ``value``) has ended, or None: it runs, the
    variable is unset or unreadable, or it names a process of another host (a cluster job: not visible here)."""
    value = os.environ.get(WORKFLOW_ENV, "") if value is None else value
    tag, _, started = value.partition(" ")
    owner = parse_owner_tag(tag)
    if owner is None or not owner[1]:
        return None
    pid = owner[0]
    if not pid_alive(pid):
        return f"the Snakemake process {pid} that started it has ended"
    now = process_started(pid)
    try:
        then = float(started)
    except ValueError:
        return None
    if then and now is not None and now > then + 1.0:
        return f"the Snakemake process {pid} that started it has ended (the pid now runs a later process)"
    return None


def _set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` on Linux; False (and nothing done) elsewhere or on failure."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(1, int(sig), 0, 0, 0) == 0          # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def _kind(p) -> str:
    """``wrapper``, ``terminal`` (an interactive shell) or ``starter`` (anything else) for a psutil Process."""
    try:
        cmd = p.cmdline()
    except Exception:  # noqa: BLE001 - gone or not ours to read
        cmd = []
    name = os.path.basename(cmd[0]) if cmd else p.name()
    name = name.lstrip("-")                                   # "-bash": a login shell
    if name in COMMAND_WRAPPERS:
        return "wrapper"
    if name not in SHELLS:
        return "starter"
    args = cmd[1:]
    if any(a.startswith("-") and not a.startswith("--") and "c" in a for a in args):
        return "wrapper"                                       # bash -c '...', sh -ec '...'
    if any(not a.startswith("-") for a in args):
        return "starter"                                       # bash run.sh: a script waits for the stage
    return "terminal"


def starter_chain(pid: int | None = None) -> list[tuple[int, float]]:
    """``(pid, create time)`` of the ancestors of ``pid`` (default: this process) from its parent up to
    and including the first that is not a command wrapper: the process that started the stage, and the
    wrappers between.  Empty when there is nothing to watch: no parent (pid 1), an interactive shell
    as the starter (a stage typed by hand), or no psutil."""
    try:
        import psutil

        chain = []
        for anc in psutil.Process(pid).parents():
            if anc.pid <= 1:
                return []
            kind = _kind(anc)
            if kind == "terminal":
                return []
            chain.append((anc.pid, anc.create_time()))
            if kind == "starter":
                return chain
        return []
    except Exception:  # noqa: BLE001 - no psutil, or the tree changed under us: nothing to watch
        return []


def chain_broken(me: int, chain: list[tuple[int, float]]) -> str | None:
    """Why the ancestor ``chain`` of process ``me`` (from :func:`starter_chain`) no longer holds, or None."""
    import psutil

    child = me
    for pid, created in chain:
        try:
            p = psutil.Process(child)
            if p.ppid() != pid:
                return f"process {child}'s parent {pid} is gone (re-parented to {p.ppid()})"
            anc = psutil.Process(pid)
            if anc.create_time() != created or anc.status() == psutil.STATUS_ZOMBIE:
                return f"process {pid} (an ancestor that started this stage) is gone"
        except psutil.NoSuchProcess:
            return f"process {pid} (an ancestor that started this stage) is gone"
        child = pid
    return None


class _Watchdog(threading.Thread):
    def __init__(self, chain: list[tuple[int, float]], interval: float, log: logging.Logger | None):
        super().__init__(name="xmc-orphan-watchdog", daemon=True)
        self.chain, self.interval, self.log = chain, interval, log
        self.stopped = threading.Event()

    def run(self) -> None:
        me = os.getpid()
        while not self.stopped.wait(self.interval):
            why = (chain_broken(me, self.chain) if self.chain else None) or workflow_gone()
            if why:
                msg = f"the process that started this stage died ({why}); stopping (SIGTERM)"
                if self.log is not None:
                    self.log.error("%s", msg)
                else:
                    print(f"error: {msg}", file=sys.stderr, flush=True)
                os.kill(me, signal.SIGTERM)
                return


_GUARD: list[_Watchdog] = []


def guard_against_orphaning(log: logging.Logger | None = None) -> bool:
    """End this process (``SIGTERM``) when the process that started it dies; see the module docstring.
    Idempotent; False when disabled (``XMC_ORPHAN_GUARD=0``) or when there is nothing to watch."""
    if os.environ.get("XMC_ORPHAN_GUARD", "1") == "0":
        return False
    if _GUARD and _GUARD[0].is_alive():
        return True
    gone = workflow_gone()
    if gone:                              # Snakemake died while this process was starting: do no work at all
        print(f"error: {gone}; stopping before any work (SIGTERM)", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
    chain = starter_chain()
    if not chain and not os.environ.get(WORKFLOW_ENV):
        return False
    if chain:
        _set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != chain[0][0]:       # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
    try:
        interval = max(0.05, float(os.environ.get("XMC_ORPHAN_POLL_S", "1")))
    except ValueError:
        interval = 1.0
    _GUARD[:] = [_Watchdog(chain, interval, log)]
    _GUARD[0].start()
    return True


def guard_log(log: logging.Logger | None) -> None:
    """Where the running guard reports an orphaning (the stage's log, once the stage has one)."""
    if _GUARD:
        _GUARD[0].log = log


# --------------------------------------------------------------------------- Snakemake's locks

#: Under Snakemake's state folder: one file per running invocation of this workflow.
INSTANCES = "xmc-instances"


def snakemake_instances(state: str | os.PathLike = ".snakemake") -> list[tuple[Path, int, bool, bool]]:
    """``(file, pid, on this host, alive)`` for each invocation registered under ``state``.  An instance
    of another host always counts as alive (its liveness cannot be seen from here); one of this host is
    alive while its pid runs a process that started no later than the registration says."""
    out = []
    folder = Path(state) / INSTANCES
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for f in sorted(folder.iterdir()):
            owner = parse_owner_tag(f.name)
            if owner is None:
                continue
            pid, here = owner
            alive = True
            if here:
                alive = pid_alive(pid)
                if alive:
                    with contextlib.suppress(OSError, ValueError):
                        registered = float(f.read_text().split()[0])
                        started = process_started(pid)
                        alive = started is None or started <= registered + 1.0   # a later process reused the pid
            out.append((f, pid, here, alive))
    return out


def claim_snakemake_folder(state: str | os.PathLike = ".snakemake", pid: int | None = None) -> list[str]:
    """Register invocation ``pid`` (default: this process) of the workflow under ``state``, forget the
    registered invocations that are gone, and remove Snakemake's lock files when no other registered
    invocation is alive (see the module docstring).  The registration is removed again when the
    process exits normally (``atexit``).  Returns what was done, one sentence each, for the log."""
    import atexit
    import time

    pid = os.getpid() if pid is None else int(pid)
    folder = Path(state) / INSTANCES
    mine = folder / owner_tag(pid)
    started = process_started(pid) or time.time()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        mine.write_text(f"{started:.3f} {HOST} {pid}\n")
    except OSError as e:            # a read-only checkout (--report, --dry-run): nothing to claim
        return [f"could not register this invocation under {folder} ({e}); Snakemake's locks are left as they are"]
    if pid == os.getpid():
        atexit.register(lambda: mine.unlink(missing_ok=True))
    notes, others_alive = [], []
    for f, opid, here, alive in snakemake_instances(state):
        if f == mine:
            continue
        if alive:
            others_alive.append(f"{opid}" + ("" if here else " on another host"))
        else:
            f.unlink(missing_ok=True)
            notes.append(f"forgot the Snakemake invocation {opid}, which ended without cleaning up")
    locks = sorted(Path(state, "locks").glob("*.lock"))
    if locks and not others_alive:
        for lock in locks:
            lock.unlink(missing_ok=True)
        notes.append(f"removed Snakemake's lock files {', '.join(l.name for l in locks)}, left by an invocation that "
                     "ended without removing them: no other invocation of this workflow is running in this folder")
    elif locks and others_alive:
        more = f" and {len(others_alive) - 3} more" if len(others_alive) > 3 else ""
        notes.append(f"kept Snakemake's lock files: invocation(s) {', '.join(others_alive[:3])}{more} may still be running")
    return notes


# --------------------------------------------------------------------------- stdout


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at stderr inside the block (what native code prints there goes to
    stderr), and back afterwards; Python's ``sys.stdout`` is flushed on both sides so that nothing
    written before the block ends up on stderr or after it on stdout."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:                      # no descriptor 1 (closed stdout): nothing to protect
        yield
        return
    try:
        sys.stderr.flush()
        os.dup2(2, 1)
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
