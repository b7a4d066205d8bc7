"""Locations beyond local paths: memory://, kvstore specs, and a real S3 server (SeaweedFS)."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import seaweed
import tensorstore as ts
import torch
from crash_workers import killed_at_steps, save_in_a_child, state
from helpers import HANG, bits, document, packed_in
from safetensors.torch import load_file

import pytreeckpt
from benchmarks._common import free_port
from pytreeckpt import Abstract, Location, Mesh, Replicate, Shard, ShardedLeaf, ShardingSpec, StorageOptions
from pytreeckpt.storage import Storage
from pytreeckpt.storage._location import resolve


def assert_state(got: dict, seed: int) -> None:
    want = state(seed)
    assert got["step"] == want["step"]
    for group in ("big", "small"):
        for k, v in want[group].items():
            assert torch.equal(bits(got[group][k]), bits(v)), (group, k)


# --------------------------------------------------------------------------- parsing


def test_locations_parse_paths_urls_and_specs(tmp_path: Path) -> None:
    assert resolve(tmp_path / "c").path == tmp_path / "c"
    assert resolve(f"file://{tmp_path}/c").path == tmp_path / "c"
    assert resolve({"driver": "file", "path": str(tmp_path / "c")}).path == tmp_path / "c"
    s3 = resolve("s3://bucket/run/step_1", StorageOptions(endpoint="http://127.0.0.1:9", region="eu-west-1"))
    assert s3.spec == {
        "driver": "s3",
        "bucket": "bucket",
        "path": "run/step_1/",
        "endpoint": "http://127.0.0.1:9",
        "aws_region": "eu-west-1",
    }
    assert s3.url == "s3://bucket/run/step_1"
    assert resolve("gs://b/p").spec == {"driver": "gcs", "bucket": "b", "path": "p/"}
    assert resolve("memory://x/y").url == "memory://x/y"
    assert repr(Location("s3://b/run").child("step_2")) == "Location('s3://b/run/step_2')"
    with pytest.raises(pytreeckpt.CheckpointError, match="unsupported location scheme 'ftp'"):
        resolve("ftp://host/x")
    with pytest.raises(pytreeckpt.CheckpointError, match="no bucket"):
        resolve("s3:///x")


def test_s3_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:7")
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    spec = resolve("s3://b/p").spec
    assert spec is not None
    assert (spec["endpoint"], spec["aws_region"]) == ("http://127.0.0.1:7", "ap-south-1")


# --------------------------------------------------------------------------- memory://


def test_memory_locations_keep_the_commit_protocol() -> None:
    where = f"memory://{uuid.uuid4().hex}/step_1"
    with pytest.raises(pytreeckpt.NotCommittedError, match="not a committed checkpoint"):
        pytreeckpt.load(where)
    tree = {"w": torch.randn(64, 32), "b": torch.ones(3), "step": 4}
    pytreeckpt.save(where, tree)
    got = pytreeckpt.load(where)
    assert torch.equal(got["w"], tree["w"])
    assert got["step"] == 4
    with pytest.raises(pytreeckpt.CheckpointError, match="already holds a committed checkpoint"):
        pytreeckpt.save(where, tree)
    pytreeckpt.async_save(where, {"w": torch.zeros(2), "step": 5}, overwrite=True).wait()
    assert pytreeckpt.load(where)["step"] == 5
    assert pytreeckpt.verify(where).ok


# --------------------------------------------------------------------------- packing


def test_packed_arrays_are_few_files_and_damage_to_them_is_found(tmp_path: Path) -> None:
    tree = {f"b{i}": torch.full((16,), float(i)) for i in range(300)}
    tree["big"] = torch.randn(1024, 512)  # 2 MiB: over pack_max_bytes, stored on its own
    pytreeckpt.save(packed_in(tmp_path / "c", "ocdbt"), tree)  # (zip archives: tests/test_archive.py)
    doc = json.loads((tmp_path / "c" / "pytreeckpt.json").read_text())
    assert doc["version"] == 2
    assert {leaf["key"] for leaf in doc["leaves"] if "database" not in leaf} == {"big"}
    assert sum(len(f) for _, _, f in os.walk(tmp_path / "c" / "ocdbt")) < 60  # not 600 files
    got = pytreeckpt.load(tmp_path / "c")
    assert all(torch.equal(got[k], v) for k, v in tree.items())
    # Damage every 32nd byte of every data file. (One byte in the middle of each file was
    # found or not depending on timing: OCDBT appends a b-tree node per commit, how the 300
    # writes batch into commits sets the files' layout, and a byte of a superseded node is
    # read by nobody. A damaged zstd-compressed node is also reported without DATA_LOSS.)
    for f in (tmp_path / "c" / "ocdbt" / "0" / "d").iterdir():
        raw = np.frombuffer(f.read_bytes(), dtype=np.uint8).copy()
        raw[::32] ^= 0xFF
        f.write_bytes(raw.tobytes())
    report = pytreeckpt.verify(tmp_path / "c")
    assert not report.ok
    assert set(report.damaged_leaves) == set(tree) - {"big"}
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'b\d+': .* in the OCDBT database 'ocdbt/0'"):
        pytreeckpt.load(tmp_path / "c")


def test_a_packed_leaf_claiming_a_huge_shape_is_refused(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"w": torch.ones(3)})
    doc = document(tmp_path / "c")
    doc["leaves"][0]["shape"] = [1 << 40]
    doc["leaves"][0]["chunk_shape"] = [1 << 40]
    (tmp_path / "c" / "pytreeckpt.json").write_text(json.dumps(doc))
    with pytest.raises(pytreeckpt.MetadataError, match="packed array holds at most"):
        pytreeckpt.load(tmp_path / "c")


def test_a_manager_passes_its_location_options_to_every_step(tmp_path: Path) -> None:
    with pytreeckpt.CheckpointManager(Location(tmp_path, StorageOptions(pack_small_leaves=False))) as m:
        m.save(1, {"b": torch.ones(3)})
    assert (tmp_path / "step_1" / "arrays" / "b" / "zarr.json").is_file()
    assert not (tmp_path / "step_1" / "ocdbt").exists()


# --------------------------------------------------------------------------- S3


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[seaweed.Server]:
    """SeaweedFS for this module."""
    yield from seaweed.module_server(tmp_path_factory)


def _prefix() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.mark.parametrize(("pack", "in_file"), [(True, False), (False, False), (False, True)])
def test_s3_save_async_save_and_resharded_load(s3: seaweed.Server, pack: bool, in_file: bool) -> None:
    """(``in_file``: the chunk checksums in a file of their own, read by ranges.)"""
    run = _prefix()
    w = torch.randn(96, 40)
    tree = {
        "w": ShardedLeaf.from_global(w, ShardingSpec(Mesh((2, 2)), [Replicate(), Shard(0)])),
        "small": {f"b{i}": torch.full((5,), float(i)) for i in range(20)},
        "step": 7,
    }
    limit = 0 if in_file else StorageOptions().max_inline_checksum_bytes
    loc = s3.location(f"{run}/step_7", pack_small_leaves=pack, max_inline_checksum_bytes=limit)
    pytreeckpt.save(loc, tree, user_metadata={"note": "s3"})
    assert ("checksums/crc32c" in Storage(loc).kv.list()) is in_file  # type: ignore[union-attr]
    target = {
        "w": Abstract(w.shape, w.dtype, ShardingSpec(Mesh(3), [Shard(1)])),
        "small": {f"b{i}": torch.zeros(5) for i in range(20)},
        "step": 0,
    }
    got = pytreeckpt.load(loc, target)
    assert torch.equal(got["w"].to_global(), w)
    assert all(torch.equal(got["small"][f"b{i}"], torch.full((5,), float(i))) for i in range(20))
    assert got["step"] == 7
    meta = pytreeckpt.metadata(loc)
    assert meta.user_metadata == {"note": "s3"}
    assert (meta.version == 2) is pack
    assert pytreeckpt.verify(loc).ok
    assert torch.equal(pytreeckpt.load_slice(loc, "w", (slice(10, 20), 3)), w[10:20, 3:4])
    # async, then the staged copy is what is stored
    w2 = torch.randn(96, 40)
    loc = s3.location(f"{run}/step_8", pack_small_leaves=pack, max_inline_checksum_bytes=limit)
    h = pytreeckpt.async_save(loc, {"w": w2, "step": 8})
    expect = w2.clone()
    w2.add_(1.0)
    h.wait()
    assert torch.equal(pytreeckpt.load(s3.location(f"{run}/step_8"))["w"], expect)


def test_s3_bare_urls_use_the_environment(s3: seaweed.Server, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3.env().items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    where = f"s3://{seaweed.BUCKET}/{_prefix()}/c"
    pytreeckpt.save(where, {"w": torch.arange(10)})
    assert torch.equal(pytreeckpt.load(where)["w"], torch.arange(10))


def test_s3_manager_retention_and_restore(s3: seaweed.Server) -> None:
    directory = s3.location(_prefix())
    with pytreeckpt.CheckpointManager(directory, max_to_keep=2, keep_every_n_steps=4) as m:
        for step in range(1, 7):
            m.save(step, {"w": torch.full((3,), float(step)), "step": step})
        m.wait()
        assert m.all_steps() == [4, 5, 6]
        assert torch.equal(m.restore()["w"], torch.full((3,), 6.0))
        assert m.restore(4)["step"] == 4
        m.delete(5)
        assert m.all_steps() == [4, 6]
    # an interrupted step older than the newest commit is cleaned up by the next manager
    crashed = directory.child("step_2")
    pytreeckpt.save(crashed, {"w": torch.ones(1)})
    kv = pytreeckpt.storage.Storage(crashed).kv
    assert kv is not None
    kv.delete("pytreeckpt.json")  # as a save killed before its commit leaves it
    with pytreeckpt.CheckpointManager(directory) as m:
        assert m.all_steps() == [4, 6]
    assert kv.list() == []


def test_s3_command_line(s3: seaweed.Server, tmp_path: Path) -> None:
    run = _prefix()
    w = torch.arange(40.0).reshape(8, 5)
    pytreeckpt.save(s3.location(f"{run}/step_1"), {"model": {"w": w}, "step": 1})
    pytreeckpt.save(s3.location(f"{run}/step_2"), {"model": {"w": w + 1}, "step": 2})
    kv = pytreeckpt.storage.Storage(s3.location(f"{run}/step_3")).kv
    assert kv is not None
    kv.write("arrays/w/zarr.json", b"{}")  # a save that never committed

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "pytreeckpt", *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=s3.env(), timeout=HANG)

    base = f"s3://{seaweed.BUCKET}/{run}"
    done = cli("ls", base, "--json")
    assert done.returncode == 0, done.stderr
    listed = {e["name"]: e["committed"] for e in json.loads(done.stdout)}
    assert listed == {"step_1": True, "step_2": True, "step_3": False}
    done = cli("inspect", f"{base}/step_2", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["arrays"][0]["shape"] == [8, 5]
    done = cli("verify", f"{base}/step_2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok:")
    done = cli("export", f"{base}/step_2", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["model.w"], w + 1)
    done = cli("inspect", f"{base}/step_3")
    assert done.returncode == 2
    assert "not a committed checkpoint" in done.stderr


def _ctx() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "pytreeckpt", "crash_workers"])
    return ctx


@pytest.mark.parametrize("replacing", [False, True], ids=["beside", "replacing"])
def test_a_save_to_s3_killed_midway_leaves_the_previous_checkpoint_whole(s3: seaweed.Server, replacing: bool) -> None:
    """On S3 the old checkpoint stays whole until the new metadata object is PUT, and leftovers are reclaimed.

    The save is killed at chosen steps (each operation on whole objects, the arrays' opening and each
    packed entry written, counted in the saving process): killed up to the document's write, it
    committed nothing; after it, the new checkpoint is whole.
    """
    ctx = _ctx()
    run = _prefix()
    old, new = s3.location(f"{run}/step_1"), s3.location(f"{run}/step_2")
    pytreeckpt.save(old, state(1))
    target = old if replacing else new
    kv = pytreeckpt.storage.Storage(target).kv
    assert kv is not None
    steps = save_in_a_child(ctx, target, 1, False, None)  # how many steps a save takes (not killed)
    uncommitted, current = 0, 1
    for kill in killed_at_steps(*steps, 4):
        if not replacing:
            kv.delete_prefix("")  # each kill hits a save to a new prefix
        seed = 3 - current if replacing else 2
        save_in_a_child(ctx, target, seed, False, kill)
        if replacing:
            got = pytreeckpt.load(old)  # never uncommitted: the old one, or the new one whole
            assert got["step"] in (current, seed)
            assert_state(got, got["step"])
            committed = got["step"] == seed
            current = got["step"]
        else:
            assert_state(pytreeckpt.load(old), 1)
            try:
                got = pytreeckpt.load(new)
            except pytreeckpt.NotCommittedError:
                committed = False
            else:
                assert_state(got, 2)  # the kill came after the commit: then it is whole
                committed = True
        assert committed == (kill[0] == "commit"), kill
        uncommitted += not committed
    assert uncommitted >= 3
    pytreeckpt.save(target, state(2), overwrite=True)  # a retry clears the leftovers and succeeds
    assert_state(pytreeckpt.load(target), 2)
    doc = json.loads(kv.read("pytreeckpt.json") or b"")
    named = {leaf.get("database") or leaf["path"] for leaf in doc["leaves"] if leaf["kind"] == "array"}
    stored = {"/".join(k.split("/")[:2]) for k in kv.list() if k != "pytreeckpt.json"}
    assert stored == named  # nothing the killed saves left
    print(f"steps (up to the commit, after it): {steps}")


def test_s3_failures_are_clear_errors_naming_the_location(s3: seaweed.Server) -> None:
    tree = {"w": torch.ones(3)}
    cases = [
        (
            Location(
                f"s3://{seaweed.BUCKET}/x",
                StorageOptions(endpoint=s3.endpoint, access_key_id="no", secret_access_key="no"),
            ),
            r"s3://ckpt/x.*(InvalidAccessKeyId|PERMISSION_DENIED|403)",
        ),
        (Location("s3://no-such-bucket/x", s3.options()), r"s3://no-such-bucket/x.*NoSuchBucket"),
        (
            Location(f"s3://{seaweed.BUCKET}/x", StorageOptions(endpoint=f"http://127.0.0.1:{free_port()}")),
            r"s3://ckpt/x.*(connect|retry)",
        ),
    ]
    for where, pattern in cases:
        for op in (lambda w=where: pytreeckpt.save(w, tree), lambda w=where: pytreeckpt.load(w)):
            with pytest.raises(pytreeckpt.CheckpointError, match=pattern):
                op()


@pytest.mark.parametrize("retries", [None, 1])
def test_a_store_failing_every_request_is_asked_max_retries_times_more_then_the_error_names_it(
    retries: int | None,
) -> None:
    """A transient error (503) to every request: a save and a load each send their first request 1 +
    ``max_retries`` times (4 by default), then fail naming the location: a dead endpoint fails after a
    bounded number of tries, not after some time."""
    import http.server
    import threading

    asked = [0]

    class Unavailable(http.server.BaseHTTPRequestHandler):
        def answer(self) -> None:
            asked[0] += 1
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = answer

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        options = StorageOptions(
            endpoint=f"http://127.0.0.1:{server.server_port}", access_key_id="a", secret_access_key="b"
        )
        if retries is not None:
            options = dataclasses.replace(options, max_retries=retries)
        where = Location(f"s3://{seaweed.BUCKET}/x", options)
        for op in (lambda: pytreeckpt.save(where, {"w": torch.ones(3)}), lambda: pytreeckpt.load(where)):
            asked[0] = 0
            with pytest.raises(pytreeckpt.CheckpointError, match=r"s3://ckpt/x: cannot .*503"):
                op()
            assert asked[0] == 1 + options.max_retries
    finally:
        server.shutdown()
        server.server_close()


def test_the_credentials_file_of_a_process_that_ended_without_its_exit_handlers_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A forked rank ends with os._exit and a killed one runs nothing: their files were left in /tmp.
    import stat
    import tempfile

    from pytreeckpt.storage import _location

    code = (
        "import os, pytreeckpt.storage._location as L; "
        "print(L._credentials_file('id', 'secret'), flush=True); os._exit(0)"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    orphan = Path(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip())
    assert orphan.is_file()
    assert orphan.parent.parent == tmp_path
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setitem(_location._SHARED, "credentials", {})
    mine = Path(_location._credentials_file("id2", "secret2"))
    assert not orphan.exists()  # removed by the next process that made one
    assert mine.parent == orphan.parent
    assert stat.S_IMODE(mine.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(mine.stat().st_mode) == 0o600
    assert "secret2" in mine.read_text()


@pytest.mark.parametrize("shape_chunk", [((), ()), ((5,), (5,)), ((7, 3), (4, 2)), ((2, 1, 3), (2, 1, 3))])
def test_packed_arrays_metadata_is_what_tensorstore_writes_for_every_type(
    shape_chunk: tuple[tuple[int, ...], tuple[int, ...]],
) -> None:
    """The zarr.json written for packed arrays without TensorStore is byte for byte the one it writes."""
    from pytreeckpt.core._dtypes import _BY_NAME, dtype_from_name
    from pytreeckpt.format import ArrayMeta, zarr_metadata
    from pytreeckpt.storage._packed import zarr_json

    shape, chunk = shape_chunk
    storages = sorted({d.storage for d in _BY_NAME.values()})
    assert len(storages) >= 15
    for storage in storages:
        dtype = dtype_from_name(storage)
        spec = {"driver": "zarr3", "kvstore": {"driver": "memory"}, "create": True}
        spec["metadata"] = zarr_metadata(dtype, shape, chunk)
        written = ts.open(spec).result().kvstore.read("zarr.json").result().value
        meta = ArrayMeta("w", "torch", dtype, shape, chunk, "arrays/w", None, database="ocdbt/0")
        assert zarr_json(meta) == written, storage


def test_packed_arrays_of_many_chunks_and_transactions_load_and_open_in_tensorstore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed arrays cut in several chunks (edge chunks padded), written over many OCDBT commits."""
    from pytreeckpt.storage import _packed

    monkeypatch.setattr(_packed, "FLUSH_BYTES", 4096)  # a commit every few arrays
    g = torch.Generator().manual_seed(3)
    tree: dict[str, Any] = {f"w{i}": torch.randn(37, 11, generator=g) for i in range(40)}
    tree["h"] = torch.randn(5, 3).to(torch.bfloat16)
    tree["s"] = torch.tensor(7, dtype=torch.int64)
    tree["b"] = torch.tensor([True, False, True])
    chunking = pytreeckpt.ChunkingOptions(single_chunk_bytes=256, min_chunk_bytes=64, max_chunk_bytes=256)
    pytreeckpt.save(packed_in(tmp_path / "c", "ocdbt"), tree, chunking=chunking)
    doc = json.loads((tmp_path / "c" / "pytreeckpt.json").read_text())
    leaves = {leaf["key"]: leaf for leaf in doc["leaves"]}
    assert all(leaves[k].get("database") == "ocdbt/0" for k in tree)
    assert leaves["w0"]["chunk_shape"] != leaves["w0"]["shape"]  # several chunks, the edge ones padded
    got = pytreeckpt.load(tmp_path / "c")
    assert all(torch.equal(got[k], v) for k, v in tree.items())
    assert pytreeckpt.verify(tmp_path / "c").ok
    for k in ("w0", "w39", "h"):  # plain TensorStore reads what was written without it
        base = {"driver": "file", "path": str(tmp_path / "c" / "ocdbt" / "0") + "/"}
        kv = {"driver": "ocdbt", "base": base, "path": leaves[k]["path"] + "/"}
        stored = ts.open({"driver": "zarr3", "kvstore": kv, "open": True}).result().read().result()
        want = tree[k].float().numpy() if k == "h" else tree[k].numpy()
        assert np.array_equal(np.asarray(stored, dtype=want.dtype), want)


