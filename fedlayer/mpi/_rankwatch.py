"""Name the MPI rank that died: a watcher process beside each host's ranks.

When a rank dies outside Python's control (the OOM killer, ``kill -9``, a
crash in compiled code), mpiexec ends every other rank at once and prints a
PID that is not always the dead rank's (MPICH's Hydra often names rank 0's).
No rank can report it: the launcher kills them within milliseconds.

So every host's first rank starts this watcher, in a session of its own
(the launcher's cleanup does not reach it), with the world rank and PID of
each rank on the host. It waits on their pidfds (Linux >= 5.3) without
using the CPU. A rank whose end fedlayer explains (it finished, or it
printed its own error before stopping the job) leaves a marker file first,
and a rank that aborts the job after printing why leaves one that covers
every rank on its host; the first rank that ends *without* a marker is
named on stderr, with how it ended when the kernel still shows it (all of
them, if several were already gone, or had begun to exit, when the watcher
woke: on a loaded machine the launcher's cleanup can be that quick, and a
rank killed first can still be tearing down its memory when one killed after
it has ended). On a job over several
hosts, each host names the first of its own ranks to end: the earliest
time is the rank that died, the others are the launcher's cleanup (after a
deliberate abort, the error rank 0 printed says so).

When the job is over, the watcher unlinks the /dev/shm files its ranks
mapped that are still there: MPICH's shared-memory segments, which a
killed or aborted job leaves behind in RAM.

Each rank also holds a pipe open for its life (its "lifeline", opened
here through /proc/PID/fd): a killed rank closes it in the first steps of
its exit, before the launcher can react, where its pidfd signals only once
its teardown is over.

Run as a script (``python _rankwatch.py MARKER_DIR HOST RANK:PID[:FD] ...``): it
imports nothing but the standard library.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import time


def processes_with_env(name: str, value: str) -> dict[int, tuple[str | None, str]]:
    """{pid: (its PMI_RANK or None, its command line)} of the live processes whose environment sets name=value.

    How the dead-rank tests and ``experiments/dead_rank_trials.py`` find one job's ranks and watcher.
    """
    found, wanted = {}, f"{name}={value}".encode()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(os.path.join(entry.path, "environ"), "rb") as f:
                    environ = f.read().split(b"\0")
                with open(os.path.join(entry.path, "cmdline"), "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if wanted in environ:
                rank = next((v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"PMI_RANK=")), None)
                found[int(entry.name)] = (rank, cmdline)
    return found


def _stat_fields(pid):
    """Fields 3... of /proc/PID/stat (fields[0] is the state), or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _how_it_ended(pid):
    """'killed by signal 9 (SIGKILL)' / 'exit status 1' while the process is a zombie, else None."""
    fields = _stat_fields(pid)
    # exit_code is field 52 of proc(5), a waitpid status.
    if fields is None or fields[0] != "Z" or len(fields) < 50:
        return None
    status = int(fields[49])
    if status & 0x7F:
        number = status & 0x7F
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = "unknown"
        return f"killed by signal {number} ({name})"
    return f"exit status {(status >> 8) & 0xFF}"


# The kernel's PF_EXITING flag (field 9 of /proc/PID/stat): the process has begun to exit.
_PF_EXITING = 0x4


def _exiting(pid):
    """Whether process ``pid`` has begun to exit (or is gone) but may not have signalled its pidfd yet."""
    fields = _stat_fields(pid)
    return fields is None or fields[0] in ("Z", "X") or bool(int(fields[6]) & _PF_EXITING)


