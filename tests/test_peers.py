"""PeerTierManager: each node's steps in its own directory, replicated to a peer node; a lost node restores from it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from multiproc import run_world
from peer_workers import peer_restore, peer_save

import pytreeckpt


def test_a_lost_node_restores_from_its_peer_and_without_a_replica_from_the_durable_tier(tmp_path: Path) -> None:
    local, durable = tmp_path / "local", tmp_path / "durable"
    saved = run_world(4, peer_save, str(local), str(durable), 4)
    assert saved[0]["tiers"] == {1: ("local",), 2: ("local",), 3: ("local", "durable"), 4: ("local",)}
    assert saved[0]["steps"] == {"peers": [3, 4], "durable": [3]}
    # each node's own steps, and the other node's as a replica
    assert sorted(p.name for p in (local / "node0").iterdir()) == ["replicas", "step_3", "step_4"]
    assert sorted(p.name for p in (local / "node0" / "replicas" / "node_1").iterdir()) == ["step_3", "step_4"]
    assert sorted(p.name for p in (local / "node1" / "replicas" / "node_0").iterdir()) == ["step_3", "step_4"]

    shutil.rmtree(local / "node1")  # node 1 is lost: a new machine, its ranks restarted
    restored = run_world(4, peer_restore, str(local), str(durable))
    for rank, r in enumerate(restored):
        assert (r["step"], r["tier"], r["sources"]) == (4, "peers", {0: "local", 1: "node 0"}), r
        assert r["w"], r
        assert r["w_is_shard"], r
        assert r["model"], r
        assert r["rng"] == [100.0 * rank + 4] * 2
        assert r["durable_opened"] == 0  # durable storage not read
        assert r["warnings"] == []
    assert "step_4" in restored[2]["local"]  # node 1's part is back in its own directory

    # Lost again; this time node 0's replica of node 1's step 4 is damaged (a flipped bit) and of step 3 gone.
    shutil.rmtree(local / "node1")
    _flip_shards(local / "node0" / "replicas" / "node_1" / "step_4", step=4, ranks=(2, 3))
    shutil.rmtree(local / "node0" / "replicas" / "node_1" / "step_3")
    restored = run_world(4, peer_restore, str(local), str(durable))
    for rank, r in enumerate(restored):
        assert (r["step"], r["tier"]) == (3, "durable"), r
        assert r["w"], r
        assert r["model"], r
        assert r["rng"] == [100.0 * rank + 3] * 2
        assert r["durable_opened"] > 0
        assert len(r["warnings"]) == 2, r["warnings"]
        assert "step 4 of peers does not load" in r["warnings"][0]
        assert "node 1 lacks steps [3]" in r["warnings"][1]
    assert "damaged" in restored[2]["warnings"][0]  # (the ranks that read it name the damage)


def _flip_shards(step_dir: Path, step: int, ranks: tuple[int, ...]) -> None:
    """Flip a byte of each of ``ranks``' shards of ``w`` where the files of ``step_dir`` hold it."""
    full = (torch.arange(4 * 8 * 4, dtype=torch.float32).reshape(4 * 8, 4) + step).numpy()
    found = 0
    for f in (p for p in step_dir.rglob("*") if p.is_file()):
        data = bytearray(f.read_bytes())
        for r in ranks:
            at = data.find(full[r * 8 : (r + 1) * 8].tobytes())
            if at >= 0:
                data[at + 5] ^= 0xFF
                found += 1
        f.write_bytes(bytes(data))
    assert found == len(ranks)


def test_peers_need_more_nodes_and_nodes_must_divide_the_ranks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"peers=1: .* 1 node\(s\) \(1 ranks\); peers must be between 0 and 0"):
        pytreeckpt.PeerTierManager(tmp_path / "l", tmp_path / "d", durable_interval_steps=2)
    with pytest.raises(ValueError, match=r"peers=2: .* 2 node\(s\) \(4 ranks\)"):
        pytreeckpt.manager._peers.node_layout(4, 2, ranks_per_node=2)
    with pytest.raises(ValueError, match="ranks_per_node=3 does not divide the 4 ranks"):
        pytreeckpt.manager._peers.node_layout(4, 1, ranks_per_node=3)
    assert pytreeckpt.manager._peers.node_layout(4, 1, node_ids=[7, 7, 9, 9]) == [7, 7, 9, 9]


def test_without_peers_a_single_process_keeps_a_local_tier_over_the_durable_one(tmp_path: Path) -> None:
    with pytreeckpt.PeerTierManager(tmp_path / "l", tmp_path / "d", peers=0, durable_interval_steps=2) as m:
        for step in range(1, 4):
            m.save(step, {"w": torch.full((3,), float(step))})
        assert m.all_steps() == {"peers": [2, 3], "durable": [2]}
        assert m.restore()["w"].tolist() == [3.0] * 3
    shutil.rmtree(tmp_path / "l")
    with (
        pytreeckpt.PeerTierManager(tmp_path / "l", tmp_path / "d", peers=0, durable_interval_steps=2) as m,
    ):
        assert m.restore()["w"].tolist() == [2.0] * 3
        assert m.last_restored_tier == "durable"
