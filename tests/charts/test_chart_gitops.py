"""The chart under GitOps (issue #14, section 5), rendered by the real helm binary.

Argo CD and `helm template` render without a cluster: `lookup` finds nothing, so a
generated secret would rotate at every render. These tests hold the chart to what makes
such renders safe: a switch that refuses to generate secrets, one hash-seed checksum on
every pod that reads the seed, full labels on pods, pinned images, a preStop pause, a
disruption budget that can be satisfied, and a ServiceMonitor only where its CRD exists.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import chart_template  # noqa: E402

CHART = REPO / "charts" / "cacheroute"
GITOPS = CHART / "ci" / "gitops-values.yaml"
RELEASE = "llm"
NAMESPACE = "inference"
SERVICE_MONITOR_API = "monitoring.coreos.com/v1/ServiceMonitor"
POD_COMPONENTS = ("gateway", "indexer", "vllm", "redis")

Obj = dict[str, Any]


@pytest.fixture(scope="module", autouse=True)
def helm_installed() -> None:
    path = chart_template.helm_binary()
    assert path.is_file(), f"no helm binary at {path}: run scripts/setup.sh"


def helm(tmp_path: Path, values: dict[str, Any] | None = None, *files: Path,
         api_versions: tuple[str, ...] = ()) -> list[Obj]:
    """`helm template` with values files, then `values` over them."""
    extra = tmp_path / "values.yaml"
    extra.write_text(yaml.safe_dump(values or {}))
    return chart_template.helm_template([*files, extra], name=RELEASE, namespace=NAMESPACE,
                                        api_versions=api_versions)


def refusal(tmp_path: Path, values: dict[str, Any], *files: Path) -> str:
    with pytest.raises(chart_template.HelmTemplateError) as excinfo:
        helm(tmp_path, values, *files)
    return str(excinfo.value)


def workload(objs: list[Obj], component: str) -> Obj:
    return next(o for o in objs if o["kind"] in ("Deployment", "StatefulSet")
                and o["metadata"]["labels"]["app.kubernetes.io/component"] == component)


def pod(objs: list[Obj], component: str) -> Obj:
    return workload(objs, component)["spec"]["template"]


def container(objs: list[Obj], component: str) -> Obj:
    [c] = pod(objs, component)["spec"]["containers"]
    return c


# ------------------------------------------------------------ secrets under GitOps


def test_without_the_switch_every_render_generates_new_secrets(tmp_path: Path) -> None:
    def secret_data() -> list[Any]:
        return [o["data"] for o in helm(tmp_path) if o["kind"] == "Secret"]

    assert secret_data() != secret_data()  # why requireExisting exists


@pytest.mark.parametrize(("missing", "named"), [
    ({}, "cache.hashSeed.existingSecret"),
    ({"cache": {"hashSeed": {"existingSecret": "s"}}}, "tenants.saltSecret.existingSecret"),
    ({"cache": {"hashSeed": {"existingSecret": "s"}},
      "tenants": {"saltSecret": {"existingSecret": "s"}}}, "tenants.apiKeys[default].existingSecret"),
    ({"cache": {"hashSeed": {"existingSecret": "s"}},
      "tenants": {"saltSecret": {"existingSecret": "s"},
                  "apiKeys": [{"name": "default", "tenant": "d", "existingSecret": "s",
                               "secretKey": "k"}]}}, "redis.auth.existingSecret"),
])
def test_require_existing_refuses_to_generate_and_names_the_value(
        tmp_path: Path, missing: dict[str, Any], named: str) -> None:
    message = refusal(tmp_path, {"secrets": {"requireExisting": True}, **missing})
    assert "secrets.requireExisting" in message and named in message
    # The in-process renderer refuses alike.
    with pytest.raises(helm_python.HelmError, match=r"secrets\.requireExisting"):
        chart_template.render({"secrets": {"requireExisting": True}, **missing})


def test_require_existing_renders_identically_from_existing_secrets(tmp_path: Path) -> None:
    first, second = helm(tmp_path, None, GITOPS), helm(tmp_path, None, GITOPS)
    assert first == second
    assert not [o for o in first if o["kind"] == "Secret"]
    refs = {(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for c in ("gateway", "indexer", "vllm") for e in container(first, c).get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs == {("fleet-hash-seed", "PYTHONHASHSEED"), ("fleet-tenants", "salt"),
                    ("fleet-tenants", "api-key-default"), ("fleet-tenants", "api-key-batch"),
                    ("fleet-redis", "redis-password")}


def test_require_existing_accepts_values_given_in_the_values(tmp_path: Path) -> None:
    objs = helm(tmp_path, {"secrets": {"requireExisting": True},
                           "cache": {"hashSeed": {"value": "1234"}},
                           "tenants": {"saltSecret": {"value": "x" * 32},
                                       "apiKeys": [{"name": "default", "tenant": "d",
                                                    "value": "sk-given"}]},
                           "redis": {"auth": {"password": "given"}}})
    assert objs == helm(tmp_path, {"secrets": {"requireExisting": True},
                                   "cache": {"hashSeed": {"value": "1234"}},
                                   "tenants": {"saltSecret": {"value": "x" * 32},
                                               "apiKeys": [{"name": "default", "tenant": "d",
                                                            "value": "sk-given"}]},
                                   "redis": {"auth": {"password": "given"}}})
    assert len([o for o in objs if o["kind"] == "Secret"]) == 3


# --------------------------------------------------------------- seed checksum


def test_every_pod_reading_the_seed_rolls_when_it_changes(tmp_path: Path) -> None:
    def seed_checksums(values: dict[str, Any]) -> set[str]:
        objs = helm(tmp_path, values)
        return {pod(objs, c)["metadata"]["annotations"]["checksum/hash-seed"]
                for c in ("gateway", "indexer", "vllm")}

    base = seed_checksums({})
    assert len(base) == 1  # one checksum: the replicas cannot lag the gateways
    assert seed_checksums({}) == base
    changed = seed_checksums({"cache": {"hashSeed": {"value": "42"}}})
    assert len(changed) == 1 and changed != base
    assert seed_checksums({"cache": {"hashSeed": {"existingSecret": "other"}}}) != base
    assert seed_checksums({"vllm": {"resources": {"requests": {"cpu": "8"}}}}) == base


# --------------------------------------------------------------------- labels


def test_pods_carry_common_and_standard_labels(tmp_path: Path) -> None:
    objs = helm(tmp_path, None, GITOPS)
    for component in POD_COMPONENTS:
        labels = pod(objs, component)["metadata"]["labels"]
        assert labels["team"] == "inference-platform" and labels["cost-center"] == "4711"
        assert labels["app.kubernetes.io/component"] == component
        assert labels["app.kubernetes.io/instance"] == RELEASE
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/version",
                    "app.kubernetes.io/managed-by", "app.kubernetes.io/part-of"):
            assert key in labels, (component, key)
        selector = workload(objs, component)["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels.items()
        assert "team" not in selector  # selectors are immutable: only the stable labels


# --------------------------------------------------------------------- images


def test_images_pin_digests(tmp_path: Path) -> None:
    objs = helm(tmp_path, None, GITOPS)
    images = {c: container(objs, c)["image"] for c in POD_COMPONENTS}
    assert images["gateway"] == ("ghcr.io/cacheroute/cacheroute:0.1.0@sha256:"
                                 "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef")
    assert images["vllm"].startswith("vllm/vllm-openai:v0.32.0@sha256:fedcba98")
    assert images["redis"].startswith("redis@sha256:1f2c1b9f")
    plain = helm(tmp_path)
    assert container(plain, "vllm")["image"] == "vllm/vllm-openai:v0.32.0"


@pytest.mark.parametrize(("values", "path"), [
    ({"vllm": {"image": {"tag": ""}}}, "/vllm/image"),
    ({"redis": {"image": {"tag": ""}}}, "/redis/image"),
    ({"vllm": {"image": {"tag": "latest"}}}, "/vllm/image/tag"),
    ({"gateway": {"image": {"tag": "latest"}}}, "/gateway/image/tag"),
    ({"gateway": {"image": {"digest": "sha256:short"}}}, "/gateway/image/digest"),
    ({"vllm": {"resources": {"requests": {"memory": "32 GiB"}}}}, "/vllm/resources/requests/memory"),
    ({"redis": {"resources": {"limits": {"cpu": "1.5cores"}}}}, "/redis/resources/limits/cpu"),
])
def test_schema_refuses_unpinned_images_and_bad_quantities(
        tmp_path: Path, values: dict[str, Any], path: str) -> None:
    assert path in refusal(tmp_path, values)


def test_good_quantities_pass(tmp_path: Path) -> None:
    objs = helm(tmp_path, {"vllm": {"resources": {"requests": {"cpu": "500m", "memory": "1.5Gi"},
                                                  "limits": {"memory": "64G", "cpu": 8}}}})
    assert container(objs, "vllm")["resources"]["requests"]["cpu"] == "500m"


# -------------------------------------------------------------- gateway drains


def test_gateway_pauses_before_sigterm(tmp_path: Path) -> None:
    lifecycle = container(helm(tmp_path), "gateway")["lifecycle"]
    assert lifecycle == {"preStop": {"exec": {"command": [
        "python", "-c", "import time; time.sleep(5)"]}}}
    assert "lifecycle" not in container(helm(tmp_path, {"gateway": {"preStopSleepSeconds": 0}}),
                                        "gateway")
    message = refusal(tmp_path, {"gateway": {"preStopSleepSeconds": 15}})
    assert "the grace period covers both" in message


@pytest.mark.parametrize("values", [
    {"gateway": {"replicaCount": 1}},
    {"gateway": {"replicaCount": 2, "pdb": {"minAvailable": 2}}},
    {"gateway": {"autoscaling": {"enabled": True, "minReplicas": 1}}},
])
def test_a_budget_no_drain_can_meet_is_refused(tmp_path: Path, values: dict[str, Any]) -> None:
    assert "no drain can ever evict a gateway pod" in refusal(tmp_path, values)


def test_budgets_a_drain_can_meet_render(tmp_path: Path) -> None:
    for values in ({"gateway": {"replicaCount": 1, "pdb": {"enabled": False}}},
                   {"gateway": {"replicaCount": 1, "pdb": {"minAvailable": 0}}},
                   {"gateway": {"replicaCount": 1, "pdb": {"minAvailable": "50%"}}},
                   {"gateway": {"replicaCount": 2}}):
        assert workload(helm(tmp_path, values), "gateway")


# ------------------------------------------------------------- ServiceMonitor


def test_service_monitors_only_where_their_crd_exists(tmp_path: Path) -> None:
    enabled = {"serviceMonitor": {"enabled": True}}
    assert not [o for o in helm(tmp_path, enabled) if o["kind"] == "ServiceMonitor"]
    with_crd = helm(tmp_path, enabled, api_versions=(SERVICE_MONITOR_API,))
    assert len([o for o in with_crd if o["kind"] == "ServiceMonitor"]) == 2
    disabled = helm(tmp_path, None, api_versions=(SERVICE_MONITOR_API,))
    assert not [o for o in disabled if o["kind"] == "ServiceMonitor"]
