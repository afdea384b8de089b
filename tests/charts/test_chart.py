"""The Helm chart: it renders, every object is valid Kubernetes, and what it renders routes.

Rendering runs Helm's own engine offline (helm-python-sdk); objects are checked against
the Kubernetes OpenAPI schemas kubernetes-validate ships. Beyond validity, the tests hold
the chart to what makes cache-aware routing work: the gateway's config and the replicas'
command line agree on block size, hash algorithm and seed (one Secret key); the indexer
is pointed at the ports the replicas publish events on; the gateway's own config loader
accepts the rendered config with the environment the pods get; the NetworkPolicies admit
exactly the flows the design needs.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import chart_template  # noqa: E402
import chart_values_table  # noqa: E402
import helm_python as helm  # noqa: E402

import router.cli.indexer  # noqa: E402
import router.cli.serve  # noqa: E402
import router.indexer  # noqa: E402
from replica.vllm_launcher import VllmSettings, vllm_command  # noqa: E402
from router.app import replica_sources  # noqa: E402
from router.config import load_config  # noqa: E402

CHART = REPO / "charts" / "cacheroute"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
NAMESPACE = "inference"
RELEASE = "llm"
SERVICE_MONITOR_API = "monitoring.coreos.com/v1/ServiceMonitor"

Obj = dict[str, Any]


# ----------------------------------------------------------------------------- helpers


def values_file(name: str) -> dict[str, Any]:
    return chart_template.load_values([CHART / "ci" / name])


def render(values: Mapping[str, Any] | None = None) -> list[Obj]:
    return chart_template.manifests(
        chart_template.render(values, name=RELEASE, namespace=NAMESPACE))


def one(objs: list[Obj], kind: str, component: str | None = None) -> Obj:
    found = [o for o in objs if o["kind"] == kind and
             (component is None or o["metadata"]["labels"].get("app.kubernetes.io/component") == component)]
    assert len(found) == 1, f"expected one {kind} {component or ''}, got {len(found)}"
    return found[0]


def workload(objs: list[Obj], component: str) -> Obj:
    return next(o for o in objs if o["kind"] in ("Deployment", "StatefulSet")
                and o["metadata"]["labels"]["app.kubernetes.io/component"] == component)


def container(objs: list[Obj], component: str) -> Obj:
    containers = workload(objs, component)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env_refs(c: Obj) -> dict[str, Any]:
    """Env name -> literal value, or (secret, key) for a secretKeyRef; the pod's own
    fields (fieldRef: its IP) are neither config nor secrets and are left out."""
    out: dict[str, Any] = {}
    for e in c.get("env", []):
        if "value" in e:
            out[e["name"]] = e["value"]
        elif "fieldRef" in e["valueFrom"]:
            continue
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            out[e["name"]] = (ref["name"], ref["key"])
    return out


def secrets(objs: list[Obj]) -> dict[tuple[str, str], str]:
    """(secret name, key) -> decoded value of every rendered Secret."""
    return {(o["metadata"]["name"], k): base64.b64decode(v).decode()
            for o in objs if o["kind"] == "Secret" for k, v in o.get("data", {}).items()}


def resolve_env(c: Obj, known: Mapping[tuple[str, str], str]) -> dict[str, str]:
    """The environment the container would get, with Secrets read from `known`."""
    out = {}
    for name, ref in env_refs(c).items():
        out[name] = known[ref] if isinstance(ref, tuple) else ref
    return out


def config_files(objs: list[Obj]) -> dict[str, dict[str, Any]]:
    data = one(objs, "ConfigMap")["data"]
    return {name: yaml.safe_load(text) for name, text in data.items()}


def flag_values(args: list[str]) -> dict[str, str | None]:
    """--flag value pairs of a command line; a flag followed by another flag is boolean."""
    out: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            out[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def pod_labels(objs: list[Obj], component: str) -> dict[str, str]:
    return workload(objs, component)["spec"]["template"]["metadata"]["labels"]


def port_numbers(objs: list[Obj], component: str) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container(objs, component)["ports"]}


def model_storage_values(tmp_path: Path, values: dict[str, Any]) -> dict[str, Any]:
    """`values` with the model volume mounted at tmp_path and the model's directory made."""
    merged = chart_template.merged_values(values)
    (tmp_path / merged["model"]["path"]).mkdir(parents=True)
    return {**values, "modelStorage": {**values.get("modelStorage", {}), "mountPath": str(tmp_path)}}


def write_configs(objs: list[Obj], tmp_path: Path) -> dict[str, Path]:
    out = {}
    for name, text in one(objs, "ConfigMap")["data"].items():
        path = tmp_path / "etc" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        out[name] = path
    return out


