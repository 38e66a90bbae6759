"""One location type for every place a user names: local paths (relative ones against the current directory),
file:// and s3:// URIs against a real S3-compatible server (moto on loopback), and the Ray-job working-dir trap."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from attnlab.errors import UserError
from attnlab.location import Location, user_input, user_location
from conftest import s3_keys


def test_relative_paths_resolve_against_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    loc = Location.parse("runs/x")
    assert loc.is_local and loc.uri == str(tmp_path / "runs" / "x") and loc.path == loc.uri
    assert Location.parse(f"file://{tmp_path}/y").uri == str(tmp_path / "y")
    assert loc.child("a", "b.json").uri == str(tmp_path / "runs" / "x" / "a" / "b.json")
    assert loc.child("a").parent.uri == loc.uri


def test_a_uri_never_becomes_a_local_folder(s3_bucket):
    loc = Location.parse(f"{s3_bucket}/ray/study")
    assert not loc.is_local
    assert loc.uri == f"{s3_bucket}/ray/study"
    assert loc.child("runs", "abc").uri == f"{s3_bucket}/ray/study/runs/abc"
    assert loc.parent.uri == f"{s3_bucket}/ray"
    assert loc.name == "study"
    assert not os.path.exists("s3:")  # the pathlib trap: Path("s3://b/x") is the local folder s3:/b/x


@pytest.mark.parametrize("text,message", [
    ("", "is not allowed: use a local path"),
    ("ftp://host/x", r"the scheme ftp:// is not supported"),
    ("s3://", "name a bucket"),
])
def test_bad_locations_are_one_line_errors(text, message):
    with pytest.raises(UserError, match=message) as info:
        Location.parse(text, field="--runs")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_whole_file_writes_reads_listing_and_folders(where, tmp_path, request):
    base = str(tmp_path / "store") if where == "local" else f"{request.getfixturevalue('s3_bucket')}/store"
    loc = Location.parse(base)
    loc.write_json("a/b/record.json", {"step": 3})
    loc.write_text("a/notes.txt", "hello")
    assert loc.read_json("a/b/record.json") == {"step": 3}
    assert loc.read_json("a/missing.json", default="none") == "none"
    assert loc.read_text("a/notes.txt") == "hello"
    assert loc.list_names("a") == ["b", "notes.txt"]
    assert loc.is_dir("a") and loc.is_file("a/notes.txt") and not loc.exists("nope")
    local = tmp_path / "ckpt"
    local.mkdir()
    (local / "state.pt").write_bytes(b"\x00" * 100)
    (local / "meta.json").write_text("{}")
    loc.upload(str(local), "checkpoint_1")
    assert loc.list_names("checkpoint_1") == ["meta.json", "state.pt"]
    back = loc.download("checkpoint_1", str(tmp_path / "back"))
    assert sorted(os.listdir(back)) == ["meta.json", "state.pt"]
    clone = pickle.loads(pickle.dumps(loc))  # handed to Ray workers
    assert clone.read_json("a/b/record.json") == {"step": 3}
    if where == "s3":
        keys = s3_keys(base.split("/store")[0])
        assert "store/a/b/record.json" in keys and "store/checkpoint_1/state.pt" in keys


@pytest.mark.parametrize("where", ["local", "s3"])
def test_an_upload_writes_its_last_file_once_every_other_one_is_there(where, tmp_path, request, monkeypatch):
    """A plain process's checkpoint: ``meta.json`` (which says its step) is written last and whole, so a copy cut
    short is a folder without it, which no resume picks; a copy replacing an older one drops the old meta first."""
    from attnlab.model.checkpoint import find_latest_checkpoint

    base = str(tmp_path / "run") if where == "local" else f"{request.getfixturevalue('s3_bucket')}/run"
    run = Location.parse(base)
    local = tmp_path / "ckpt"
    (local / "extra").mkdir(parents=True)
    (local / "state.pt").write_bytes(b"\x00" * 100)
    (local / "extra" / "rng.bin").write_bytes(b"\x01")
    (local / "meta.json").write_text('{"step": 8}')
    seen = []
    write_bytes = Location.write_bytes

    def spy(self, name, data):
        if name == "meta.json":
            seen.append((self.is_file("state.pt"), self.is_file("extra/rng.bin"), self.is_file("meta.json")))
        return write_bytes(self, name, data)

    run.write_json("checkpoints/step_0000004/meta.json", {"step": 4})
    run.write_bytes("checkpoints/step_0000004/state.pt", b"\x00")
    monkeypatch.setattr(Location, "write_bytes", spy)
    run.upload(str(local), "checkpoints/step_0000008", last="meta.json")
    run.upload(str(local), "checkpoints/step_0000008", last="meta.json")  # again: replaces
    assert seen == [(True, True, False), (True, True, False)]
    assert run.list_names("checkpoints/step_0000008") == ["extra", "meta.json", "state.pt"]
    assert find_latest_checkpoint(run).name == "step_0000008"
    monkeypatch.undo()
    run.delete("checkpoints/step_0000008/meta.json")  # a copy cut short before its meta: the step-4 one is latest
    assert find_latest_checkpoint(run).name == "step_0000004"


def test_results_store_on_s3(s3_bucket):
    from attnlab.results import ResultsStore

    store = ResultsStore(f"{s3_bucket}/results")
    row = dict(study="s3-study", trial="t", attention="lssa", scale="logd_logn", p_train=None, p_eval=None,
               rope_scaling="ntk", step=10, tokens=100, eval_len=64, train_len=64, window_mode="nonoverlap",
               metric="val_loss", value=3.5, seed=0, train_key="abc", git_sha="x")
    store.write([row], key=("eval", "abc"))
    store.write([row], key=("eval", "abc"))  # a retry replaces
    frame = ResultsStore(f"{s3_bucket}/results").read(study="s3-study")
    assert len(frame) == 1 and frame["value"].iloc[0] == 3.5
    files = [k for k in s3_keys(s3_bucket) if k.endswith(".parquet")]
    assert len(files) == 1 and files[0].startswith("results/study=s3-study/train_key=abc/eval_abc-")


def test_prepared_data_on_s3_reads_back(s3_bucket, small_text_corpus):
    from attnlab.data import TokenShards, prepare, verify
    from attnlab.data.source import open_data

    folder, _ = small_text_corpus
    uri = f"{s3_bucket}/data/small"
    prepare("text", path=str(folder), out=uri, shard_tokens=20_000, val_tokens=2_000, seed=0, workers=1,
            progress=False)
    summary = verify(uri)
    assert summary["tokens"]["train"] > 0
    shards = TokenShards.open(uri)
    source = open_data(uri)
    windows, mask = source.eval_set(64, max_tokens=640)
    assert windows.shape == (10, 65) and mask is None
    assert shards.manifest_sha256 == source.fingerprint
    assert any(k.endswith("manifest.json") for k in s3_keys(s3_bucket))


def test_a_ray_job_working_dir_refuses_relative_outputs(tmp_path, monkeypatch):
    job_dir = tmp_path / "session" / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    job_dir.mkdir(parents=True)
    monkeypatch.chdir(job_dir)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_abc.zip"}}))
    monkeypatch.delenv("ATTNLAB_STORAGE", raising=False)
    with pytest.raises(UserError, match=r"--store 'results' is relative inside a Ray job.*ATTNLAB_STORAGE"):
        user_location(None, flag="--store", default="results")
    with pytest.raises(UserError, match="--runs 'runs' is relative inside a Ray job"):
        user_location("runs", flag="--runs", default="runs")
    assert user_location(str(tmp_path / "abs"), flag="--runs", default="runs").uri == str(tmp_path / "abs")
    monkeypatch.setenv("ATTNLAB_STORAGE", "s3://bucket/attnlab")
    assert user_location(None, flag="--store", default="results").uri == "s3://bucket/attnlab/results"


def test_a_study_run_in_a_ray_job_without_storage_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """The run book's submit with neither --store / --runs nor the cluster's ATTNLAB_STORAGE: `attnlab study run` in
    a job's working-dir copy exits 2 with one line naming the flag and the variable, before it writes anything."""
    import yaml

    from attnlab.cli import main

    job_dir = tmp_path / "session" / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    (job_dir / "studies").mkdir(parents=True)
    (job_dir / "studies" / "s.yaml").write_text(yaml.safe_dump({
        "name": "s", "train": {"preset": "tiny", "data": {"synthetic": "copy_distractors", "vocab": 64}, "steps": 2},
        "search": {"engine": "grid"}, "space": {"attention": ["softmax"]}, "objective": "val_loss@1x"}))
    monkeypatch.chdir(job_dir)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_abc.zip"}}))
    monkeypatch.delenv("ATTNLAB_STORAGE", raising=False)
    assert main(["study", "run", "studies/s.yaml"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("attnlab: error:")]
    assert len(errors) == 1 and "--store" in errors[0] and "ATTNLAB_STORAGE" in errors[0], err
    assert "Traceback" not in err
    assert sorted(p.relative_to(job_dir).as_posix() for p in job_dir.rglob("*")) == ["studies", "studies/s.yaml"]


def test_a_ray_job_reads_relative_data_below_the_clusters_storage(tmp_path, monkeypatch):
    """Inside a job the head's working-dir copy is at another path on every other node: a relative data path means
    the same path below ATTNLAB_STORAGE (where the run book prepares it), and is refused without it."""
    from attnlab.data.source import resolve_data

    job_dir = tmp_path / "session" / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    job_dir.mkdir(parents=True)
    monkeypatch.chdir(job_dir)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_abc.zip"}}))
    monkeypatch.delenv("ATTNLAB_STORAGE", raising=False)
    with pytest.raises(UserError, match=r"data 'data/fineweb' is relative inside a Ray job.*ATTNLAB_STORAGE") as info:
        resolve_data("data/fineweb")
    assert "\n" not in str(info.value)
    assert user_input(str(tmp_path / "abs"), field="data").uri == str(tmp_path / "abs")  # absolute: as written
    monkeypatch.setenv("ATTNLAB_STORAGE", "s3://bucket/attnlab/")
    assert resolve_data("data/fineweb") == "s3://bucket/attnlab/data/fineweb"
    assert resolve_data("./data/fineweb") == "s3://bucket/attnlab/data/fineweb"
    assert resolve_data({"synthetic": "copy"}) == {"synthetic": "copy"}
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")  # outside a job: the user's own folder, as always
    assert resolve_data("data/fineweb") == str(job_dir / "data" / "fineweb")


def test_outside_a_job_relative_outputs_are_fine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.delenv("ATTNLAB_STORAGE", raising=False)
    assert user_location(None, flag="--store", default="results").uri == str(tmp_path / "results")
