"""Run by the multi-node tests under `meshfit run` on every host of tests/cluster.py:
trains each spec of the JSON file argv[1] (workers.many_engine_runs) and rank 0 saves
the results to argv[2]; every rank also records its rank and MASTER_ADDR in argv[2] +
".rank<R>.json", so a test can see which ranks ran where."""

import json
import os
import sys

import torch
from workers import many_engine_runs

with open(sys.argv[1]) as f:
    specs = json.load(f)
results = many_engine_runs(specs)
rank = int(os.environ["RANK"])
where = {
    "rank": rank,
    "world": int(os.environ["WORLD_SIZE"]),
    "group_rank": int(os.environ["GROUP_RANK"]),
    "master_addr": os.environ["MASTER_ADDR"],
    "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
}
with open(f"{sys.argv[2]}.rank{rank}.json", "w") as f:
    json.dump(where, f)
if rank == 0:
    torch.save(results, sys.argv[2] + ".tmp")
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
