"""Joins the process group, then holds it for HOLD_S seconds (default 2) and exits:
a run whose sockets a test can look at."""

import os
import time

import torch
import torch.distributed as dist

from meshfit.launch.process_group import init_distributed

torch.set_num_threads(1)
init_distributed()
dist.barrier()
time.sleep(float(os.environ.get("HOLD_S", "2")))
dist.barrier()
