"""Every pod the Kubernetes manifests make (each overlay, and with every component) runs
hardened: not as root, no privilege escalation, no capabilities, the runtime's seccomp profile, a
read-only root filesystem with emptyDirs where it writes, no service-account token mounted, and no
secret on a command line. Rendered by kubectl's kustomize where installed (test_deploy.py)."""

from __future__ import annotations

import re

import pytest

from test_deploy import COMPONENTS, OVERLAYS, _rendered

POD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


def _pods(docs) -> list[tuple[str, dict]]:
    return [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in docs if d["kind"] in POD_KINDS]


@pytest.mark.parametrize("overlay,components", [*((o, ()) for o in OVERLAYS), ("gpu", COMPONENTS)])
def test_every_pod_and_container_is_hardened(tmp_path, overlay, components):
    docs, _ = _rendered(tmp_path, overlay, components)
    pods = _pods(docs)
    assert {name for name, _ in pods} >= {"tinkerd-gateway", "tinkerd-trainer", "tinkerd-sampler"}
    for name, pod in pods:
        assert pod.get("automountServiceAccountToken") is False, f"{name}: mounts a service-account token"
        pod_context = pod.get("securityContext", {})
        assert pod_context.get("runAsNonRoot") is True, f"{name}: may run as root"
        assert pod_context.get("runAsUser", 1) != 0, name
        assert pod_context.get("seccompProfile") == {"type": "RuntimeDefault"}, name
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for container in [*pod["containers"], *pod.get("initContainers", [])]:
            where = f"{name}/{container['name']}"
            context = container.get("securityContext", {})
            assert context.get("allowPrivilegeEscalation") is False, where
            assert context.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not context.get("capabilities", {}).get("add"), where
            assert not context.get("privileged"), where
            assert context.get("runAsUser", 1) != 0 and context.get("runAsNonRoot", True) is True, where
            assert context.get("readOnlyRootFilesystem") is True, where
            # A read-only root: /tmp is a writable emptyDir.
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]], where
            # No password on the command line (ps shows it to everyone on the node).
            for arg in [*container.get("command", []), *container.get("args", [])]:
                assert not re.search(r"://[^/@\s:]+:[^/@\s]+@", str(arg)), f"{where}: a password in {arg!r}"
                assert "DB_URL" not in str(arg) and "PASSWORD" not in str(arg), f"{where}: {arg!r}"


def test_postgres_runs_as_its_own_user_with_writable_run_and_data_dirs(tmp_path):
    docs, _ = _rendered(tmp_path, "cpu")
    (postgres,) = [pod for name, pod in _pods(docs) if name == "tinkerd-postgres"]
    assert postgres["securityContext"]["runAsUser"] == postgres["securityContext"]["fsGroup"] == 999
    mounts = {m["mountPath"] for m in postgres["containers"][0]["volumeMounts"]}
    assert {"/var/lib/postgresql/data", "/var/run/postgresql", "/tmp"} <= mounts
