"""The container images' recipes and the Kubernetes patterns, checked offline.

Each pattern in ``deploy/k8s`` is rendered as an operator applies it (``kubectl
kustomize``), every object validated against the Kubernetes API's schemas
(``kubernetes-validate``), and what the objects tell the daemon (its config file,
its ``KVSTORE_*`` variables) loaded through the daemon's own config loader: a
setting the daemon does not know fails here, not in a crash-looping pod. The
mounts, probes and sizes are then checked against that config.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvstore.config import parse_size
from kvstore.kinds import TierKind
from kvstore.server.config import ServiceConfig

ROOT = Path(__file__).resolve().parents[2]
PATTERNS = ("sidecar", "daemonset", "redis-cluster")
KUBERNETES = "1.33"  # native sidecars (restartPolicy Always) are beta from 1.29
DOCKERFILES = (ROOT / "Dockerfile", ROOT / "deploy" / "docker" / "vllm.Dockerfile")
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl (its kustomize) is not installed: nothing renders the patterns"
)

Object = dict[str, Any]


@functools.cache
def render(pattern: str) -> list[Object]:
    """The pattern's objects, rendered once per session (the tests only read them)."""
    assert KUBECTL is not None
    done = subprocess.run(
        [KUBECTL, "kustomize", str(ROOT / "deploy" / "k8s" / pattern)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def named(objects: list[Object], kind: str, name: str | None = None) -> Object:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def pod_of(objects: list[Object]) -> Object:
    """The pod template of the kvstore daemon's workload (Deployment or DaemonSet)."""
    for obj in objects:
        if obj["kind"] in ("Deployment", "DaemonSet"):
            return dict(obj["spec"]["template"])
    raise AssertionError("no workload runs kvstore")


def containers(pod: Object) -> Iterator[Object]:
    spec = pod["spec"]
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def daemon_container(pod: Object) -> Object:
    (daemon,) = [c for c in containers(pod) if c["args"] == ["serve"]]
    return daemon


def environment(container: Object) -> dict[str, str]:
    """The container's variables, a Secret's value standing in for each reference."""
    return {e["name"]: e.get("value", "from-a-secret") for e in container.get("env", [])}


def loaded(objects: list[Object], pod: Object, tmp_path: Path) -> ServiceConfig:
    """The daemon's settings as the pod gives them, through its own loader."""
    daemon = daemon_container(pod)
    env = environment(daemon)
    mounts = {m["name"]: m["mountPath"] for m in daemon["volumeMounts"]}
    (config_volume,) = [v for v in pod["spec"]["volumes"] if "configMap" in v]
    config_map = named(objects, "ConfigMap", config_volume["configMap"]["name"])
    directory = tmp_path / "etc"
    directory.mkdir()
    for file, text in config_map["data"].items():
        (directory / file).write_text(text)
    path = Path(env["KVSTORE_CONFIG"])
    assert path.parent == Path(mounts[config_volume["name"]])
    return ServiceConfig.load(directory / path.name, env)


def quantity(text: str) -> int:
    """Bytes of a Kubernetes quantity in binary units ("10Gi")."""
    return parse_size(text.replace("i", "iB") if text.endswith("i") else text)


def volume_for(pod: Object, container: Object, path: str) -> Object:
    """The pod volume that ``container`` mounts at ``path`` or above it."""
    best = max(
        (m for m in container["volumeMounts"] if Path(path).is_relative_to(m["mountPath"])),
        key=lambda m: len(m["mountPath"]),
        default=None,
    )
    assert best is not None, f"{container['name']}: nothing mounted at {path}"
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == best["name"]]
    return dict(volume)


# -- the images ------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_dockerfiles_pass_hadolint(dockerfile: Path) -> None:
    hadolint = Path(sys.executable).with_name("hadolint")
    done = subprocess.run(
        [str(hadolint), str(dockerfile)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_images_default_settings_load_and_its_health_check_finds_the_socket(
    tmp_path: Path,
) -> None:
    text = DOCKERFILES[0].read_text()
    config = ServiceConfig.load(ROOT / "deploy" / "docker" / "kvstore.toml", {})
    assert config.daemon.socket_path == Path("/run/kvstore/kvstore.sock")
    assert f"unix://{config.daemon.socket_path}" in text.split("HEALTHCHECK", 1)[1]
    assert "USER 10001" in text and "install -d -o kvstore -g kvstore /var/lib/kvstore" in text


# -- the Kubernetes patterns -------------------------------------------------------------


@needs_kubectl
@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_object_of_a_pattern_is_valid_kubernetes(pattern: str) -> None:
    objects = render(pattern)
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":
            continue  # a custom resource: checked against its Service below
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


@needs_kubectl
@pytest.mark.parametrize("pattern", PATTERNS)
def test_what_a_pattern_tells_the_daemon_is_what_the_daemon_accepts(
    pattern: str, tmp_path: Path
) -> None:
    objects = render(pattern)
    pod = pod_of(objects)
    config = loaded(objects, pod, tmp_path)
    daemon = daemon_container(pod)
    socket = str(config.daemon.socket_path)
    assert volume_for(pod, daemon, socket) and volume_for(pod, daemon, str(config.store.data_dir))
    for probe in ("startupProbe", "readinessProbe"):
        assert f"unix://{socket}" in daemon[probe]["exec"]["command"]
    assert daemon["livenessProbe"]["httpGet"]["path"] == "/healthz"  # open without a token
    (port,) = daemon["ports"]
    assert port["containerPort"] == config.daemon.tcp_port
    assert config.daemon.auth_token  # TCP needs one: it comes from the Secret
    token = named(objects, "Secret", "kvstore-token")
    assert "token" in token["stringData"]
    # Every engine container of the pod reaches the daemon by the same socket.
    for engine in containers(pod):
        if engine is not daemon:
            assert volume_for(pod, engine, socket) == volume_for(pod, daemon, socket)
            assert socket in " ".join(engine["args"])


@needs_kubectl
@pytest.mark.parametrize("pattern", PATTERNS)
def test_dev_shm_holds_the_dram_arena_and_memory_counts_it(pattern: str, tmp_path: Path) -> None:
    objects = render(pattern)
    pod = pod_of(objects)
    config = loaded(objects, pod, tmp_path)
    daemon = daemon_container(pod)
    (dram,) = [t for t in config.store.tiers if t.kind is TierKind.DRAM]
    shm = volume_for(pod, daemon, "/dev/shm")
    limit = quantity(daemon["resources"]["limits"]["memory"])
    assert limit >= dram.capacity_bytes * 1.1
    if "emptyDir" in shm:  # the pod's own: sized above the arena
        assert shm["emptyDir"]["medium"] == "Memory"
        assert quantity(shm["emptyDir"]["sizeLimit"]) >= dram.capacity_bytes * 1.001
    else:  # the node's: shared by every pod that mounts it
        assert shm["hostPath"]["path"] == "/dev/shm"
    assert daemon["resources"]["requests"]["memory"] == daemon["resources"]["limits"]["memory"]


@needs_kubectl
def test_an_engine_of_the_daemonset_mounts_what_the_daemon_serves_from(tmp_path: Path) -> None:
    objects = render("daemonset")
    pod = pod_of(objects)
    config = loaded(objects, pod, tmp_path)
    daemon = daemon_container(pod)
    example = ROOT / "deploy" / "k8s" / "daemonset" / "engine-example.yaml"
    engine_workload = yaml.safe_load(example.read_text())
    kubernetes_validate.validate(engine_workload, KUBERNETES, strict=True)
    engine_pod = engine_workload["spec"]["template"]
    (engine,) = engine_pod["spec"]["containers"]
    for path in ("/dev/shm", str(config.daemon.socket_path)):
        served = volume_for(pod, daemon, path)["hostPath"]["path"]
        assert volume_for(engine_pod, engine, path)["hostPath"]["path"] == served
    assert f"unix://{config.daemon.socket_path}" in " ".join(engine["args"])
    context = engine_pod["spec"]["securityContext"]
    assert context["runAsUser"] == pod["spec"]["securityContext"]["runAsUser"]
    assert engine_workload["metadata"]["namespace"] == named(objects, "Namespace")["metadata"][
        "name"
    ]


@needs_kubectl
def test_the_sidecar_pattern_asks_for_no_host_access_or_privilege() -> None:
    """What the "restricted" Pod Security Standard checks, for the same-pod sidecar."""
    pod = pod_of(render("sidecar"))
    spec = pod["spec"]
    assert all("hostPath" not in v for v in spec["volumes"])
    assert not any(spec.get(key) for key in ("hostIPC", "hostPID", "hostNetwork"))
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    for container in containers(pod):
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        assert not context.get("privileged")
    (sidecar,) = spec["initContainers"]
    assert sidecar["restartPolicy"] == "Always"  # up before the engine, down after it


@needs_kubectl
@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_service_monitor_scrapes_the_daemons_port_with_its_token(pattern: str) -> None:
    objects = render(pattern)
    monitor = named(objects, "ServiceMonitor", "kvstore")
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [
        s
        for s in objects
        if s["kind"] == "Service"
        and selector.items() <= s["metadata"].get("labels", {}).items()
    ]
    assert len(services) == 1
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in services[0]["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    secret = named(objects, "Secret", endpoint["bearerTokenSecret"]["name"])
    assert endpoint["bearerTokenSecret"]["key"] in secret["stringData"]
    labels = pod_of(objects)["metadata"]["labels"]
    assert services[0]["spec"]["selector"].items() <= labels.items()
    dashboard = named(objects, "ConfigMap", "kvstore-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"


@needs_kubectl
def test_the_shared_tier_evicts_by_itself_and_every_daemon_names_its_nodes(
    tmp_path: Path,
) -> None:
    objects = render("redis-cluster")
    config = loaded(objects, pod_of(objects), tmp_path)
    (redis,) = [t for t in config.store.tiers if t.kind is TierKind.REDIS]
    assert redis.cluster and redis.write == "through"
    servers = named(objects, "StatefulSet", "redis")
    conf = named(objects, "ConfigMap", "kvstore-redis")["data"]["redis.conf"]
    settings = dict(line.split(None, 1) for line in conf.splitlines() if line and line[0] != "#")
    assert settings["maxmemory-policy"] == "allkeys-lru" and "maxmemory" in settings
    assert settings["cluster-enabled"] == "yes"
    service = servers["spec"]["serviceName"]
    names = {f"redis-{i}.{service}:6379" for i in range(servers["spec"]["replicas"])}
    assert set(redis.nodes) <= names
    password = environment(daemon_container(pod_of(objects)))
    assert "KVSTORE_REDIS_PASSWORD" in password

