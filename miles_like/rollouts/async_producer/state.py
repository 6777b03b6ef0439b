"""The producer's part of a checkpoint (state.json's `async`), and starting from it.

Taken between `pause` and `resume`, when no request runs: the open groups (index order) with
their tokens, log-probs and versions, the buffer (completion order), and the indices filtered
after the step's take (the next row reports them). A buffered agent group is saved with its
trajectories and scored again at the resume; an agent group still running is saved as its
prompt and restarts from it (`agents.py`).
"""

from __future__ import annotations

from miles_like.rollouts import agents as agent_groups
from miles_like.rollouts.async_producer.buffer import Buffer
from miles_like.rollouts.async_producer.ledger import GroupInProgress, Ledger
from miles_like.rollouts.partial import OpenGroup, from_state, to_state


def checkpoint_state(ledger: Ledger) -> dict:
    """JSON-ready: the open groups (index order) and the buffer (completion order)."""
    assert not ledger.taken, "a checkpoint with a batch taken ahead would not hold it"
    ids = sorted(ledger.open)
    open_rows = to_state([ledger.open[i].group for i in ids])
    buffer_rows = to_state([d.group for d in ledger.buffered])
    agents = sorted(ledger.agents)  # restart from their prompts
    open_rows += to_state([OpenGroup(ledger.agents[i].problem, ()) for i in agents])
    for d, row in zip(ledger.buffered, buffer_rows):
        if d.trajectories is not None:
            row["trajectories"] = [agent_groups.trajectory_to_state(t) for t in d.trajectories]
            row["oldest"] = d.oldest
    return {
        "open": [{**row, "index": i} for i, row in zip(ids + agents, open_rows)],
        "buffer": [{**row, "index": d.index} for d, row in zip(ledger.buffered, buffer_rows)],
        # filtered after this step's take: the next row reports them
        "dynamic_filtered": list(ledger.filtered),
    }


def restore(state: dict, ledger: Ledger, buffer: Buffer, agents, log) -> None:
    """`checkpoint_state`'s groups back in `ledger` (buffered ones scored again); `agents`:
    the producer's `AgentGroups`, or None (single-turn)."""
    for row in state["open"]:
        (group,) = from_state([row])
        if agents is not None:  # restarts from its prompt
            ledger.agents[row["index"]] = agents.group(row["index"], group.problem)
        else:
            ledger.open[row["index"]] = GroupInProgress(row["index"], group)
    for row in state["buffer"]:
        (group,) = from_state([row])
        if "trajectories" in row:
            trajectories = [agent_groups.trajectory_from_state(t) for t in row["trajectories"]]
            buffer.complete_agent(row["index"], group, trajectories, {}, row["oldest"])
        else:
            buffer.complete(row["index"], group)
    if ledger.agents:
        log(
            f"resume: the {len(ledger.agents)} agent groups running at the checkpoint "
            "restart from their prompts"
        )
    ledger.filtered = list(state.get("dynamic_filtered", []))
