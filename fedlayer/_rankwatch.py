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
named on stderr, with how it ended when the kernel still shows it. On a
job over several hosts, each host names the first of its own ranks to end:
the earliest time is the rank that died, the others are the launcher's
cleanup (after a deliberate abort, an error printed by rank 0 says so).

Run as a script (``python _rankwatch.py MARKER_DIR HOST RANK:PID ...``): it
imports nothing but the standard library.
"""

import os
import select
import shutil
import signal
import sys
import time


def _how_it_ended(pid):
    """'killed by signal 9 (SIGKILL)' / 'exit status 1' while the process is a zombie, else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # fields[0] is the state (field 3 of proc(5)); exit_code is field 52, a waitpid status.
    if fields[0] != "Z" or len(fields) < 50:
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


def watch(marker_dir, host, ranks):
    """Wait for every (rank, pid) in ``ranks`` to end; name on stderr the first that ends unexplained."""
    if not hasattr(os, "pidfd_open"):
        return
    poller = select.poll()
    fds, gone = {}, []
    for rank, pid in ranks:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            gone.append((rank, pid))  # ended before the watcher started
            continue
        fds[fd] = (rank, pid)
        poller.register(fd, select.POLLIN)
    named = False

    def ended(rank, pid, how):
        nonlocal named
        if named or any(os.path.exists(os.path.join(marker_dir, name)) for name in (str(rank), "abort")):
            return
        named = True
        when = time.strftime("%H:%M:%S", time.localtime()) + f".{int(time.time() * 1000) % 1000:03d}"
        print(f"fedlayer: MPI rank {rank} (pid {pid} on {host}) ended at {when} before the job finished"
              f"{f' ({how})' if how else ''}, without an error of its own: it died. mpiexec then stops the "
              f"other ranks; its message may name another PID.", file=sys.stderr, flush=True)

    for rank, pid in gone:
        ended(rank, pid, None)
    while fds:
        ready = [fd for fd, _ in poller.poll()]
        for fd in sorted(ready, key=lambda fd: fds[fd][0]):
            rank, pid = fds.pop(fd)
            poller.unregister(fd)
            how = _how_it_ended(pid)  # before the launcher reaps the zombie, if we are quick enough
            os.close(fd)
            ended(rank, pid, how)
    shutil.rmtree(marker_dir, ignore_errors=True)


if __name__ == "__main__":
    marker_dir, host, *pairs = sys.argv[1:]
    watch(marker_dir, host, [tuple(int(x) for x in pair.split(":")) for pair in pairs])
