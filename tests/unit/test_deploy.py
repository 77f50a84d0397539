"""deploy/ checked offline: every YAML parses; every command line in the compose file and the
Kubernetes manifests parses with the service's own flags (derived from its settings dataclass,
as `tinkerd <service>` derives them), with the values the environment gives it; ports, probes,
Services and the gateway's addresses agree; sampler replicas are one scalable workload whose
replicas register themselves with the gateway; the Kustomize overlays build (kubectl's kustomize
when installed, else the kustomization files' references are checked); the Dockerfile copies
what exists and installs what pyproject.toml pins."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess

import pytest
import yaml

from gateway.settings import GatewaySettings
from sampler_service.settings import SamplerSettings
from tinkerd import health, settings
from trainer_service.settings import TrainerSettings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy")
K8S = os.path.join(DEPLOY, "k8s")
SERVICES = {"trainer": TrainerSettings, "sampler": SamplerSettings, "gateway": GatewaySettings}
OVERLAYS = ("cpu", "gpu")
COMPONENTS = ("tls", "external-database", "trainer-ranks", "service-roles")
HEALTHZ = "/api/v1/healthz"


def _yaml_files() -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(DEPLOY) for f in files
                  if f.endswith((".yaml", ".yml")))


def _load(path: str) -> list:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _parse(service: str, argv: list[str]) -> argparse.Namespace:
    """argv as `tinkerd <service>` parses it: an unknown flag, a missing required one or a bad
    value fails the test (argparse exits)."""
    parser = argparse.ArgumentParser(prog=f"tinkerd {service}", exit_on_error=False, allow_abbrev=False)
    settings.add_arguments(parser, SERVICES[service])
    try:
        return parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as e:
        pytest.fail(f"`tinkerd {service} {' '.join(argv)}` does not parse: {e}")


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_every_yaml_parses():
    files = _yaml_files()
    assert len(files) >= 10, files
    for path in files:
        assert _load(path), path


# ---- compose ------------------------------------------------------------------------------

def _compose() -> dict:
    return _load(os.path.join(DEPLOY, "compose.yaml"))[0]


def _interpolate(value: str) -> str:
    """Compose's ${VAR:-default} -> default, ${VAR:?error} / ${VAR} -> a stand-in value."""
    value = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)
    return re.sub(r"\$\{\w+(:\?[^}]*)?\}", "set-by-operator", value)


def test_compose_command_lines_are_the_services_flags_and_agree():
    compose = _compose()
    services = compose["services"]
    commands = {name: [_interpolate(str(a)) for a in s["command"]] for name, s in services.items() if "command" in s}
    parsed = {name: (argv[0], _parse(argv[0], argv[1:])) for name, argv in commands.items()}
    kinds = [kind for kind, _ in parsed.values()]
    assert kinds.count("trainer") == 1 and kinds.count("gateway") == 1 and kinds.count("sampler") == 1, kinds
    listen = {name: _port(args.listen) for name, (kind, args) in parsed.items() if kind != "gateway"}
    gateway_name, gateway = next((name, args) for name, (kind, args) in parsed.items() if kind == "gateway")
    # The gateway dials the trainer by its service name and port; sampler replicas (one service,
    # scaled) register themselves with the gateway, which takes no --sampler list.
    trainer = next(name for name, (kind, _) in parsed.items() if kind == "trainer")
    assert gateway.trainer == f"{trainer}:{listen[trainer]}"
    assert not gateway.samplers
    sampler, sampler_args = next((name, args) for name, (kind, args) in parsed.items() if kind == "sampler")
    # Replicas register at the gateway's internal listener, on the compose network only.
    assert sampler_args.register_with == [f"http://{gateway_name}:{gateway.internal_port}"]
    assert gateway.internal_host == "0.0.0.0" and gateway.internal_port != gateway.port
    assert not any(str(gateway.internal_port) in p for p in services["gateway"]["ports"])
    assert sampler_args.listen.startswith("0.0.0.0:") and sampler_args.advertise_address == ""
    assert int(_interpolate(str(services[sampler]["deploy"]["replicas"]))) >= 2
    assert "container_name" not in services[sampler] and "ports" not in services[sampler]   # scalable
    assert parsed[trainer][1].advertise_host == trainer
    assert gateway.db_url.startswith("postgresql+psycopg://") and "@postgres/" in gateway.db_url
    # The password is a file, never on the command line (nor in compose's environment).
    assert re.match(r"postgresql\+psycopg://\w+@", gateway.db_url), gateway.db_url
    assert gateway.db_password_file == "/run/secrets/db-password" and "db-password" in services["gateway"]["secrets"]
    assert "PASSWORD" not in str(services["gateway"].get("environment", {}))
    assert "postgres" in services
    # Health checks ask the port the service listens on (python -m tinkerd.health's own flags).
    for name, port in listen.items():
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "tinkerd.health"], test
        assert _port(health.build_parser().parse_args(test[4:]).address) == port
    published = services["gateway"]["ports"][0]
    assert _interpolate(published).endswith(f":{gateway.port}")
    assert f":{gateway.port}{HEALTHZ}" in services["gateway"]["healthcheck"]["test"][-1]
    # Every service shares one state dir, and the token file is a declared secret.
    for name, (kind, args) in parsed.items():
        assert args.state_dir == "/state" and "state:/state" in services[name]["volumes"]
        assert args.service_token_file == "/run/secrets/service-token"
        assert "service-token" in services[name]["secrets"]
    assert set(compose["secrets"]) >= {"service-token", "db-password"}


