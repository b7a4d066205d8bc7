"""Real multi-process tests: gloo process groups of 1, 2 and 4 ranks on this machine."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import dist_workers as w
import pytest
import torch
from multiproc import run_world

import pytreeckpt

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

STEPS, MORE = 3, 3


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """An FSDP2 model with AdamW trained and saved at 4 ranks, and its uninterrupted continuation."""
    path = tmp_path_factory.mktemp("fsdp") / "ckpt"
    results = run_world(4, w.fsdp_train_and_save, str(path), STEPS, MORE)
    return path, results[0]


def _assert_state_equal(got: dict, want: dict) -> None:
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    for fqn, st in want["optim"]["state"].items():
        for name, v in st.items():
            assert torch.equal(got["optim"]["state"][fqn][name], v), (fqn, name)


def test_fsdp2_resume_at_same_world_is_exact(fsdp_checkpoint: tuple[Path, dict]) -> None:
    path, saved = fsdp_checkpoint
    results = run_world(4, w.fsdp_resume, str(path), "fsdp", MORE)
    _assert_state_equal(results[0]["state"], saved["state"])
    assert results[0]["step"] == STEPS
    assert results[0]["losses"] == saved["losses"]


def test_fsdp2_resume_at_two_ranks(fsdp_checkpoint: tuple[Path, dict]) -> None:
    path, saved = fsdp_checkpoint
    results = run_world(2, w.fsdp_resume, str(path), "fsdp", MORE)
    _assert_state_equal(results[0]["state"], saved["state"])
    assert results[0]["losses"] == pytest.approx(saved["losses"], rel=1e-4)


def test_fsdp2_resumes_in_place_at_two_ranks(fsdp_checkpoint: tuple[Path, dict]) -> None:
    path, saved = fsdp_checkpoint
    results = run_world(2, w.fsdp_resume_in_place, str(path), "fsdp", MORE)
    assert all(r["same"] for r in results)  # the model's own DTensors came back, filled
    _assert_state_equal(results[0]["state"], saved["state"])
    assert results[0]["losses"] == pytest.approx(saved["losses"], rel=1e-4)


def test_fsdp2_resume_on_2x2_fsdp_tp_mesh(fsdp_checkpoint: tuple[Path, dict]) -> None:
    path, saved = fsdp_checkpoint
    results = run_world(4, w.fsdp_resume, str(path), "fsdp_tp", MORE)
    _assert_state_equal(results[0]["state"], saved["state"])
    assert results[0]["losses"] == pytest.approx(saved["losses"], rel=1e-4)


def test_fsdp2_resume_at_one_rank_as_plain_tensors(fsdp_checkpoint: tuple[Path, dict]) -> None:
    path, saved = fsdp_checkpoint
    (result,) = run_world(1, w.fsdp_resume, str(path), "plain", MORE)
    _assert_state_equal(result["state"], saved["state"])
    assert result["losses"] == pytest.approx(saved["losses"], rel=1e-4)
    plain = pytreeckpt.load(path)  # no process group at all: plain tensors
    for k, v in saved["state"]["model"].items():
        assert type(plain["model"][k]) is torch.Tensor
        assert torch.equal(plain["model"][k], v)


def test_bytes_written_once_balanced_and_read_once(tmp_path: Path) -> None:
    world = 4
    results = run_world(world, w.count_bytes, str(tmp_path / "ckpt"))
    assert all(r["ok"] for r in results)
    state_bytes = (64 * 1024 + 96 * 1024 + 32 * 1024 + 20 * 100) * 4
    written = [r["written"] for r in results]
    assert sum(written) == state_bytes  # replicated data written once in total
    assert max(written) - min(written) <= 64 * 1024  # balanced within one chunk
    read = [r["read"] for r in results]
    # Every target region is read once in total, replicated targets once per group.
    assert sum(read) == state_bytes
    assert max(read) - min(read) <= 64 * 1024
    meta = json.loads((tmp_path / "ckpt" / "pytreeckpt.json").read_text())
    assert {leaf["key"] for leaf in meta["leaves"]} >= {"big", "rep", "plain"}
    print(f"bytes written per rank {written} (max/min {max(written) / min(written):.3f}); read per rank {read}")


def test_flat_ranges_saved_at_4_load_as_shard0_dtensors_at_3(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_world(4, w.flat_save, path)
    stored = pytreeckpt.metadata(path).arrays
    assert stored["w"].shape == (10, 7)  # the true shapes, merged from flat ranges
    assert stored["b"].shape == (13,)
    assert all(run_world(3, w.load_shard0_dtensors, path))


def test_strided_shard_layout_dcp_cannot_save(tmp_path: Path) -> None:
    results = run_world(4, w.strided_roundtrip, str(tmp_path / "ckpt"))
    assert results[0]["rows"] == [0, 4]  # rank 0 holds two separate rows
    # torch.distributed.checkpoint's planner rejects this state ("key:s has overlapping chunks").
    assert all(r["same"] and r["resharded"] for r in results)


def test_a_failing_rank_fails_every_rank_and_commits_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    messages = run_world(4, w.failing_save, str(path), 2)
    assert all("rank 2" in m and "No space left" in m for m in messages), messages
    assert not (path / "pytreeckpt.json").exists()
    with pytest.raises(pytreeckpt.NotCommittedError):
        pytreeckpt.load(path)


def test_partial_is_refused_and_specs_convert_both_ways() -> None:
    results = run_world(4, w.partial_and_conversions)
    for r in results:
        assert "Partial" in r["error"], r["error"]
        assert "'p'" in r["error"], r["error"]
        assert r["roundtrip"]
        assert r["mesh"] == (2, 2)
        assert r["ranks"] == (0, 1, 2, 3)


def test_fsdp2_state_dict_saved_and_loaded_directly(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    (saved,) = run_world(2, w.direct_state_dict_save, path)[:1]
    (loaded,) = run_world(4, w.direct_state_dict_load, path)[:1]
    assert saved["full"].keys() == loaded["full"].keys()
    for k, v in saved["full"].items():
        assert torch.equal(loaded["full"][k], v), k


def test_the_fsdp2_example_resumes_at_another_world_size_without_a_warning(tmp_path: Path) -> None:
    from multiproc import rank_stderr, run_torchrun

    # A Python warning ("...: UserWarning: ...") or a line of torch's C++ warning log ("[W1123 ...").
    warning = re.compile(r"\w*Warning\b|^\[W\d", re.MULTILINE)

    example = Path(__file__).parent.parent / "examples" / "fsdp2_resume.py"
    outputs = []
    for ranks, steps in ((4, 4), (2, 2)):
        args = ["--dir", str(tmp_path / "ckpt"), "--steps", str(steps), "--save-every", "2"]
        # every rank's stderr, labelled, in the message if torchrun fails
        outputs.append(run_torchrun(example, ranks, *args, logs=tmp_path / f"logs{ranks}")[0])
    assert "done at step 4" in outputs[0]
    assert "resumed step_4 (saved by 4 ranks) on 2 ranks" in outputs[1]
    assert "done at step 6" in outputs[1]
    assert pytreeckpt.metadata(tmp_path / "ckpt" / "step_6").user_metadata == {"world_size": 2}
    for ranks in (4, 2):
        for log in sorted((tmp_path / f"logs{ranks}").glob("*/attempt_*/*/stderr.log")):
            text = log.read_text(errors="replace")
            assert not warning.search(text), f"{ranks} ranks: " + rank_stderr(int(log.parent.name), log, "warned")


def test_flat_range_world_math() -> None:
    # the FSDP1-style ranges used above cover each parameter exactly once
    n, world = 70, 4
    per = math.ceil(n / world)
    ranges = [(min(r * per, n), min((r + 1) * per, n)) for r in range(world)]
    assert sum(b - a for a, b in ranges) == n


def test_async_save_through_a_small_pool_with_every_ranks_spans_on_rank_0(tmp_path: Path) -> None:
    results = run_world(4, w.async_monitored_save, str(tmp_path / "ckpt"))
    assert all(r["same"] for r in results)
    assert results[0]["ranks"] == [0, 1, 2, 3]  # gathered on rank 0
    assert results[1]["ranks"] == [1]  # the others keep their own
    assert results[0]["load_ranks"] == [0, 1, 2, 3]  # a load's too
    assert results[1]["load_ranks"] == [1]
    assert {"plan", "read"} <= set(results[0]["load_phases"])
    assert {"plan", "snapshot", "write", "merge", "commit"} <= set(results[0]["phases"])
    state_bytes = (256 * 1024 + 64 * 1024 + 37 * 11) * 4
    assert results[0]["written"] == state_bytes  # every byte written once, summed over ranks
    assert all(0 < r["peak"] <= 64 * 1024 for r in results)


def test_incremental_saves_link_unchanged_chunks_across_ranks(tmp_path: Path) -> None:
    results = run_world(2, w.incremental_saves, str(tmp_path))
    assert all(r["same"] and r["hashes"] for r in results)
    full, inc = results[0]["full"], results[0]["inc"]  # rank 0's monitor holds every rank's spans
    assert full == 2 * 256 * 1024 * 4
    assert inc == 128 * 1024 * 4  # only rank 0's changed half of "a"


# --------------------------------------------------------------------------- a world of one, sub-meshes, groups


def test_fsdp2_resume_at_one_initialised_rank_into_dtensors(fsdp_checkpoint: tuple[Path, dict]) -> None:
    path, saved = fsdp_checkpoint
    (result,) = run_world(1, w.fsdp_resume, str(path), "fsdp", MORE)  # fully_shard on a mesh of one rank
    _assert_state_equal(result["state"], saved["state"])
    assert result["step"] == STEPS
    assert result["losses"] == pytest.approx(saved["losses"], rel=1e-4)


def test_dtensors_on_a_world_of_one_save_load_and_manage_without_gloo_groups(tmp_path: Path) -> None:
    (result,) = run_world(1, w.world_of_one, str(tmp_path))
    assert result["dtensors"]  # loads into DTensor targets give DTensors
    assert set(result["got"]) == {"save", "async", "group", "manager"}
    for how, got in result["got"].items():
        _assert_state_equal(got, result["full"])
        assert got["step"] == 1, how
    assert result["groups_made"] == 0  # one rank talks to nobody: no checkpoint process group is made


def test_dtensors_on_sub_meshes_hold_nothing_off_their_mesh(tmp_path: Path) -> None:
    results = run_world(4, w.sub_meshes, str(tmp_path))
    assert [r["held"] for r in results] == [3 * 4, 3 * 4, 0, 0]  # "a" lives on ranks 0 and 1 only
    for r in results:
        assert r["locals"] == {"save": True, "async": True, "manager": True}
        assert r["steps"] == [3, 3, 3]
        assert r["plain"]


def test_an_explicit_process_group_of_some_ranks_saves_and_loads_alone(tmp_path: Path) -> None:
    results = run_world(4, w.subset_groups, str(tmp_path))
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    every = {"save": True, "async": True, "manager": True}
    assert [r["first"] for r in results] == [every, every, {}, {}]  # stage 0 alone
    for r in results:
        assert r["same"] == every  # both stages at once
        assert r["solo"]  # a group of one rank, with a DTensor on its one-rank mesh
        assert r["world"]  # and the whole world's save afterwards
    for stage in (0, 1):
        assert pytreeckpt.load(tmp_path / f"stage{stage}" / "save")["stage"] == stage


def test_sharded_leaves_placed_on_some_ranks_save_and_load_there(tmp_path: Path) -> None:
    """A pipeline stage's ShardedLeaf on its stage's ranks (a placement), at 4 gloo ranks."""
    results = run_world(4, w.placed_stages, str(tmp_path / "c"))
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    assert all(r["ok"] == {0: True, 1: True} for r in results)
    back = pytreeckpt.load(tmp_path / "c")
    assert torch.equal(back["stage1"], torch.arange(60, dtype=torch.float32).reshape(12, 5) + 100)


# --------------------------------------------------------------------------- one rank's error


def test_one_ranks_error_is_raised_by_every_rank_and_the_groups_stay_usable(tmp_path: Path) -> None:
    # A rank that failed alone used to leave the others in the next collective until gloo's
    # timeout; a hang shows here as the run_world timeout.
    world = 2
    results = run_world(world, w.one_rank_fails, str(tmp_path))
    cases = {(c["case"], c["bad"]) for c in results[0]}
    assert len(cases) == 2 * 8 + 1
    for i, case in enumerate(results[0]):
        seen = [r[i] for r in results]
        what = (case["case"], case["bad"])
        assert all(c["checkpoint_error"] for c in seen), (what, seen)
        assert len({c["message"] for c in seen}) == 1, (what, seen)  # the same error on every rank
        assert len({c["kind"] for c in seen}) == 1, (what, seen)
        message = case["message"]
        assert f"rank {case['bad']}" in message, (what, message)
        if case["leaf"] is not None:
            assert f"'{case['leaf']}'" in message, (what, message)
        assert all(c["after"] for c in seen), what  # a second save, a load and a collective work
    kinds = {c["case"]: c["kind"] for c in results[0]}
    assert kinds["load_another_shape"] == "TargetMismatchError"
    assert "committed" in next(c["message"] for c in results[0] if c["case"] == "save_over_committed")
    nowhere = {c["bad"]: c["message"] for c in results[0] if c["case"] == "load_from_nowhere"}
    assert nowhere[0].startswith("reading the checkpoint metadata failed on 1 of 2 ranks: rank 0"), nowhere
    assert nowhere[1].startswith("preparing the load failed on 1 of 2 ranks: rank 1"), nowhere
    assert all("unsupported location scheme 'nosuch'" in m for m in nowhere.values()), nowhere
    slowest = max(c["seconds"] for r in results for c in r)
    print(f"slowest failing call: {slowest:.2f} s")


def test_the_checkpoint_groups_gather_objects_of_any_size_agree_on_failure_and_on_digests() -> None:
    # agree is one all-reduce when all succeeded, and gathers and broadcasts the failures only when not: every
    # rank raises the same error, whichever rank failed, and a success between failures stays silent.
    world = 3
    results = run_world(world, w.comm_gather_and_agree)
    expected = [[None] * world, [b""] * world, ["x" * r for r in range(world)]]
    expected.append([{"rank": r, "big": bytes(range(256)) * (4096 * r)} for r in range(world)])
    assert results[0]["gathered"] == expected
    assert all(r["gathered"] == [[], [], [], []] for r in results[1:])
    for r in results:
        assert len(r["raised"]) == world  # every rank raised, whichever rank failed
        for bad, message in enumerate(r["raised"]):
            assert message.startswith(f"testing the agreement failed on 1 of {world} ranks: rank {bad}"), message
            assert f"broken on {bad}" in message, message
    assert [r["raised"] for r in results[1:]] == [results[0]["raised"]] * (world - 1)
    # all_same: true only where every rank holds rank 0's bytes, the same answer on every rank.
    assert all(r["same"] == [True, True] + [False, False] * world for r in results), [r["same"] for r in results]
    # agree_on_specs agrees in tensor collectives alone, and says on every rank how a rank's state differs.
    assert all(r["known"] and r["agreeing_objects"] == 0 for r in results), results
    for r in results:
        assert r["differing"].startswith(f"preparing the load failed on 1 of {world} ranks: rank {world - 1}: ")
        assert f"rank 0 and rank {world - 1} differ in their plain Python leaves: leaf 'lr'" in r["differing"]


def test_what_a_rank_receives_in_save_and_load_does_not_grow_with_the_world(tmp_path: Path) -> None:
    # Ranks send rank 0 a digest of their layouts and get its verdict; no rank receives the
    # others' pieces. A load also receives the metadata document rank 0 read. Before: a
    # non-coordinator rank received 7x more at 8 ranks than at 2.
    got = {n: run_world(n, w.collective_bytes, str(tmp_path / f"w{n}")) for n in (2, 4, 8)}
    for what in ("save", "load"):
        others = {n: max(r[what] for r in results[1:]) for n, results in got.items()}
        assert others[8] <= 1.5 * others[2], (what, others)
        document = got[2][0]["metadata"] if what == "load" else 0
        assert others[2] < document + 10_000, (what, others, document)  # a few small messages besides


def test_every_ranks_chunk_checksums_reach_the_metadata(tmp_path: Path) -> None:
    """Each rank records the crc32c of the chunks it writes (or links from a base); rank 0's document holds them all."""
    run_world(2, w.incremental_saves, str(tmp_path))
    for name in ("s1", "s2"):  # s2 links rank 1's unchanged chunks from s1
        path = tmp_path / name
        for meta in pytreeckpt.metadata(path).arrays.values():
            assert meta.records_crc32c
            rows = meta.shape[0] // meta.chunk_shape[0]
            assert rows == 16
            assert meta.chunk_shape[1:] == meta.shape[1:]
            for i in range(rows):  # written by rank 0 (the first half) and rank 1 (the second)
                stored = (path / meta.path / "c" / str(i) / "0").read_bytes()[-4:]
                assert meta.recorded_crc32c((i, 0)) == int.from_bytes(stored, "little")
        assert pytreeckpt.verify(path).ok
    first, last = (tmp_path / "s2" / "arrays" / "b" / "c" / str(i) / "0" for i in (0, 15))
    first.rename(tmp_path / "x")
    last.rename(first)
    (tmp_path / "x").rename(last)
    report = pytreeckpt.verify(tmp_path / "s2")
    assert [(key, chunk) for key, chunk, _ in report.problems] == [("b", (0, 0)), ("b", (15, 0))]


def test_a_dtensor_state_changed_between_saves_is_saved_as_it_is_at_each(tmp_path: Path) -> None:
    results = run_world(2, w.dtensor_state_saved_again, str(tmp_path / "ckpt"))
    for r in results:
        assert r["same"] == [True] * 5
