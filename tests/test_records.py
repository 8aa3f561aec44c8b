import json

import pytest

from cost_models.errors import FileFormatError, OutputExistsError
from cost_models.fileio import dumps, read_json, write_atomic
from cost_models.profile import PROFILE_KIND, SCHEMA_VERSION, ProfileFile


def test_profile_round_trips_through_json(tiny_profiles, tmp_path):
    original = ProfileFile(model=tiny_profiles["gpt-tiny", False])
    path = write_atomic(tmp_path / "p.json", dumps(original.to_dict()))
    loaded = ProfileFile.from_dict(read_json(path, kind=PROFILE_KIND, schema_version=SCHEMA_VERSION))
    assert loaded == original
    assert loaded.model.units[1].fwd_time == original.model.units[1].fwd_time


def test_wrong_schema_and_fields_are_one_line_errors(tmp_path, tiny_profiles):
    data = ProfileFile(model=tiny_profiles["mlp-deep", True]).to_dict()
    p = tmp_path / "p.json"
    p.write_text(json.dumps({**data, "schema_version": 99}))
    with pytest.raises(FileFormatError, match="schema_version 99"):
        read_json(p, kind=PROFILE_KIND, schema_version=SCHEMA_VERSION)
    data["model"]["bogus"] = 1
    with pytest.raises(FileFormatError, match="unknown field"):
        ProfileFile.from_dict(data)
    p.write_text("{not json")
    with pytest.raises(FileFormatError, match="not valid JSON"):
        read_json(p, kind=PROFILE_KIND, schema_version=SCHEMA_VERSION)


def test_write_atomic_does_not_clobber(tmp_path):
    p = tmp_path / "mine.json"
    p.write_text("precious")
    with pytest.raises(OutputExistsError):
        write_atomic(p, "new")
    assert p.read_text() == "precious"
    write_atomic(p, "new", overwrite=True)
    assert p.read_text() == "new"
    assert [f.name for f in tmp_path.iterdir()] == ["mine.json"]  # no temp file left behind
