"""Does the group re-form after a worker is killed? Run under the launcher:

    meshfit run --nproc 2 --max-restarts 1 benchmarks/restart_probe.py          # meshfit start-up
    meshfit run --nproc 2 --max-restarts 1 benchmarks/restart_probe.py --raw    # plain env://

On the first attempt rank 1 SIGKILLs itself after joining the group; the launcher restarts
both workers. Exit status 0 and "re-formed" from rank 0 mean the second attempt worked.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import meshfit as mf

attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
rank = int(os.environ["RANK"])
if "--raw" in sys.argv:
    dist.init_process_group("gloo")
else:
    mf.mesh.init_distributed()
if attempt == "0" and rank == 1:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
x = torch.ones(1)
for _ in range(20):
    dist.all_reduce(x)
    time.sleep(0.05)
if rank == 0:
    print(f"re-formed on attempt {attempt}: all-reduce gives {x.item():.0f}", flush=True)
dist.destroy_process_group()