def test_the_gpu_compose_file_overrides_only_existing_services():
    gpu = _load(os.path.join(DEPLOY, "compose.gpu.yaml"))[0]
    services = _compose()["services"]
    devices = []
    for name, s in gpu["services"].items():
        assert name in services, name
        devices += s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
    assert len(devices) == len(set(devices)), "two services on one GPU (NCCL refuses)"


# ---- Kubernetes ---------------------------------------------------------------------------

def _kustomize(directory: str) -> list | None:
    """The overlay as kustomize renders it, or None without kubectl/kustomize."""
    for tool in (["kustomize", "build"], ["kubectl", "kustomize"]):
        if shutil.which(tool[0]):
            out = subprocess.run([*tool, directory, "--load-restrictor", "LoadRestrictionsNone"],
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            return [d for d in yaml.safe_load_all(out.stdout) if d]
    return None


def _kustomization_references_exist(directory: str, seen: set) -> None:
    """Without kustomize: every file and directory a kustomization names exists, recursively."""
    path = os.path.join(directory, "kustomization.yaml")
    assert os.path.exists(path), directory
    if path in seen:
        return
    seen.add(path)
    k = _load(path)[0]
    assert k["kind"] in ("Kustomization", "Component")
    for ref in [*k.get("resources", []), *k.get("components", [])]:
        target = os.path.normpath(os.path.join(directory, ref))
        assert os.path.exists(target), f"{path} names {ref}"
        if os.path.isdir(target):
            _kustomization_references_exist(target, seen)
        else:
            assert _load(target)
    for patch in k.get("patches", []):
        assert "patch" in patch or os.path.exists(os.path.join(directory, patch["path"]))
        if "patch" in patch:
            assert yaml.safe_load(patch["patch"]), f"{path}: a patch that does not parse"


def _rendered(tmp_path, overlay: str, components: tuple[str, ...] = ()) -> tuple[list, bool]:
    """An overlay (plus components) rendered, True; without kustomize, base's manifests as
    written, False (what the overlays change is then left unchecked)."""
    _kustomization_references_exist(os.path.join(K8S, "overlays", overlay), set())
    for c in components:
        _kustomization_references_exist(os.path.join(K8S, "components", c), set())
    # A throwaway overlay beside a link to deploy/k8s: how a user adds components.
    (tmp_path / "k8s").symlink_to(K8S)
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": [f"../k8s/overlays/{overlay}"], "components": [f"../k8s/components/{c}" for c in components]}))
    docs = _kustomize(str(tmp_path / "o"))
    if docs is not None:
        return docs, True
    if components:
        pytest.skip("components need kustomize to apply (kubectl not installed)")
    base = os.path.join(K8S, "base")
    docs = [d for f in sorted(os.listdir(base)) if f != "kustomization.yaml" for d in _load(os.path.join(base, f))]
    literals = _load(os.path.join(base, "kustomization.yaml"))[0]["configMapGenerator"][0]["literals"]
    docs.append({"kind": "ConfigMap", "metadata": {"name": "tinkerd-config"},
                 "data": dict(item.split("=", 1) for item in literals)})
    return docs, False


def _of(docs, kind: str, name_prefix: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name_prefix)]
    assert len(found) == 1, (kind, name_prefix, [d["metadata"]["name"] for d in found])
    return found[0]


