"""Packed upper triangle vs full G over MPI: ``mpiexec -n 2 python experiments/mpi_pack.py``.

Per round: rank 0 asks rank 1 for G (float64, d x d, upper triangle only, as
the clients leave it); rank 1 flattens it (packing when asked) and sends the
header and raw buffers; rank 0 receives and unpacks. Prints the median
seconds per round, packed vs full.
"""
import sys
import time

import numpy as np
from mpi4py import MPI

from fedlayer.mpi import wire

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
sizes = [int(a) for a in sys.argv[1:]] or [785, 4609]
for d in sizes:
    rounds = 30 if d < 2000 else 6
    for pack in (False, True):
        if rank == 1:
            G = np.triu(np.random.default_rng(d).standard_normal((d, d)))
            for _ in range(rounds):
                comm.recv(source=0, tag=1)
                payload = wire.Payload()
                skeleton = payload.flatten({"G": G}, packed_keys=("G",) if pack else ())
                comm.send({"result": skeleton, "arrays": payload.descs}, dest=0, tag=2)
                wire.send_buffers(comm, payload.arrays, 0, 3, wire.CHUNK_BYTES, blocking=True)
        else:
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                comm.send("go", dest=1, tag=1)
                header = comm.recv(source=1, tag=2)
                buffers, requests = wire.post_receives(comm, header["arrays"], 1, 3, wire.CHUNK_BYTES)
                MPI.Request.Waitall(requests)
                G = wire.inflate(header["result"], wire.unwire(buffers, header["arrays"]))["G"]
                times.append(time.perf_counter() - start)
            print(f"d={d:5d} {'packed' if pack else 'full  '}: median {np.median(times) * 1e3:8.2f} ms/round, "
                  f"min {min(times) * 1e3:8.2f} ms ({G.nbytes / 2**20:.0f} MiB dense)", flush=True)
        comm.Barrier()
