"""dp=2 steps where rank 1 stops itself (SIGSTOP) after step 2: a frozen worker, for
`meshfit run`'s report of it (hang stacks go to the directory given as argv[1])."""

import sys

import torch
from workers import hang_run

torch.set_num_threads(1)
hang_run("stop", 1, sys.argv[1])
