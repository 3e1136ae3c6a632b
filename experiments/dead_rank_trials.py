"""How often the dead-rank watcher names a killed MPI rank alone: ``python experiments/dead_rank_trials.py [-n 20]``.

Each trial starts ``mpiexec -n 3 fedlayer run`` (FedACnnL, 12 clients) with client 3
held in layer 1 on rank 2, waits until the host's watcher has opened its
handles, kills rank 2 with SIGKILL (as the OOM killer would) and reads the
line the watcher printed: the rank alone, or several "ended together". Prints
the count and each trial's line. Needs Linux (/proc, pidfds) and mpiexec on
PATH or beside the Python executable.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from fedlayer.mpi._rankwatch import processes_with_env

# fedlayer with test hooks: the entry script holds client 3 in its first sum (FEDLAYER_TEST_HANG_CLIENT)
FAULTS_ENTRY = Path(__file__).resolve().parents[1] / "tests" / "fedlayer" / "mpi" / "mpi_faults_entry.py"


def _watching(pid, handles):
    """Whether the watcher ``pid`` holds at least ``handles`` pidfds or pipes (its handles on the ranks)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd")) >= handles
    except OSError:
        return False


def trial(mpiexec):
    token = uuid.uuid4().hex
    env = {**os.environ, "DEAD_RANK_TRIAL": token, "FEDLAYER_TEST_HANG_CLIENT": "3"}
    cmd = [mpiexec, "-n", "3", sys.executable, str(FAULTS_ENTRY), "run", "--algorithm", "fedacnnl", "--clients", "12",
           "--model", "dnn", "--quiet", "--mpi-deadline", "120"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    victim, deadline = None, time.monotonic() + 60
    while victim is None and time.monotonic() < deadline and proc.poll() is None:
        job = processes_with_env("DEAD_RANK_TRIAL", token)
        ranks = {rank: pid for pid, (rank, cmdline) in job.items() if "_rankwatch" not in cmdline}
        watcher = [pid for pid, (_, cmdline) in job.items() if "_rankwatch" in cmdline]
        if "2" in ranks and watcher and _watching(watcher[0], 3 + 6):  # stdio + a pidfd and a pipe per rank
            victim = ranks["2"]
        else:
            time.sleep(0.1)
    if victim is None:
        proc.kill()
        return False, "rank 2 or the watcher never started"
    time.sleep(0.5)
    os.kill(victim, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    line = next((text for text in stderr.splitlines() if "without an error of their own" in text), "(no line)")
    return f"MPI rank 2 (pid {victim}" in line and "together" not in line, line


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20, help="trials")
    args = parser.parse_args()
    mpiexec = shutil.which("mpiexec") or shutil.which("mpiexec", path=str(Path(sys.executable).parent))
    if mpiexec is None:
        sys.exit("mpiexec not found on PATH or beside the Python executable")
    results = [trial(mpiexec) for _ in range(args.n)]
    print(f"{sum(alone for alone, _ in results)} of {args.n} trials named the killed rank alone")
    for alone, line in results:
        print(("alone    " if alone else "not alone") + "  " + line[:200])


if __name__ == "__main__":
    main()