# Secrets the all-values file names but does not create: what the cluster would hold.
EXISTING_SECRETS = {
    ("fleet-hash-seed", "seed"): "3141592653",
    ("managed-redis", "password"): "managed-redis-password",
    ("tenant-salt", "hmac"): "a-salt-secret-from-the-platform-team",
    ("acme-api-key", "key"): "sk-acme-from-vault",
}


@pytest.fixture(scope="module")
def default_objs() -> list[Obj]:
    return render()


@pytest.fixture(scope="module")
def all_objs() -> list[Obj]:
    return render(values_file("all-values.yaml"))


# -------------------------------------------------------------- renders and validates


@pytest.mark.parametrize("values_name", ["default"] + [p.name for p in CI_VALUES])
def test_renders_and_every_object_is_valid_kubernetes(values_name: str) -> None:
    values = {} if values_name == "default" else values_file(values_name)
    objs = render(values)
    errors, unchecked = chart_template.validate(objs)
    assert errors == []
    # Only the Prometheus Operator's CRD has no schema in kubernetes-validate.
    assert {u.split("/")[0] for u in unchecked} <= {"ServiceMonitor"}
    assert chart_template.lint(values) == []


def with_monitoring_crd(values_name: str) -> list[Obj]:
    """`helm template` (the binary) on a cluster that has the Prometheus Operator's CRDs."""
    files = [] if values_name == "default" else [CHART / "ci" / values_name]
    return chart_template.helm_template(files, name=RELEASE, namespace=NAMESPACE,
                                        api_versions=[SERVICE_MONITOR_API])


def test_all_values_exercise_every_kind() -> None:
    kinds = sorted(o["kind"] for o in with_monitoring_crd("all-values.yaml"))
    assert kinds == sorted([
        "ConfigMap", "Deployment", "Deployment", "HorizontalPodAutoscaler", "NetworkPolicy",
        "NetworkPolicy", "NetworkPolicy", "PodDisruptionBudget", "PodDisruptionBudget",
        "Secret", "Service", "Service", "ServiceMonitor", "ServiceMonitor", "StatefulSet",
    ])
    redis_kinds = {o["kind"] for o in with_monitoring_crd("redis-values.yaml")}
    assert {"StatefulSet", "Secret", "ServiceMonitor"} <= redis_kinds
    assert not {"NetworkPolicy", "PodDisruptionBudget"} & redis_kinds