def _wake_first():
    """Ask the scheduler to run this (sleeping) watcher ahead of the ranks when a pidfd wakes it.

    MPICH's ranks busy-poll every core, and the watcher, woken by a dying
    rank's pidfd, could run only after the launcher had already killed the
    others: then it can only list them together. A real-time policy (or,
    failing that, a higher priority) lets it see the first death alone. It
    costs nothing while it sleeps in poll(). Without the privilege to change
    either (CAP_SYS_NICE), the watcher keeps its default priority.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    except (AttributeError, OSError):
        pass


def watch(marker_dir: str, host: str, ranks: list[tuple[int, ...]]) -> None:
    """Wait for every (rank, pid[, lifeline fd]) of ``ranks`` to end; name on stderr the first that ends unexplained.

    ``marker_dir`` holds the markers of the ranks whose end is explained, and is removed when all have ended;
    ``host`` names this host in the message.
    """
    _wake_first()
    try:
        _watch(marker_dir, host, ranks)
    finally:
        shutil.rmtree(marker_dir, ignore_errors=True)


def _open_lifeline(pid, fd_number):
    """This watcher's own read end of rank ``pid``'s lifeline pipe (its fd ``fd_number``), or None."""
    if fd_number is None:
        return None
    try:
        return os.open(f"/proc/{pid}/fd/{fd_number}", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None


def _watch(marker_dir, host, ranks):
    poller = select.poll()
    fds, gone = {}, []
    for rank, pid, *lifeline in ranks:
        # Both the rank's lifeline and its pidfd: the lifeline closes first when the rank dies, the pidfd
        # still tells if a process the rank forked kept the lifeline open.
        handles = [_open_lifeline(pid, lifeline[0] if lifeline else None)]
        try:
            handles.append(os.pidfd_open(pid))
        except ProcessLookupError:
            gone.append((rank, pid, None))  # ended before the watcher started: its lifeline says nothing more
            if handles[0] is not None:
                os.close(handles[0])
            continue
        except (AttributeError, OSError):
            pass  # no pidfds on this system: the lifeline alone, if any
        handles = [fd for fd in handles if fd is not None]
        if not handles:
            return  # neither can be watched here
        for fd in handles:
            fds[fd] = (rank, pid)
            poller.register(fd, select.POLLIN)
    segments = _shared_memory_files(pid for _, pid, *_ in ranks)
    pending, named = gone, False
    while fds or pending:
        if not pending:
            # Once a rank is named, the launcher kills the rest within moments: wait for them a little,
            # then clean up after the job.
            woken = [fd for fd, _ in poller.poll(_AFTER_DEATH_MS if named else None)]
            if named and not woken:
                break
            # A rank killed first can still be tearing down its memory when a rank the launcher killed
            # after it has ended. Ranks already exiting when the watcher wakes ended with the woken ones.
            woken += [fd for fd, (_, pid) in fds.items() if fd not in woken and _exiting(pid)]
            ended = {fds[fd] for fd in woken}
            for fd, who in list(fds.items()):  # a rank's other handle goes with it
                if who in ended:
                    del fds[fd]
                    poller.unregister(fd)
                    os.close(fd)
            # how it ended: read before the launcher reaps the zombie, if quick
            pending.extend((rank, pid, _how_it_ended(pid)) for rank, pid in sorted(ended))
        unexplained = [(rank, pid, how) for rank, pid, how in pending
                       if not any(os.path.exists(os.path.join(marker_dir, name)) for name in (str(rank), "abort"))]
        pending = []
        if unexplained and not named:
            _name(host, sorted(unexplained))
            named = True
    if named or not fds:
        # Every rank has ended (or one died and the rest had 30 s to follow): what the job mapped under
        # /dev/shm and is still there, MPICH left behind. After an orderly end there is nothing left.
        _remove(segments)


# How long the watcher waits for the other ranks of a job whose rank died before it cleans up (ms).
_AFTER_DEATH_MS = 30_000


def _shared_memory_files(pids):
    """The /dev/shm files the ranks map (MPICH's shared-memory segments, e.g. mpich_shm_*)."""
    files = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    fields = line.split(None, 5)  # address, perms, offset, dev, inode, path (if any)
                    if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                        files.add(fields[5].strip())
        except OSError:
            pass
    return sorted(path for path in files if not path.endswith(" (deleted)"))


def _remove(paths):
    """Unlink the shared-memory files a killed job leaves (its launcher never does): they hold RAM.

    Only the name goes: a process that still maps one keeps its memory.
    """
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass  # already removed, by MPICH or another watcher of the job


def _name(host, ended):
    """Print which rank(s) ended unexplained; several when they ended before the watcher could tell them apart."""
    now = time.time()
    when = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
    who = ", ".join(f"rank {rank} (pid {pid}{f', {how}' if how else ''})" for rank, pid, how in ended)
    first = (f"MPI {who} on {host} ended" if len(ended) == 1 else
             f"MPI {who} on {host} ended together (one of them first; the watcher woke too late to tell which)")
    try:
        print(f"fedlayer: {first} at {when}, before the job finished and without an error of their own. mpiexec "
              f"then stops the other ranks; its message may name another PID.", file=sys.stderr, flush=True)
    except OSError:
        pass  # the launcher's end of stderr is gone


if __name__ == "__main__":
    marker_dir, host, *pairs = sys.argv[1:]
    watch(marker_dir, host, [tuple(int(x) for x in pair.split(":")) for pair in pairs])  # RANK:PID[:LIFELINE FD]
