"""The torchtitan backend (``pytreeckpt.integrations.torchtitan``): torchtitan's llama3 debug model on gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("triton", reason="torchtitan's llama3 model imports triton (in the test extras)")

import torchtitan_workers as w
from multiproc import run_world


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("torchtitan")
    return base, run_world(4, w.save_and_resume, str(base))


def test_resumed_at_four_ranks_the_losses_are_those_of_the_uninterrupted_run(
    saved: tuple[Path, list[dict[str, Any]]],
) -> None:
    base, results = saved
    for r in results:
        assert r["first"] == r["full"][: w.STOP]
        assert r["resumed"] == r["full"][w.STOP :]  # bit for bit
        assert r["ntokens_seen"] == w.STEPS * w.BATCH * w.SEQ
    # saved every step, the latest 2 kept (the last step's, the model only, purges nothing, as with DCP)
    assert sorted(p.name for p in (base / "checkpoint").iterdir()) == ["step-4", "step-5", "step-6"]


def test_resumed_at_two_ranks_it_loads_and_trains_on(saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    base, four = saved
    results = run_world(2, w.resume_at_two, str(base), str(tmp_path))
    assert results[0]["hf"]
    for r in results:
        # the last step's model, saved in bfloat16, as an initial load: the model alone
        assert r["loaded_initial"] is True
        assert r["initial_step"] == 0
        assert r["initial_model"] == four[0]["last_model"]
        # saved again at the last step, as Hugging Face safetensors in bfloat16
        if r["hf"]:
            assert r["hf"]["model.embed_tokens.weight"] == (
                "torch.bfloat16",
                r["initial_model"]["tok_embeddings.weight"],
            )
            assert r["hf"]["model.layers.1.mlp.down_proj.weight"] == (
                "torch.bfloat16",
                r["initial_model"]["layers.1.feed_forward.w2.weight"],
            )
            assert len(r["hf"]) == 2 + 9 * 2 + 1  # embeddings, lm_head, 9 per layer (q, k, v apart), norm
        # step 4, the LR scheduler excluded
        assert r["step"] == w.STOP
        assert r["ntokens_seen"] == w.STOP * w.BATCH * w.SEQ
        assert r["last_epoch"] == 0
        assert len(r["losses"]) == w.STEPS - w.STOP
        assert all(0 < x < 20 for x in r["losses"])
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-6"]
    assert sorted(p.name for p in (tmp_path / "checkpoint" / "step-6").iterdir()) == ["model.safetensors"]
    # load_only: nothing saved
    assert sorted(p.name for p in (base / "checkpoint").iterdir()) == ["step-4", "step-5", "step-6"]


def test_only_the_folders_it_names_are_steps_a_foreign_name_is_neither_loaded_nor_purged(tmp_path: Path) -> None:
    import torch

    import pytreeckpt
    from pytreeckpt.integrations.torchtitan import CheckpointManager

    folder = tmp_path / "checkpoint"
    names = ["step-0999", "step-\u0663", "step-1", "step-2"]  # 999 and 3 to `\d+`: newer than the real steps
    for name in names:
        pytreeckpt.save(folder / name, {"w": torch.zeros(1)})
    m = CheckpointManager(
        CheckpointManager.Config(enable=True, keep_latest_k=2),
        dataloader=None,
        model_parts=[torch.nn.Linear(2, 2)],
        optimizers=None,  # type: ignore[arg-type]
        lr_schedulers=None,  # type: ignore[arg-type]
        states={},
        sd_adapter=None,
        base_folder=str(tmp_path),
    )
    try:
        assert m._find_load_step() == 2
        m._purge_stale_checkpoints(3)  # (step 3 being saved: step 1 goes)
    finally:
        m.close()
    assert sorted(p.name for p in folder.iterdir()) == sorted(["step-0999", "step-\u0663", "step-2"])