@pytest.mark.parametrize("values_name", ["default", "all-values.yaml", "redis-values.yaml"])
def test_service_monitors_select_a_service_port(values_name: str) -> None:
    objs = with_monitoring_crd(values_name)
    monitors = [o for o in objs if o["kind"] == "ServiceMonitor"]
    assert len(monitors) == {"default": 0, "all-values.yaml": 2, "redis-values.yaml": 1}[values_name]
    services = [o for o in objs if o["kind"] == "Service"]
    for sm in monitors:
        assert sm["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(sm) == {"apiVersion", "kind", "metadata", "spec"}
        spec = sm["spec"]
        assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        wanted = spec["selector"]["matchLabels"]
        matched = [s for s in services if wanted.items() <= s["metadata"]["labels"].items()]
        assert len(matched) == 1, sm["metadata"]["name"]
        port_names = {p["name"] for p in matched[0]["spec"]["ports"]}
        for endpoint in spec["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}
            assert endpoint["port"] in port_names
            assert endpoint["path"] == "/metrics"
            assert endpoint["interval"].endswith("s") and endpoint["scrapeTimeout"].endswith("s")
    if values_name == "all-values.yaml":
        assert all(sm["metadata"]["labels"]["release"] == "kube-prometheus" for sm in monitors)


# -------------------------------------------------- the settings that make routing work


@pytest.mark.parametrize("values_name", ["default", "all-values.yaml", "redis-values.yaml"])
def test_gateway_indexer_and_replicas_share_one_seed_secret_key(values_name: str) -> None:
    values = {} if values_name == "default" else values_file(values_name)
    objs = render(values)
    replica_seed = env_refs(container(objs, "vllm"))["PYTHONHASHSEED"]
    configs = config_files(objs)
    entries = len(configs["gateway.yaml"]["replicas"])
    assert entries == {"default": 2, "all-values.yaml": 1, "redis-values.yaml": 2}[values_name]
    for component in ("gateway", "indexer"):
        seeds = {name: ref for name, ref in env_refs(container(objs, component)).items()
                 if name.endswith("__HASH_SEED")}
        # Every replica entry's hash_seed, from the one Secret key the replicas read.
        assert seeds == {f"CACHEROUTE_REPLICAS__{i}__HASH_SEED": replica_seed for i in range(entries)}
    for name, config in configs.items():
        assert all("hash_seed" not in r for r in config["replicas"]), f"{name} must not carry the seed"
    rendered = secrets(objs)
    if values_name == "all-values.yaml":
        assert replica_seed == ("fleet-hash-seed", "seed")
        assert not any(name == "fleet-hash-seed" for name, _ in rendered)
    else:
        seed = rendered[replica_seed]
        # Python refuses to start with any other PYTHONHASHSEED.
        assert seed.isdigit() and 0 <= int(seed) <= 4294967295
        if values_name == "redis-values.yaml":
            assert seed == "4294967295"


@pytest.mark.parametrize("values_name", ["default", "all-values.yaml", "redis-values.yaml"])
def test_block_size_and_hash_algo_agree(values_name: str) -> None:
    values = {} if values_name == "default" else values_file(values_name)
    objs = render(values)
    flags = flag_values(container(objs, "vllm")["args"])
    assert "--enable-prefix-caching" in flags and "--enable-prompt-tokens-details" in flags
    for name, config in config_files(objs).items():
        for replica in config["replicas"]:
            assert str(replica["block_size"]) == flags["--block-size"], name
            assert replica["hash_algo"] == flags["--prefix-caching-hash-algo"], name
    expected = {"default": ("16", "sha256"), "all-values.yaml": ("32", "xxhash"),
                "redis-values.yaml": ("16", "sha256_cbor")}[values_name]
    assert (flags["--block-size"], flags["--prefix-caching-hash-algo"]) == expected


@pytest.mark.parametrize("values_name", ["default", "all-values.yaml"])
def test_event_ports_are_published_and_the_indexer_subscribes_to_them(values_name: str) -> None:
    values = {} if values_name == "default" else values_file(values_name)
    objs = render(values)
    ports = port_numbers(objs, "vllm")
    events = json.loads(flag_values(container(objs, "vllm")["args"])["--kv-events-config"] or "")
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    # A wildcard endpoint makes vLLM bind; the indexer connects in.
    assert events["endpoint"] == f"tcp://*:{ports['kv-events']}"
    assert events["replay_endpoint"] == f"tcp://*:{ports['kv-replay']}"

    headless = next(o for o in objs if o["kind"] == "Service" and o["spec"].get("clusterIP") == "None")
    assert headless["spec"]["selector"].items() <= pod_labels(objs, "vllm").items()
    assert {p["name"]: p["port"] for p in headless["spec"]["ports"]} == ports

    statefulset = workload(objs, "vllm")
    assert statefulset["spec"]["serviceName"] == headless["metadata"]["name"]
    domain = "corp.internal" if values_name == "all-values.yaml" else "cluster.local"
    service_host = f"{headless['metadata']['name']}.{NAMESPACE}.svc.{domain}"
    configs = config_files(objs)
    assert configs["gateway.yaml"]["replicas"] == configs["indexer.yaml"]["replicas"]
    replicas = configs["indexer.yaml"]["replicas"]
    if values_name == "all-values.yaml":  # discovery: dns, the Service's name
        assert replicas == [{
            "name": statefulset["metadata"]["name"], "dns": f"{service_host}:{ports['http']}",
            "kv_events": f"tcp://{{host}}:{ports['kv-events']}",
            "kv_replay": f"tcp://{{host}}:{ports['kv-replay']}",
            "models": ["qwen2.5-7b"], "block_size": 32, "hash_algo": "xxhash"}]
    else:  # discovery: pods, each StatefulSet pod by its stable name
        assert len(replicas) == statefulset["spec"]["replicas"] == 2
        for i, replica in enumerate(replicas):
            pod = f"{statefulset['metadata']['name']}-{i}"
            assert replica["name"] == pod
            assert replica["url"] == f"http://{pod}.{service_host}:{ports['http']}"
            assert replica["kv_events"] == f"tcp://{pod}.{service_host}:{ports['kv-events']}"
            assert replica["kv_replay"] == f"tcp://{pod}.{service_host}:{ports['kv-replay']}"
        # Pod names resolve from the start, so the indexer sees a replica's first events.
        assert headless["spec"]["publishNotReadyAddresses"] is True
    indexer = container(objs, "indexer")
    assert indexer["command"][3:6] == ["indexer", "--config", "/etc/cacheroute/indexer.yaml"]
    assert workload(objs, "indexer")["spec"]["strategy"] == {"type": "Recreate"}
    assert workload(objs, "indexer")["spec"]["replicas"] == 1


def test_indexer_feeds_every_replica_under_the_gateways_replica_ids(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    objs = render(model_storage_values(tmp_path, {"vllm": {"replicaCount": 3}}))
    known = secrets(objs)
    files = write_configs(objs, tmp_path)
    gateway = load_config(str(files["gateway.yaml"]), resolve_env(container(objs, "gateway"), known), [])
    targets = [source.target() for source in replica_sources(gateway)]

    for name, value in resolve_env(container(objs, "indexer"), known).items():
        monkeypatch.setenv(name, value)
    # The indexer's own reading of its config (python -m router indexer --config ...).
    read = router.indexer.feeds_from_config(str(files["indexer.yaml"]))
    feeds, index_url, password = read.static, read.index_url, read.password
    assert read.dns == []  # the default discovery lists each pod by its stable name
    assert [(f.replica_id, f.endpoint, f.replay_endpoint, f.model) for f in feeds] == [
        (t.replica_id, t.kv_events, t.kv_replay, "llama-3.1-8b-instruct") for t in targets]
    assert len(feeds) == 3
    assert (index_url, password) == (gateway.index.backend, gateway.index.password)


def test_replica_command_matches_the_launcher(default_objs: list[Obj], all_objs: list[Obj]) -> None:
    for objs, values in ((default_objs, {}), (all_objs, values_file("all-values.yaml"))):
        merged = chart_template.merged_values(values)
        c = container(objs, "vllm")
        flags = flag_values(c["args"])
        settings = VllmSettings(
            model=flags["--model"] or "", port=merged["vllm"]["port"], host="0.0.0.0",
            block_size=merged["cache"]["blockSize"], hash_algo=merged["cache"]["hashAlgo"],
            seed="1", kv_events_port=merged["vllm"]["kvEvents"]["port"],
            kv_replay_port=merged["vllm"]["kvEvents"]["replayPort"],
            gpu_memory_utilization=merged["vllm"]["gpuMemoryUtilization"],
            served_model_name=merged["model"]["name"], gpu=True,
            # The indexer subscribes from another pod (the NetworkPolicy admits only it).
            kv_events_bind_host="*",
        )
        argv, env = vllm_command(settings)
        assert c["command"][1:] == argv[1:3]  # -m vllm.entrypoints.openai.api_server
        launcher = flag_values(argv[3:])
        for flag, value in launcher.items():
            assert flag in flags, flag
            if flag == "--kv-events-config":
                assert json.loads(flags[flag] or "") == json.loads(value or ""), flag
            elif flag == "--gpu-memory-utilization":
                assert float(flags[flag] or "") == float(value or ""), flag
            else:
                assert flags[flag] == value, flag
        assert set(env) <= set(env_refs(c))
    assert flag_values(container(all_objs, "vllm")["args"])["--model"] == "/mnt/models/qwen/Qwen2.5-7B-Instruct"


@pytest.mark.parametrize("values_name", ["default", "all-values.yaml"])
def test_gpu_requests_and_tensor_parallelism(values_name: str) -> None:
    values = {} if values_name == "default" else values_file(values_name)
    objs = render(values)
    c = container(objs, "vllm")
    gpu, count = {"default": ("nvidia.com/gpu", 1), "all-values.yaml": ("amd.com/gpu", 2)}[values_name]
    assert c["resources"]["requests"][gpu] == count
    assert c["resources"]["limits"][gpu] == count
    assert flag_values(c["args"])["--tensor-parallel-size"] == str(count)
    pod = workload(objs, "vllm")["spec"]["template"]["spec"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    for component in ("gateway", "indexer"):
        assert not any("gpu" in k for k in container(objs, component)["resources"].get("requests", {}))


def test_probes(default_objs: list[Obj]) -> None:
    gateway = container(default_objs, "gateway")
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    vllm = container(default_objs, "vllm")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert vllm[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = vllm["startupProbe"]
    # Loading a model takes minutes: the startup probe must allow well over ten.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1200
    redis = container(default_objs, "redis")
    assert redis["readinessProbe"]["tcpSocket"] == {"port": "redis"}


def test_indexer_probes_its_health_endpoint_on_the_pod_ip(default_objs: list[Obj]) -> None:
    indexer = container(default_objs, "indexer")
    for probe in ("readinessProbe", "livenessProbe"):
        assert indexer[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "health", "containerPort": 8091, "protocol": "TCP"} in indexer["ports"]
    args = indexer["command"]
    assert args[args.index("--health-port") + 1] == "8091"
    assert args[args.index("--health-host") + 1] == "$(POD_IP)"
    pod_ip = next(e for e in indexer["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # A minute of a dead stream or an unreachable Redis before a restart, not one blip.
    live = indexer["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 60


def test_pods_run_unprivileged(default_objs: list[Obj]) -> None:
    for o in default_objs:
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = o["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, o["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False
        # Service links would inject CACHEROUTE_* variables the config loader reads.
        assert pod["enableServiceLinks"] is False
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert "memory" in c["resources"]["limits"]


# -------------------------------------------------- the gateway's own loader accepts it


def test_router_config_loads_the_rendered_gateway_and_indexer_configs(tmp_path: Path) -> None:
    objs = render(model_storage_values(tmp_path, {}))
    known = secrets(objs)
    files = write_configs(objs, tmp_path)
    gateway_env = resolve_env(container(objs, "gateway"), known)
    config = load_config(str(files["gateway.yaml"]), gateway_env, [])

    seed = known[(f"{RELEASE}-cacheroute-hash-seed", "PYTHONHASHSEED")]
    assert len(config.replicas) == 2
    for i, replica in enumerate(config.replicas):
        assert replica.hash.seed == seed and replica.hash_seed == seed
        assert (replica.block_size, replica.hash_algo) == (16, "sha256")
        assert replica.url == (f"http://{RELEASE}-cacheroute-vllm-{i}.{RELEASE}-cacheroute-vllm-headless"
                               f".{NAMESPACE}.svc.cluster.local:8000")
    assert config.listen.host == "0.0.0.0" and config.listen.port == 8000
    assert config.index.backend == f"redis://{RELEASE}-cacheroute-redis.{NAMESPACE}.svc.cluster.local:6379/0"
    assert config.index.password == known[(f"{RELEASE}-cacheroute-redis", "redis-password")]
    assert config.tenants.secret == known[(f"{RELEASE}-cacheroute-tenants", "salt-secret")].encode()
    [key] = config.tenants.keys
    assert key.key == known[(f"{RELEASE}-cacheroute-tenants", "api-key-default")] and key.salted
    assert config.models["llama-3.1-8b-instruct"].tokenizer == str(tmp_path / "llama-3.1-8b-instruct")
    # Several gateway pods share work and prompt pieces through the index by default.
    assert config.policy.share_work and config.index.share_segments
    assert config.index.segment_ttl_s == 600
    assert config.index.mirror_events  # lookups in each pod's own mirror of the events

    # The indexer gets the seed and the Redis password, and no API key or salt secret.
    indexer_env = resolve_env(container(objs, "indexer"), known)
    assert set(indexer_env) == {"CACHEROUTE_REPLICAS__0__HASH_SEED", "CACHEROUTE_REPLICAS__1__HASH_SEED",
                                "CACHEROUTE_REDIS_PASSWORD", "HOME"}
    indexer = load_config(str(files["indexer.yaml"]), indexer_env, [])
    assert indexer.replicas == config.replicas
    assert indexer.index == config.index


def test_router_config_loads_the_all_values_config(tmp_path: Path) -> None:
    objs = render(model_storage_values(tmp_path, values_file("all-values.yaml")))
    known = {**secrets(objs), **EXISTING_SECRETS}
    files = write_configs(objs, tmp_path)
    config = load_config(str(files["gateway.yaml"]), resolve_env(container(objs, "gateway"), known), [])
    [replica] = config.replicas
    # xxhash without a seed is refused by the loader: the seed must arrive through the env.
    assert (replica.block_size, replica.hash_algo, replica.hash.seed) == (32, "xxhash", "3141592653")
    assert replica.dns == "llm-edge-vllm-headless.inference.svc.corp.internal:8080"
    assert config.index.backend == "rediss://index.redis.corp.internal:6380/2"
    assert config.index.password == "managed-redis-password"
    assert config.index.record_ttl_s == 600  # gateway.config deep-merged
    assert not config.policy.share_work and not config.index.share_segments
    assert config.index.segment_ttl_s == 120
    assert not config.index.mirror_events
    assert config.proxy.first_token_timeout_s == 120 and config.proxy.expose_routing_headers
    assert config.policy.name == "least_loaded" and config.policy.tolerance == 0.2  # extraEnv
    assert config.listen.port == 9000
    assert config.tenants.allow_anonymous
    keys = {k.tenant: k for k in config.tenants.keys}
    assert keys["acme"].key == "sk-acme-from-vault" and keys["acme"].allow_client_salt == "namespace"
    assert keys["docs-bot"].key == "sk-docs-bot-0123456789" and not keys["docs-bot"].salted
    assert keys["batch"].key.startswith("sk-") and keys["batch"].salted
    assert config.tenants.secret == b"a-salt-secret-from-the-platform-team"


@pytest.mark.parametrize("values_name", ["default", "all-values.yaml"])
def test_gateway_and_indexer_command_lines_parse(values_name: str) -> None:
    values = {} if values_name == "default" else values_file(values_name)
    objs = render(values)
    commands = {c: container(objs, c)["command"] for c in ("gateway", "indexer")}
    for component, (module, sub) in {"gateway": (router.cli.serve, "serve"),
                                     "indexer": (router.cli.indexer, "indexer")}.items():
        command = commands[component]
        assert command[:4] == ["python", "-m", "router", sub]
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        args = parser.parse_args(command[4:])
        assert args.config == f"/etc/cacheroute/{'gateway' if sub == 'serve' else 'indexer'}.yaml"
        assert args.log_level == ("DEBUG" if values_name == "all-values.yaml" else "INFO")
        if sub == "indexer":
            # Only a leased indexer stores the positions a starting gateway's mirror
            # seeds from (router/index/mirror.py).
            assert args.lease
    serve_args = argparse.ArgumentParser()
    router.cli.serve.add_arguments(serve_args)
    timeout = serve_args.parse_args(commands["gateway"][4:]).shutdown_timeout
    grace = workload(objs, "gateway")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert timeout < grace
    assert timeout == (240 if values_name == "all-values.yaml" else 50)


@pytest.mark.parametrize("values_name", ["default", "all-values.yaml", "redis-values.yaml"])
def test_every_secret_reference_resolves(values_name: str) -> None:
    values = {} if values_name == "default" else values_file(values_name)
    objs = render(values)
    available = set(secrets(objs)) | (set(EXISTING_SECRETS) if values_name == "all-values.yaml" else set())
    refs = [ref for o in objs if o["kind"] in ("Deployment", "StatefulSet")
            for c in o["spec"]["template"]["spec"]["containers"]
            for ref in env_refs(c).values() if isinstance(ref, tuple)]
    assert refs
    missing = [ref for ref in refs if ref not in available]
    assert missing == []


def test_external_redis_replaces_the_internal_one(all_objs: list[Obj]) -> None:
    assert not any(o["metadata"]["labels"].get("app.kubernetes.io/component") == "redis" for o in all_objs)
    for component in ("gateway", "indexer"):
        assert env_refs(container(all_objs, component))["CACHEROUTE_REDIS_PASSWORD"] == ("managed-redis", "password")


# ----------------------------------------------------------------------- NetworkPolicy


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "this evaluator reads matchLabels only"
    return selector.get("matchLabels", {}).items() <= labels.items()


def allowed(policies: list[Obj], src: tuple[str, Mapping[str, str]], dst_labels: Mapping[str, str],
            dst_ports: Mapping[str, int], port: str) -> bool:
    """Whether NetworkPolicy semantics admit a TCP connection from pod `src` (namespace,
    labels) in to `port` (a container port name) of a pod of NAMESPACE labelled `dst_labels`."""
    src_ns, src_labels = src
    ns_labels = {"kubernetes.io/metadata.name": src_ns}
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], dst_labels)
                 and "Ingress" in p["spec"]["policyTypes"]]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            rule_ports = rule.get("ports")
            if rule_ports and not any(p["port"] in (port, dst_ports[port]) and p.get("protocol", "TCP") == "TCP"
                                      for p in rule_ports):
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                ns_ok = (_selects(peer["namespaceSelector"], ns_labels) if "namespaceSelector" in peer
                         else src_ns == NAMESPACE)
                pod_ok = _selects(peer["podSelector"], src_labels) if "podSelector" in peer else True
                if "ipBlock" not in peer and ns_ok and pod_ok:
                    return True
    return False


@pytest.mark.parametrize("values_name", ["default", "all-values.yaml"])
def test_network_policies_admit_only_the_designed_flows(values_name: str) -> None:
    values = {} if values_name == "default" else values_file(values_name)
    objs = render(values)
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    pods = {c: (NAMESPACE, pod_labels(objs, c)) for c in ("gateway", "indexer", "vllm")}
    pods["stranger"] = (NAMESPACE, {"app": "something-else"})
    pods["prometheus"] = ("monitoring", {"app.kubernetes.io/name": "prometheus"})
    pods["ingress"] = ("ingress", {"app": "ingress-nginx"})
    targets = ["gateway", "vllm"]
    if values_name == "default":
        targets.append("redis")
        pods["redis"] = (NAMESPACE, pod_labels(objs, "redis"))

    def can(src: str, dst: str, port: str) -> bool:
        return allowed(policies, pods[src], pod_labels(objs, dst), port_numbers(objs, dst), port)

    for src in pods:
        assert can(src, "vllm", "http") == (src == "gateway" or
                                            (values_name == "all-values.yaml" and src == "prometheus")), src
        # By default each gateway mirrors the events too (gateway.index.mirrorEvents).
        subscribers = ("indexer", "gateway") if values_name == "default" else ("indexer",)
        assert can(src, "vllm", "kv-events") == (src in subscribers), src
        assert can(src, "vllm", "kv-replay") == (src in subscribers), src
        if "redis" in targets:
            assert can(src, "redis", "redis") == (src in ("gateway", "indexer")), src
        gateway_open = src in ("ingress", "prometheus") if values_name == "all-values.yaml" else True
        assert can(src, "gateway", "http") == gateway_open, src


def test_network_policies_can_be_turned_off() -> None:
    objs = render({"networkPolicy": {"enabled": False}})
    assert not [o for o in objs if o["kind"] == "NetworkPolicy"]


# ------------------------------------------------------------------ values and schema


@pytest.mark.parametrize(("values", "path"), [
    ({"cache": {"blockSize": 0}}, "/cache/blockSize"),
    ({"cache": {"hashAlgo": "md5"}}, "/cache/hashAlgo"),
    ({"cache": {"hashSeed": {"value": "random"}}}, "/cache/hashSeed/value"),
    ({"cache": {"hashSeed": {"value": 42}}}, "/cache/hashSeed/value"),
    ({"gateway": {"replicaCount": 0}}, "/gateway/replicaCount"),
    ({"gateway": {"policy": {"name": "fastest"}}}, "/gateway/policy/name"),
    ({"gateway": {"pdb": {"minAvailable": "half"}}}, "/gateway/pdb/minAvailable"),
    ({"gateway": {"replicaCont": 3}}, "/gateway"),
    ({"gateway": {"policy": {"name": "cache_aware", "shareWork": "yes"}}}, "/gateway/policy/shareWork"),
    ({"gateway": {"index": {"segmentTtlSeconds": 0}}}, "/gateway/index/segmentTtlSeconds"),
    ({"gatway": {}}, "additional properties 'gatway'"),
    ({"vllm": {"gpuMemoryUtilization": 1.5}}, "/vllm/gpuMemoryUtilization"),
    ({"vllm": {"kvEvents": {"port": 70000}}}, "/vllm/kvEvents/port"),
    ({"redis": {"enabled": False}}, "/redis/external/url"),
    ({"redis": {"enabled": False, "external": {"url": "http://redis:6379"}}}, "/redis/external/url"),
    ({"tenants": {"apiKeys": [{"name": "bad-name", "tenant": "t"}]}}, "/tenants/apiKeys/0/name"),
    ({"tenants": {"apiKeys": [{"name": "a", "tenant": "t", "existingSecret": "s"}]}}, "/tenants/apiKeys/0"),
    ({"tenants": {"saltSecret": {"value": "short"}}}, "/tenants/saltSecret/value"),
    ({"serviceMonitor": {"interval": "often"}}, "/serviceMonitor/interval"),
    ({"vllm": {"image": {"tag": ""}}}, "/vllm/image"),
    ({"vllm": {"image": {"tag": "latest"}}}, "/vllm/image/tag"),
    ({"gateway": {"image": {"tag": "latest"}}}, "/gateway/image/tag"),
    ({"redis": {"image": {"tag": "latest"}}}, "/redis/image/tag"),
    ({"vllm": {"image": {"digest": "sha256:abc"}}}, "/vllm/image/digest"),
    ({"gateway": {"resources": {"requests": {"cpu": "lots"}}}}, "/gateway/resources/requests/cpu"),
    ({"vllm": {"resources": {"limits": {"memory": "64 GB"}}}}, "/vllm/resources/limits/memory"),
    ({"indexer": {"resources": {"requests": {"memory": -1}}}}, "/indexer/resources/requests/memory"),
    ({"secrets": {"requireExisting": "yes"}}, "/secrets/requireExisting"),
    ({"indexer": {"healthPort": 70000}}, "/indexer/healthPort"),
    ({"indexer": {"livenessProbe": {"periodSeconds": 0}}}, "/indexer/livenessProbe/periodSeconds"),
])
def test_schema_rejects_bad_values(values: dict[str, Any], path: str) -> None:
    with pytest.raises(helm.HelmValuesError) as excinfo:
        chart_template.render(values)
    assert path in str(excinfo.value)
    assert any(path in finding for finding in chart_template.lint(values))


@pytest.mark.parametrize(("values", "message"), [
    ({"cache": {"hashSeed": {"value": "4294967296"}}}, "at most 4294967295"),
    ({"gateway": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}}, "exceeds maxReplicas"),
    ({"modelStorage": {"existingClaim": ""}}, "modelStorage.existingClaim or modelStorage.volume"),
    ({"gateway": {"shutdownTimeoutSeconds": 60}}, "must be below gateway.terminationGracePeriodSeconds"),
    ({"gateway": {"preStopSleepSeconds": 10}}, "plus gateway.shutdownTimeoutSeconds (50) must be below"),
    ({"gateway": {"replicaCount": 1}}, "gateway.pdb.minAvailable (1) must be below the gateway's pod count (1"),
    ({"gateway": {"autoscaling": {"enabled": True, "minReplicas": 2}, "pdb": {"minAvailable": 2}}},
     "(2: gateway.autoscaling.minReplicas)"),
])
def test_templates_refuse_values_the_schema_cannot_express(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError) as excinfo:
        chart_template.render(values)
    assert message in str(excinfo.value)


def test_config_checksum_rolls_pods_only_when_the_config_changes() -> None:
    def checksums(values: dict[str, Any]) -> tuple[str, ...]:
        objs = render(values)
        return tuple(workload(objs, c)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
                     for c in ("gateway", "indexer"))

    base = checksums({})
    assert checksums({}) == base
    changed = checksums({"gateway": {"config": {"proxy": {"max_retries": 5}}}})
    assert changed[0] != base[0] and changed[1] != base[1]
    assert checksums({"vllm": {"resources": {"requests": {"cpu": "6"}}}}) == base
    # With discovery: pods the config lists every replica: scaling them updates the gateways.
    assert checksums({"vllm": {"replicaCount": 7}})[0] != base[0]


def test_gateway_scaling_objects(default_objs: list[Obj], all_objs: list[Obj]) -> None:
    gateway = workload(default_objs, "gateway")
    assert gateway["spec"]["replicas"] == 3
    assert gateway["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pdb = one(default_objs, "PodDisruptionBudget", "gateway")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels(default_objs, "gateway").items()
    assert not [o for o in default_objs if o["kind"] == "HorizontalPodAutoscaler"]

    # With the HPA on, the Deployment leaves replicas to it.
    assert "replicas" not in workload(all_objs, "gateway")["spec"]
    hpa = one(all_objs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": workload(all_objs, "gateway")["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (4, 20)


def test_notes_show_a_first_request() -> None:
    text = chart_template.notes(chart_template.render({}, name=RELEASE, namespace=NAMESPACE))
    assert f"kubectl -n {NAMESPACE} port-forward service/{RELEASE}-cacheroute-gateway 8000:8000" in text
    assert (f"get secret {RELEASE}-cacheroute-tenants -o jsonpath='{{.data.api-key-default}}' | base64 -d"
            in text)
    assert "curl -s http://127.0.0.1:8000/v1/chat/completions" in text
    assert 'Authorization: Bearer $API_KEY' in text
    assert '"model": "llama-3.1-8b-instruct"' in text
    text = chart_template.notes(chart_template.render(values_file("all-values.yaml"), name=RELEASE,
                                                      namespace=NAMESPACE))
    assert "get secret acme-api-key -o jsonpath='{.data.key}'" in text
    assert '"model": "qwen2.5-7b"' in text


# ------------------------------------------------------------------------ values table


def test_readme_values_table_is_up_to_date() -> None:
    assert chart_values_table.main(["--check"]) == 0


def test_values_table_generator_notices_stale_tables_and_undocumented_keys(tmp_path: Path) -> None:
    chart = tmp_path / "chart"
    chart.mkdir()
    shutil.copy(CHART / "README.md", chart / "README.md")
    values = (CHART / "values.yaml").read_text()
    (chart / "values.yaml").write_text(values.replace("Tokens per KV-cache block", "Tokens per block"))
    assert chart_values_table.main(["--chart", str(chart), "--check"]) == 1
    assert chart_values_table.main(["--chart", str(chart)]) == 0
    assert "| `cache.blockSize` | int | `16` | Tokens per block:" in (chart / "README.md").read_text()
    assert chart_values_table.main(["--chart", str(chart), "--check"]) == 0

    (chart / "values.yaml").write_text(values + "newSetting:\n  enabled: true\n")
    _docs, undocumented = chart_values_table.collect((chart / "values.yaml").read_text())
    assert undocumented == ["newSetting.enabled"]
    assert chart_values_table.main(["--chart", str(chart)]) == 1
