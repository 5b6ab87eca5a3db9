"""Elastic runs (`meshfit run --nnodes MIN:MAX`): the group shrinks when a node is lost
and grows when one joins, and the run goes on as the one that never changed.

The mechanics are torch's: torchrun's elastic agent over meshfit's signed dynamic
rendezvous (rendezvous.py) re-forms the group with whatever nodes are alive, from MIN
up to MAX, and restarts the workers. What meshfit adds is in the workers:

- the plan is fitted to the new world size: "auto" runs the planner again; a fixed plan
  keeps its fsdp, tp and pp and changes dp (topology.fit_plan), or is refused in one line;
- fit resumes from the newest checkpoint in the new layout (DCP reshards) with the same
  global batch, so the data order, learning-rate schedule and step count go on unchanged;
- the resume says what changed: the world size, the plan and how many steps were redone
  (rank 0 records the last step it finished in `<checkpoint_dir>/reached.json`), in the
  start-up line and in History.world_changes.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from meshfit.errors import MeshfitError
from meshfit.plan import Plan

ELASTIC_ENV = "MESHFIT_ELASTIC"  # "MIN:MAX" nodes, set by meshfit run for its workers
REACHED_FILE = "reached.json"

# The rendezvous settings of an elastic run unless the user gives --rdzv-conf: a lost
# node is noticed by its missing heartbeat after interval x attempts seconds (torch's
# 5 x 3), and a re-formed group waits last_call seconds for more nodes once MIN are
# there (torch's 30 s, which every recovery would pay).
ELASTIC_RDZV_CONF = {"keep_alive_interval": 2, "keep_alive_max_attempt": 3, "last_call_timeout": 5}


def parse_nnodes(text: str | int, where: str = "--nnodes") -> tuple[int, int]:
    """`--nnodes N` or `--nnodes MIN:MAX` as (MIN, MAX); `where` names the option in an
    error (a run file's `nnodes = ...`, say)."""
    raw = str(text).strip()
    low, sep, high = raw.partition(":")
    try:
        nodes = (int(low), int(high)) if sep else (int(raw), int(raw))
    except ValueError:
        raise MeshfitError(
            f"{where} takes a number of nodes (2) or MIN:MAX for an elastic run (2:4), not {raw!r}"
        ) from None
    if nodes[0] < 1 or nodes[1] < nodes[0]:
        raise MeshfitError(f"{where} {raw}: MIN must be at least 1 and MAX at least MIN (e.g. 2:4)")
    return nodes


def elastic_nodes(environ: Any = os.environ) -> tuple[int, int] | None:
    """(MIN, MAX) in a worker of an elastic run, else None."""
    text = environ.get(ELASTIC_ENV)
    return parse_nnodes(text) if text else None


@dataclass(frozen=True)
class WorldChange:
    """A resume into another world: at which step, from what to what, and the steps the
    lost world had finished after that checkpoint (trained again now)."""

    step: int
    world: tuple[int, int]  # processes before, after
    plan: tuple[str, str]  # before, after
    redone: int | None  # None: not recorded (a run that was not elastic)

    def describe(self) -> str:
        text = f"world {self.world[0]} -> {self.world[1]} processes"
        if self.redone is None:
            return text
        return text + f" ({self.redone} step{'s' if self.redone != 1 else ''} redone)"

    def as_record(self) -> dict[str, Any]:
        """As JSON keeps it in a checkpoint (pairs as lists)."""
        return {**asdict(self), "world": list(self.world), "plan": list(self.plan)}


# What gloo and NCCL say when a peer process or its host went away mid-collective.
LOST_PEER_WORDS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
    "No route to host",
    "ncclRemoteError",
)


def peer_failure_word(exc: BaseException) -> str | None:
    """The words by which `exc` says a peer process or its host went away mid-collective
    (it was killed, crashed or became unreachable), or None. Only a RuntimeError of a
    collective counts: raised in torch.distributed, or naming gloo or NCCL (an OSError
    such as a refused connection of the user's own code is not a lost peer)."""
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    word = next((w for w in LOST_PEER_WORDS if w in text), None)
    if word is None:
        return None
    if "gloo" in text or "nccl" in text.lower() or _raised_in_torch_distributed(exc):
        return word
    return None


def _raised_in_torch_distributed(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if f"torch{os.sep}distributed{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def lost_peer_line(exc: BaseException) -> str | None:
    """In a worker of an elastic run, the one line for a collective that failed because
    a peer was lost (the agent then re-forms the group), else None: the traceback of
    every survivor would say nothing the next line does not."""
    if elastic_nodes() is None:
        return None
    word = peer_failure_word(exc)
    if word is None:
        return None
    rank = os.environ.get("RANK", "?")
    return (
        f"rank {rank} lost a peer in a collective ({word}); the elastic agent re-forms the "
        f"group and the run resumes from its newest checkpoint"
    )


def record_reached(checkpoint_dir: str, step: int) -> None:
    """Rank 0 of an elastic run: the last step this run finished (read by the next
    resume, to count the steps it redoes). Replaced atomically; a few bytes per step.
    Best effort: a count it cannot write is unknown, never a failed run (a full disk
    stops the run at the next checkpoint, on every rank, as it should)."""
    path = os.path.join(checkpoint_dir, REACHED_FILE)
    tmp = f"{path}.tmp"
    try:
        os.makedirs(checkpoint_dir, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump({"step": step}, f)
        os.replace(tmp, path)
    except OSError:
        pass


def read_reached(checkpoint_dir: str) -> int | None:
    try:
        with open(os.path.join(checkpoint_dir, REACHED_FILE)) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def world_change(
    meta: dict[str, Any], plan: Plan, world_size: int, checkpoint_dir: str
) -> WorldChange | None:
    """The change a resume from the checkpoint `meta` into this world makes, or None
    when the world is the one it was saved in."""
    before = meta.get("world_size")
    if before is None or before == world_size:
        return None
    step = int(meta["step"])
    reached = read_reached(checkpoint_dir)
    redone = max(0, reached - step) if reached is not None else None
    return WorldChange(step, (int(before), world_size), (str(meta.get("plan")), str(plan)), redone)
