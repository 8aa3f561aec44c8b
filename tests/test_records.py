import json

import pytest

from cost_models.records.errors import FileFormatError, OutputExistsError
from cost_models.records.file_record import FileRecord
from cost_models.records.fileio import dumps, write_atomic
from cost_models.records.files import ClusterFile, ProfileFile
from cost_models.records.presets import preset
from cost_models.records.profile import PROFILE_KIND, SCHEMA_VERSION


def test_profile_round_trips_through_json(tiny_profiles, tmp_path):
    original = ProfileFile(model=tiny_profiles["gpt-tiny", False])
    path = original.save(tmp_path / "p.json")
    loaded = ProfileFile.load(path)
    assert loaded == original
    assert loaded.model.units[1].fwd_time == original.model.units[1].fwd_time
    assert json.loads(path.read_text())["kind"] == PROFILE_KIND == ProfileFile.header()[0]


def test_wrong_schema_and_fields_are_one_line_errors(tmp_path, tiny_profiles):
    data = ProfileFile(model=tiny_profiles["mlp-deep", True]).to_dict()
    p = tmp_path / "p.json"
    p.write_text(json.dumps({**data, "schema_version": 99}))
    with pytest.raises(FileFormatError, match="schema_version 99"):
        ProfileFile.load(p)
    data["model"]["bogus"] = 1
    with pytest.raises(FileFormatError, match="unknown field"):
        ProfileFile.from_dict(data)
    p.write_text("{not json")
    with pytest.raises(FileFormatError, match="not valid JSON"):
        ProfileFile.load(p)


def test_write_atomic_does_not_clobber(tmp_path):
    p = tmp_path / "mine.json"
    p.write_text("precious")
    with pytest.raises(OutputExistsError):
        write_atomic(p, "new")
    assert p.read_text() == "precious"
    write_atomic(p, "new", overwrite=True)
    assert p.read_text() == "new"
    assert [f.name for f in tmp_path.iterdir()] == ["mine.json"]  # no temp file left behind


def _file_record_classes() -> set[type]:
    import executor.checkpoint_layout  # noqa: F401  (every module that defines a file kind)
    import planner.run_record  # noqa: F401
    seen, todo = set(), [FileRecord]
    while todo:
        for sub in todo.pop().__subclasses__():
            seen.add(sub)
            todo.append(sub)
    return seen


def test_every_file_kind_declares_its_kind_and_version_once():
    names = {cls.__name__: cls.header() for cls in _file_record_classes()}
    assert set(names) == {"ProfileFile", "ClusterFile", "Plan", "RunFile", "CheckpointMeta"}
    assert names["ProfileFile"] == (PROFILE_KIND, SCHEMA_VERSION)
    assert len({kind for kind, _ in names.values()}) == 5        # no two kinds share a name


def test_a_cluster_file_saves_atomically_and_refuses_to_clobber(tmp_path):
    original = ClusterFile(cluster=preset("dgx-a100", nodes=2))
    path = original.save(tmp_path / "c.json")
    assert ClusterFile.load(path) == original
    with pytest.raises(OutputExistsError, match="--force"):
        original.save(path)
    original.save(path, overwrite=True)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["c.json"]


def _cluster_doc(**changes) -> str:
    return dumps({**ClusterFile(cluster=preset("dgx-a100")).to_dict(), **changes})


@pytest.mark.parametrize("make, line", [
    (None, "{p}: no such file"),
    (lambda p: p.mkdir(), "{p}: a folder, not a file"),
    (lambda p: p.write_bytes(b"\x89PNG\r\n"), "{p}: not a text file (invalid start byte at byte 0)"),
    (lambda p: p.write_text("{"), "{p}: not valid JSON (Expecting property name enclosed in double quotes: "
                                  "line 1 column 2 (char 1))"),
    (lambda p: p.write_text('{"x": NaN}'), "{p}: x is NaN; JSON numbers must be finite: write a number or re-create "
                                           "the file"),
    (lambda p: p.write_text("[1]"), "{p}: not a zeropipe cluster file (its 'kind' is None; a cluster file has kind: "
                                    "zeropipe.cluster, schema_version: 1)"),
    (lambda p: p.write_text(_cluster_doc(kind="zeropipe.plan")),
     "{p}: not a zeropipe cluster file (its 'kind' is 'zeropipe.plan'; a cluster file has kind: zeropipe.cluster, "
     "schema_version: 1)"),
    (lambda p: p.write_text(_cluster_doc(schema_version=0)),
     "{p}: schema_version 0, this zeropipe reads 1; re-create the file"),
    (lambda p: p.write_text(_cluster_doc(extra=1)),
     "{p}: ClusterFile: unknown field(s) ['extra']; is the file from another schema version?"),
    (lambda p: p.write_text(_cluster_doc(cluster=[])), "{p}: expected an object for ClusterProfile, got list"),
], ids=["missing", "folder", "not-utf8", "not-json", "nan", "not-an-object", "wrong-kind", "wrong-version",
        "unknown-field", "bad-field"])
def test_each_way_a_file_is_wrong_is_one_line_naming_it(tmp_path, make, line):
    path = tmp_path / "c.json"
    if make:
        make(path)
    with pytest.raises(FileFormatError) as exc:
        ClusterFile.load(path)
    assert str(exc.value) == line.format(p=path)


def test_check_runs_after_the_fields_load(tmp_path):
    doc = json.loads(_cluster_doc())
    doc["cluster"]["devices_per_node"] = 0
    (tmp_path / "c.json").write_text(json.dumps(doc))
    with pytest.raises(FileFormatError, match=r"^.*c\.json: cluster\.devices_per_node is 0; need devices_per_node >= 1"):
        ClusterFile.load(tmp_path / "c.json")
