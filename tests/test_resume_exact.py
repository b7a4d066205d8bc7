"""Issue 41 item 5: a 4-rank FSDP2 job saved whole (objects, per-rank RNG and data order) resumes bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from multiproc import run_torchrun

EXAMPLE = Path(__file__).parent.parent / "examples" / "resume_exact.py"


def _runs(directory: Path, name: str, world: int) -> list[dict]:
    return [json.loads((directory / f"run-{name}-rank{r}.json").read_text()) for r in range(world)]


def test_resume_at_4_ranks_equals_the_uninterrupted_run_and_2_ranks_follow_the_policy(tmp_path: Path) -> None:
    run_torchrun(EXAMPLE, 4, "--dir", str(tmp_path), "--steps", "8", "--save-at", "4", logs=tmp_path / "l1")
    run_torchrun(EXAMPLE, 4, "--dir", str(tmp_path), "--steps", "8", "--resume", logs=tmp_path / "l2")
    whole, resumed = _runs(tmp_path, "4ranks", 4), _runs(tmp_path, "resumed-4ranks-own", 4)
    for rank in range(4):
        assert list(resumed[rank]["losses"]) == ["5", "6", "7", "8"]
        for step, loss in resumed[rank]["losses"].items():
            assert loss == whole[rank]["losses"][step], (rank, step)
        assert resumed[rank]["rng"] == whole[rank]["rng"], rank  # every rank's RNG stream goes on as it would have
        assert resumed[rank]["data"] == whole[rank]["data"], rank  # and its data order
    assert len({json.dumps(r["rng"]) for r in whole}) == 4  # (the ranks' streams differ: per-rank state)

    # At 2 ranks the per-rank parts follow the load's policy: by default refused, naming them...
    with pytest.raises(AssertionError) as refused:
        run_torchrun(EXAMPLE, 2, "--dir", str(tmp_path), "--steps", "8", "--resume", logs=tmp_path / "l3")
    text = str(refused.value)
    assert "resume refused" in text
    assert "'data' is per rank, saved by 4 ranks, and this load runs on 2" in text
    # ...and with per_rank="keep" the model, optimizer and scheduler resume (resharded), the loader and RNG are fresh
    out = run_torchrun(
        EXAMPLE, 2, "--dir", str(tmp_path), "--steps", "8", "--resume", "--per-rank", "keep", logs=tmp_path / "l4"
    )
    assert "resumed step 4 saved by 4 ranks on 2" in out[0]
    kept = _runs(tmp_path, "resumed-2ranks-keep", 2)
    assert list(kept[0]["losses"]) == ["5", "6", "7", "8"]
