"""PeerTierManager: each node's steps in its own directory, replicated to a peer node; a lost node restores from it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from multiproc import run_world
from peer_workers import hostile_files, hostile_peer, peer_restore, peer_save, two_nodes

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


def test_names_a_hostile_peer_sends_that_lead_outside_the_step_are_refused_and_nothing_is_written_there(
    tmp_path: Path,
) -> None:
    local, durable = tmp_path / "local", tmp_path / "durable"
    # node 1 receives into local/node1/replicas/node_0/<incoming>: four levels up is local/
    names = ["../../../../ESCAPED", str(tmp_path / "ABSOLUTE"), "arrays/../../../../../DOTTED", "a\\b", "ok"]
    errors = run_world(2, hostile_peer, str(local), str(durable), names)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file() and p.read_bytes() == b"ESCAPED") == []
    assert list((local / "node1" / "replicas" / "node_0").iterdir()) == []  # nothing kept of it
    assert "replicating to the peer nodes failed on another rank" in errors[0]
    assert "replicating to the peer nodes failed: files from rank 0 refused" in errors[1]
    for name in names[:4]:
        assert f"the name {name!r} is not a path inside the step" in errors[1]


def test_a_received_file_is_created_anew_never_through_a_link_or_over_a_file_there(tmp_path: Path) -> None:
    into, outside = tmp_path / "incoming", tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"mine")
    into.mkdir()
    (into / "arrays").symlink_to(outside, target_is_directory=True)  # planted in the directory being received into
    (into / "zarr.json").symlink_to(outside / "victim")
    files = [("arrays/x", b"ESCAPED"), ("zarr.json", b"ESCAPED"), ("pytreeckpt.json", b"{}"), ("pytreeckpt.json", b"!")]
    error = run_world(2, hostile_files, str(into), files)[1]
    assert sorted(os.listdir(outside)) == ["victim"]
    assert (outside / "victim").read_bytes() == b"mine"
    assert error is not None
    assert f"{into / 'arrays'} is a symbolic link" in error
    assert f"cannot create {into / 'zarr.json'} anew" in error
    assert f"cannot create {into / 'pytreeckpt.json'} anew" in error  # (sent twice: the first one stays)
    assert (into / "pytreeckpt.json").read_bytes() == b"{}"


@pytest.mark.parametrize("planted", ["link", "fifo"])
def test_a_link_or_fifo_among_a_replicas_files_is_refused_not_read_and_copied_to_the_other_node(
    tmp_path: Path, planted: str
) -> None:
    local, durable, secret = tmp_path / "local", tmp_path / "durable", tmp_path / "secret"
    secret.write_bytes(b"SECRET" * 100)
    saved = run_world(2, two_nodes, str(local), str(durable), [1, 2])
    assert saved[0]["steps"] == {"peers": [1, 2], "durable": []}
    planted_at = local / "node0" / "replicas" / "node_1" / "step_2" / "evil"
    if planted == "link":
        planted_at.symlink_to(secret)
    else:
        os.mkfifo(planted_at)  # (read, it would block the sender)
    shutil.rmtree(local / "node1")  # node 1 is lost: its step 2 is only in node 0's replica
    restored = run_world(2, two_nodes, str(local), str(durable), [])
    for rank, r in enumerate(restored):
        assert (r["step"], r["tier"], r["x"]) == (1, "peers", [10.0 + rank] * 2), r
        assert len(r["warnings"]) == 1, r["warnings"]
        assert "step 2 of peers does not load" in r["warnings"][0]
    kind = "a symbolic link" if planted == "link" else "a FIFO"
    assert f"{planted_at} is {kind}, not a regular file; refused" in restored[1]["warnings"][0]
    assert not [p for p in (local / "node1").rglob("*") if p.is_file() and b"SECRET" in p.read_bytes()]


def test_foreign_names_among_the_replicas_are_no_steps_and_pruning_leaves_them_alone(tmp_path: Path) -> None:
    local, durable, elsewhere = tmp_path / "local", tmp_path / "durable", tmp_path / "elsewhere"
    run_world(2, two_nodes, str(local), str(durable), [1, 2])
    replicas = local / "node1" / "replicas" / "node_0"
    shutil.copytree(replicas / "step_2", replicas / "step_0999")  # 999 to `\d+`: newer than every step
    shutil.copytree(replicas / "step_2", elsewhere)
    (replicas / "step_5").symlink_to(elsewhere, target_is_directory=True)
    saved = run_world(2, two_nodes, str(local), str(durable), [3])
    assert saved[1]["steps"] == {"peers": [2, 3], "durable": []}
    assert sorted(os.listdir(replicas)) == ["step_0999", "step_2", "step_3", "step_5"]
    assert (replicas / "step_5").is_symlink()
    assert sorted(os.listdir(elsewhere)) == sorted(os.listdir(replicas / "step_0999"))


def test_a_foreign_directory_of_a_lost_nodes_step_name_is_left_alone_and_that_step_not_fetched(
    tmp_path: Path,
) -> None:
    local, durable = tmp_path / "local", tmp_path / "durable"
    run_world(2, two_nodes, str(local), str(durable), [1, 2])
    shutil.rmtree(local / "node1")
    (local / "node1" / "step_2").mkdir(parents=True)  # someone's directory where the step would go back
    (local / "node1" / "step_2" / "notes.txt").write_text("mine")
    restored = run_world(2, two_nodes, str(local), str(durable), [])
    for rank, r in enumerate(restored):
        assert (r["step"], r["tier"], r["x"]) == (1, "peers", [10.0 + rank] * 2), r
    assert f"{local / 'node1' / 'step_2'} is a directory holding files no save writes" in restored[1]["warnings"][0]
    assert os.listdir(local / "node1" / "step_2") == ["notes.txt"]
    assert (local / "node1" / "step_2" / "notes.txt").read_text() == "mine"