def test_a_packed_chunk_missing_from_its_database_names_leaf_and_database(tmp_path: Path) -> None:
    tree = {"a": torch.ones(4), "b": torch.arange(6.0)}
    pytreeckpt.save(packed_in(tmp_path / "c", "ocdbt"), tree)
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path / 'c' / 'ocdbt' / '0'}/"}).result()
    kv.delete_range(ts.KvStore.KeyRange("arrays/b/c", "arrays/b/d")).result()
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'b'.* missing from the OCDBT database 'ocdbt/0'"):
        pytreeckpt.load(tmp_path / "c")
    assert pytreeckpt.load(tmp_path / "c", include=["a"])["a"].tolist() == [1.0] * 4


def test_the_ranks_of_one_machine_share_its_file_operations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44: four ranks of 16 file operations each kept about 100 requests in the disk's queue (40-50 ms each)
    where one process keeps about 20 (9 ms): a distributed save runs its share of them, by torchrun's
    LOCAL_WORLD_SIZE."""
    from pytreeckpt.storage._options import per_rank

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert per_rank(None).file_io_concurrency == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert per_rank(None).file_io_concurrency == 4
    given = pytreeckpt.ExecutorOptions(file_io_concurrency=6, progress=True)
    assert per_rank(given) == pytreeckpt.ExecutorOptions(file_io_concurrency=2, progress=True)  # (at least 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "many")
    assert per_rank(given) is given
