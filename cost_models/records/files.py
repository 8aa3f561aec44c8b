"""The two input files a user hands the planner, each checked on load before any cost model reads it: profile.json
(`planner profile`) and cluster files (`planner profile-cluster`, or written by hand in JSON or YAML)."""
from __future__ import annotations

from typing import Any

from cost_models.records.base import record
from cost_models.records.cluster import CLUSTER_KIND, CLUSTER_SCHEMA_VERSION, ClusterProfile, check_calibration
from cost_models.records.errors import FileFormatError
from cost_models.records.file_record import FileRecord
from cost_models.records.profile import PROFILE_KIND, SCHEMA_VERSION, ModelProfile
from cost_models.records.validate import PROFILE_FIX, validate_cluster, validate_model


@record
class ClusterFile(FileRecord):
    """A cluster file (`planner profile-cluster` writes one; people write them by hand too, in JSON or YAML)."""

    schema_version: int = CLUSTER_SCHEMA_VERSION
    kind: str = CLUSTER_KIND
    cluster: ClusterProfile

    @classmethod
    def parse(cls, text: str, where: str) -> Any:
        """JSON, or YAML for a .yaml / .yml file."""
        if not where.lower().endswith((".yaml", ".yml")):
            return super().parse(text, where)
        import yaml
        try:
            return yaml.safe_load(text)
        except Exception as exc:  # yaml.YAMLError (and its recursion limits): report the parser's first line
            raise FileFormatError(f"{where}: not valid YAML: {str(exc).splitlines()[0]}") from None

    def check(self, where: str) -> None:
        """Finite, non-negative, consistent (cost_models.records.validate): one line naming the field."""
        validate_cluster(self.cluster, where)
        check_calibration(self.cluster, where)


@record
class ProfileFile(FileRecord):
    """profile.json: the model profile (and, from `planner profile`, the cluster it was taken on)."""

    schema_version: int = SCHEMA_VERSION
    kind: str = PROFILE_KIND
    model: ModelProfile
    cluster: ClusterProfile | None = None

    def check(self, where: str) -> None:
        """Numbers the planner cannot trust are refused in one line naming the field (cost_models.records.validate):
        the model, and the cluster `planner profile` recorded with it."""
        validate_model(self.model, where)
        if self.cluster is not None:
            validate_cluster(self.cluster, where, fix=PROFILE_FIX)