def _env(container: dict, docs) -> dict[str, str]:
    """What $(NAME) resolves to in the container's args: env values (fieldRef/secret stand-ins)
    and every key of the ConfigMaps it reads."""
    env = {}
    for source in container.get("envFrom", []):
        env.update(_of(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for e in container.get("env", []):
        env[e["name"]] = e.get("value", "10.0.0.7" if "fieldRef" in e.get("valueFrom", {}) else
                                "postgresql+psycopg://tinkerd:pw@db/tinkerd")
    return env


def _argv(container: dict, docs) -> list[str]:
    env = _env(container, docs)

    def expand(arg: str) -> str:
        for name in re.findall(r"\$\((\w+)\)", arg):
            assert name in env, f"{container['name']}: $({name}) is set by no env or ConfigMap"
        return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)

    return [expand(str(a)) for a in container["args"]]


def _grpc_probe_ports(container: dict) -> set[int]:
    ports = set()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = container[probe]
        if "grpc" in p:
            ports.add(p["grpc"]["port"])
        else:          # the TLS component's exec probe: python -m tinkerd.health ADDRESS --tls-...
            command = p["exec"]["command"]
            assert command[:3] == ["python", "-m", "tinkerd.health"], command
            probe_args = health.build_parser().parse_args(command[3:])
            assert probe_args.tls_ca and probe_args.tls_cert and probe_args.tls_key
            ports.add(_port(probe_args.address))
    return ports


@pytest.mark.parametrize("overlay,components", [*((o, ()) for o in OVERLAYS), ("gpu", COMPONENTS)])
def test_kubernetes_manifests_render_and_agree_with_the_cli(tmp_path, overlay, components):
    docs, rendered = _rendered(tmp_path, overlay, components)
    workloads = {}
    for kind, name in (("Deployment", "tinkerd-trainer"), ("Deployment", "tinkerd-sampler"),
                       ("Deployment", "tinkerd-gateway")):
        workload = _of(docs, kind, name)
        container = workload["spec"]["template"]["spec"]["containers"][0]
        argv = _argv(container, docs)
        workloads[argv[0]] = (workload, container, _parse(argv[0], argv[1:]))
    assert not [d for d in docs if d["kind"] == "StatefulSet" and "sampler" in d["metadata"]["name"]]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}

    for kind in ("trainer", "sampler"):
        workload, container, args = workloads[kind]
        port = _port(args.listen)
        assert [p["containerPort"] for p in container["ports"]] == [port]
        assert _grpc_probe_ports(container) == {port}, "probes ask another port than --listen"
        assert workload["spec"]["template"]["spec"]["nodeSelector"] == {"tinkerd.io/pool": kind}
        if not rendered:
            pass
        elif overlay == "gpu":
            assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
            assert container["image"].endswith(":cuda")
        else:
            assert "nvidia.com/gpu" not in str(container.get("resources"))
            assert container["image"].endswith(":cpu")
        if "tls" in components:
            assert args.tls_cert and args.tls_key and args.tls_ca
    trainer, trainer_container, trainer_args = workloads["trainer"]
    service = services["tinkerd-trainer"]
    assert service["spec"]["ports"][0]["port"] == _port(trainer_args.listen)
    assert service["spec"]["ports"][0]["targetPort"] == trainer_container["ports"][0]["name"]
    assert trainer_args.advertise_host == "10.0.0.7"          # the pod IP (downward API)
    # W trainer ranks (components/trainer-ranks): torchrun around the same `tinkerd trainer`
    # args, one rank per GPU of the pod.
    command = trainer_container.get("command")
    if "trainer-ranks" in components:
        assert command[:4] == ["python", "-m", "torch.distributed.run", "--standalone"]
        assert command[-2:] == ["-m", "launcher.cli"]
        ranks = int(command[command.index("--nproc-per-node") + 1])
        assert ranks >= 2
        if rendered and overlay == "gpu":
            assert trainer_container["resources"]["limits"]["nvidia.com/gpu"] == ranks
    else:
        assert command is None                                 # the image's entrypoint: tinkerd

    # Samplers: a Deployment of any size; each replica registers with the gateway Service under
    # its pod IP and the port it listens on; one GPU per tensor-parallel rank.
    sampler, sampler_container, sampler_args = workloads["sampler"]
    assert sampler["spec"]["replicas"] >= 2
    assert "tinkerd-sampler" not in services                  # nobody dials replicas by name
    gateway_service = services["tinkerd-gateway"]["spec"]["ports"][0]
    internal_service = services["tinkerd-gateway-internal"]["spec"]["ports"][0]
    # Replicas register at the gateway's internal listener's own Service; https (checked against
    # the CA) under components/tls: the service token never crosses the network in clear.
    scheme = "https" if "tls" in components else "http"
    assert sampler_args.register_with == [f"{scheme}://tinkerd-gateway-internal:{internal_service['port']}"]
    assert bool(sampler_args.register_ca) == ("tls" in components)
    assert sampler_args.advertise_address == f"10.0.0.7:{_port(sampler_args.listen)}"
    pod_ip = next(e for e in sampler_container["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    if rendered and overlay == "gpu":
        assert sampler_container["resources"]["limits"]["nvidia.com/gpu"] == sampler_args.tensor_parallel_size
    elif overlay == "cpu":
        assert sampler_args.tensor_parallel_size == 1          # vLLM on CPU: replicas, not TP

    _, gateway, gateway_args = workloads["gateway"]
    assert gateway_args.trainer == f"tinkerd-trainer:{_port(trainer_args.listen)}"
    assert not gateway_args.samplers                          # replicas register themselves
    assert gateway_service["targetPort"] == gateway["ports"][0]["name"]
    internal_port = next(p for p in gateway["ports"] if p["name"] == internal_service["targetPort"])
    assert internal_port["containerPort"] == gateway_args.internal_port and gateway_args.internal_host == "0.0.0.0"
    policy = _of(docs, "NetworkPolicy", "tinkerd-gateway")["spec"]["ingress"]
    assert [r for r in policy if "from" not in r] == [{"ports": [{"port": gateway_args.port}]}], policy
    if "tls" in components:
        assert gateway_args.https_cert and gateway_args.https_key
        assert gateway["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    # No database URL on the command line: the gateway reads TINKERD_DB_URL from the Secret.
    assert gateway_args.db_url is None
    db_env = next(e for e in gateway["env"] if e["name"] == "TINKERD_DB_URL")
    assert db_env["valueFrom"]["secretKeyRef"] == {"name": "tinkerd-db", "key": "url"}
    probe = {k: v for k, v in gateway["readinessProbe"]["httpGet"].items() if k != "scheme"}
    assert probe == {"path": HEALTHZ, "port": gateway_args.port}
    assert gateway["livenessProbe"]["tcpSocket"]["port"] == gateway_args.port
    assert gateway["ports"][0]["containerPort"] == gateway_args.port
    assert ("tinkerd-postgres" in services) == ("external-database" not in components)

    # Every service: the same state dir and token Secret; the token path is where it is mounted.
    for kind, (workload, container, args) in workloads.items():
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert mounts["state"] == args.state_dir
        assert volumes["state"]["persistentVolumeClaim"]["claimName"] == "tinkerd-state"
        assert os.path.dirname(args.service_token_file) == mounts["token"]
        assert volumes["token"]["secret"]["secretName"] == "tinkerd-service-token"
        assert mounts["models"] == args.base_model
        # components/service-roles: a pod mounts its own role's credential only, at the same path.
        items = volumes["token"]["secret"].get("items")
        if "service-roles" in components:
            assert items == [{"key": kind, "path": os.path.basename(args.service_token_file)}], items
            assert volumes["token"]["secret"]["defaultMode"] == 0o400
        else:
            assert items is None


def test_the_readme_says_how_to_make_every_secret_the_manifests_use():
    text = "".join(open(p).read() for p in _yaml_files() if os.sep + "k8s" + os.sep in p)
    names = set(re.findall(r"secretName: ([\w-]+)", text)) | set(re.findall(r"secretKeyRef:\s+name: ([\w-]+)", text))
    assert names == {"tinkerd-service-token", "tinkerd-db", "tinkerd-tls"}, names
    readme = open(os.path.join(DEPLOY, "README.md")).read()
    for name in names:
        assert f"secret generic {name}" in readme, f"deploy/README.md does not say how to create {name}"


def test_the_gateway_serves_the_probed_health_path_publicly():
    from gateway.identity.auth import PUBLIC_PATHS
    from gateway.routes.service import router

    assert HEALTHZ in PUBLIC_PATHS
    assert HEALTHZ in {route.path for route in router.routes}


# ---- the image ----------------------------------------------------------------------------

def test_the_dockerfile_copies_what_exists_and_installs_what_pyproject_pins():
    tomllib = pytest.importorskip("tomllib")          # Python 3.11+
    dockerfile = open(os.path.join(DEPLOY, "Dockerfile")).read()
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    copied = []
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            sources = line.split()[1:-1]
            for source in sources:
                assert os.path.exists(os.path.join(ROOT, source)), f"Dockerfile copies missing {source}"
            copied += sources
    # Every package pyproject.toml installs is in the image.
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert pattern.rstrip("*") in copied, f"the image lacks package {pattern}"
    torch = next(d for d in project["project"]["dependencies"] if d.startswith("torch=="))
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(torch.split('==')[1])}$", dockerfile, re.M), \
        "the Dockerfile's torch version differs from pyproject.toml's"
    extras = set(project["project"]["optional-dependencies"])
    assert {"cpu", "cuda", "postgres"} <= extras
    assert '".[${VARIANT},postgres]"' in dockerfile
    assert re.search(r"^ENTRYPOINT \[\"tinkerd\"\]$", dockerfile, re.M)
    assert project["project"]["scripts"]["tinkerd"] == "launcher.cli:main"
    ignored = open(os.path.join(ROOT, ".dockerignore")).read().split()
    assert ".venv" in ignored and "state" in ignored
