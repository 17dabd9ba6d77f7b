"""`scripts/walk_step.py`: following one engine step's `now` stays near a tree.

The figure (docs/DECODE_PATH.md) counts the returns to a file the walk had left; each new entry
point into a file costs two. A change that makes the engine enter the request table again, or a
part reach into the core through a second door, fails here with the crossings that came back.
"""

from __future__ import annotations

from pathlib import Path

from scripts import walk_step as ws

WALK_LIMIT = 10  # docs/DECODE_PATH.md, "Following one step"


def test_the_step_walk_comes_back_to_a_file_at_most_ten_times(tmp_path: Path) -> None:
    from decode_worker.device.default_model import write_model

    graph = ws.CallGraph(follow_now=True)
    ws.measure(write_model(tmp_path / "tiny", seed=0), ws.Tracer(graph))
    moves = ws.walk(graph)
    assert graph.root is not None and graph.root.co_name == "step"
    visited, back = ws.count_returns(ws.short(graph.root), moves)
    crossings = [m for m in moves if not m[3]]  # the calls into another file
    assert len(back) == 2 * len(crossings) - len(visited) + 1  # the docstring's identity
    assert {"daemon/decode/requests.py", "daemon/decode/stepper.py",
            "core/request.py"} <= visited  # the walk reached admission, decode and the core
    assert len(back) <= WALK_LIMIT, "\n".join(f"{s} -> {d} ({v})" for s, d, v, _ in back)
