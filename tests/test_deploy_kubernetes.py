"""deploy/kubernetes: the committed render of the example overlay is valid Kubernetes (v1.31
schemas, strict: an unknown field is an error), is what the overlay renders now (where kubectl
is on PATH), runs ddiloco command lines the real parser and config loader accept, and gives
each pod only its own keys. No cluster, no network, no timing: the manifests are read as files."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ddiloco.cli import _load, build_parser
from ddiloco.service.learner.process import EXIT_GAVE_UP, EXIT_NO_SYNCER, EXIT_REFUSED, EXIT_SUPERSEDED

yaml = pytest.importorskip("yaml")  # kubernetes-validate's dependency (the test extra)

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
RENDERED = K8S / "rendered" / "example.yaml"
OVERLAY = K8S / "overlays" / "example"
KUBERNETES_VERSION = "1.31"


def _objects() -> list[dict]:
    return [d for d in yaml.safe_load_all(RENDERED.read_text()) if d]


def _by_kind(kind: str) -> list[dict]:
    return [o for o in _objects() if o["kind"] == kind]


def _pod_template(obj: dict) -> dict:
    return obj["spec"]["template"]


def _workloads() -> list[dict]:
    return [o for o in _objects() if o["kind"] in ("StatefulSet", "Deployment", "Job")]


def _component(obj: dict) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def _expand(arg: str, container: dict, labels: dict[str, str]) -> str:
    """``$(VAR)`` in a container's args as Kubernetes expands it, from the container's env (a
    value, or the pod's own label through the Downward API)."""

    def value(m: re.Match) -> str:
        for e in container.get("env", []):
            if e["name"] == m.group(1):
                if "value" in e:
                    return str(e["value"])
                path = e["valueFrom"]["fieldRef"]["fieldPath"]
                label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
                assert label, f"{e['name']}: only pod labels are expanded here, not {path}"
                return labels[label.group(1)]
        raise AssertionError(f"$({m.group(1)}) is not in the container's env")

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, arg)


def _command_lines() -> list[tuple[str, dict, list[str]]]:
    """Every ddiloco command line in the render: (where, its container, argv after `ddiloco`).
    The image's ENTRYPOINT is ddiloco (checked below), so a container's args are its argv."""
    lines = []
    for w in _workloads():
        tpl = _pod_template(w)
        labels = tpl["metadata"].get("labels", {})
        for c in tpl["spec"]["containers"]:
            assert "command" not in c, "the image's ENTRYPOINT runs ddiloco: give args only"
            where = f"{w['kind']} {w['metadata']['name']}"
            lines.append((where, c, [_expand(a, c, labels) for a in c["args"]]))
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                command = c.get(probe, {}).get("exec", {}).get("command")
                if command:
                    assert command[0] == "ddiloco", f"{where} {probe}: {command}"
                    lines.append((f"{where} {probe}", c, command[1:]))
    return lines


def _parse(where: str, argv: list[str]):
    try:
        return build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed why
        raise AssertionError(f"{where}: `ddiloco {' '.join(argv)}` does not parse") from e


def _config_text() -> str:
    (cm,) = _by_kind("ConfigMap")
    return cm["data"]["config.toml"]


def _secret_files(name: str) -> dict[str, str]:
    (secret,) = [s for s in _by_kind("Secret") if s["metadata"]["name"] == name]
    return {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}


def _mounted_keys(w: dict) -> tuple[str, dict[str, str]]:
    """The one Secret a workload's pod mounts, where, and its files."""
    spec = _pod_template(w)["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    assert len(secrets) == 1, f"{w['metadata']['name']} mounts {sorted(secrets.values())}"
    (volume, secret) = next(iter(secrets.items()))
    (c,) = spec["containers"]
    (mount,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == volume]
    assert f"--keys={mount}" in c["args"], f"{w['metadata']['name']}: --keys is not where its Secret is"
    return mount, _secret_files(secret)


def _learner_jobs() -> dict[int, dict]:
    return {int(j["metadata"]["labels"]["ddiloco.dev/learner"]): j for j in _by_kind("Job")}


# -- (a) the schema ------------------------------------------------------------------------------


def test_the_committed_render_is_valid_kubernetes():
    kv = pytest.importorskip("kubernetes_validate")
    objects = _objects()
    kinds = {o["kind"] for o in objects}
    assert {"StatefulSet", "Service", "Job", "Deployment", "ConfigMap", "Secret", "PersistentVolumeClaim"} <= kinds
    for o in objects:  # strict: an unknown or misspelt field is an error, not ignored
        kv.validate(o, KUBERNETES_VERSION, strict=True)


def test_the_render_holds_no_real_key():
    for s in _by_kind("Secret"):
        for name, text in _secret_files(s["metadata"]["name"]).items():
            assert text.startswith(f"placeholder for {name}:"), f"{s['metadata']['name']}/{name} is not a placeholder"


# -- (b) the committed render is what the overlay renders ----------------------------------------


def test_rendering_the_overlay_again_gives_the_committed_file(tmp_path):
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: the committed render is not compared with a fresh one")
    header = RENDERED.read_text().splitlines()[0]
    ours = subprocess.run(["kubectl", "version", "--client"], capture_output=True, text=True).stdout
    version = re.search(r"Kustomize Version: (\S+)", ours)
    if version is None or f"kustomize {version.group(1)})" not in header:
        pytest.skip(f"kubectl's kustomize ({version and version.group(1)}) is not the one that rendered: {header}")
    out = tmp_path / "example.yaml"
    subprocess.run(["bash", str(K8S / "render.sh"), str(out)], check=True, capture_output=True, timeout=120)
    assert out.read_text() == RENDERED.read_text(), "run deploy/kubernetes/render.sh and commit its output"


def test_the_render_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(K8S / "render.sh")], check=True)


# -- (c) the command lines -----------------------------------------------------------------------


def test_the_image_runs_ddiloco():
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["ddiloco"\]$', dockerfile, re.M)


def test_every_ddiloco_command_line_parses_and_loads_its_config(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(_config_text())
    commands = {}
    for where, c, argv in _command_lines():
        args = _parse(where, argv)
        commands.setdefault(args.command, []).append(args)
        if getattr(args, "config", None) is not None:
            assert args.config == "/etc/ddiloco/config.toml", where
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            assert mounts[args.config]["subPath"] == "config.toml", f"{where}: the config is not the ConfigMap's"
            args.config = str(config)
            cfg = _load(args)  # the file and every --set: real keys, valid values
            if args.command == "learner":
                assert 0 <= args.id < cfg.run.num_learners, where
            if args.command == "syncer":
                port = int(cfg.runtime.metrics_bind.rpartition(":")[2]) + args.shard
                assert {"name": "metrics", "containerPort": port} in c["ports"], where
    assert sorted(commands) == ["alive", "evaluator", "learner", "syncer"]
    assert len(commands["learner"]) == len(_learner_jobs()) == 2


def test_learner_probes_watch_the_learners_own_run_folder():
    for job in _learner_jobs().values():
        tpl = _pod_template(job)
        (c,) = tpl["spec"]["containers"]
        run_dir = _parse("learner", [_expand(a, c, tpl["metadata"]["labels"]) for a in c["args"]]).run_dir
        for probe in ("startupProbe", "livenessProbe"):
            alive = _parse(probe, c[probe]["exec"]["command"][1:])
            assert alive.command == "alive" and alive.run_dir == run_dir
        assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600  # a slow first join
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in tpl["spec"]["volumes"]}
        assert "emptyDir" in volumes[mounts[run_dir]], "a new pod must not find an old pod's status file"
        assert "persistentVolumeClaim" in volumes[mounts[f"{run_dir}/learners"]], "its saved state outlives the pod"


def test_the_syncer_is_ready_when_its_metrics_answer_alive_while_its_loop_turns_and_keeps_its_run_folder():
    (sts,) = _by_kind("StatefulSet")
    (c,) = _pod_template(sts)["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe"):  # /metrics answers once the store is restored
        assert c[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}, probe
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}  # prometheus.health
    run_dir = _parse("syncer", c["args"]).run_dir
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    (mount,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert run_dir.startswith(mount + "/")
    assert _pod_template(sts)["spec"]["terminationGracePeriodSeconds"] >= 60


def test_a_learner_job_fails_only_on_exits_no_restart_can_fix():
    for job in _learner_jobs().values():
        rules = job["spec"]["podFailurePolicy"]["rules"]
        (fail,) = [r for r in rules if r["action"] == "FailJob"]
        assert set(fail["onExitCodes"]["values"]) == {2, EXIT_REFUSED, EXIT_SUPERSEDED}
        assert not {EXIT_NO_SYNCER, EXIT_GAVE_UP, 4, 137} & set(fail["onExitCodes"]["values"])
        assert _pod_template(job)["spec"]["restartPolicy"] == "Never"
        assert job["spec"]["backoffLimit"] >= 20


# -- (d), (e) keys -------------------------------------------------------------------------------


def test_each_pod_mounts_only_its_own_keys():
    ids = sorted(_learner_jobs())
    for w in _workloads():
        _, files = _mounted_keys(w)
        role = _component(w)
        if role == "syncer":  # its own secret and every public key it admits, no one else's secret
            assert set(files) == {"syncer.key_secret", "observer.key", *(f"learner-{m}.key" for m in ids)}
        elif role == "evaluator":
            assert set(files) == {"syncer.key", "observer.key_secret"}
        else:
            m = int(w["metadata"]["labels"]["ddiloco.dev/learner"])
            assert set(files) == {"syncer.key", f"learner-{m}.key_secret"}, w["metadata"]["name"]


def test_learner_ids_match_their_names_secrets_and_volumes_and_the_config():
    from ddiloco.config import tomllib

    jobs = _learner_jobs()
    assert sorted(jobs) == list(range(tomllib.loads(_config_text())["run"]["num_learners"]))
    for m, job in jobs.items():
        tpl = _pod_template(job)
        assert job["metadata"]["name"] == f"ddiloco-learner-{m}"
        assert tpl["metadata"]["labels"]["ddiloco.dev/learner"] == str(m)
        (c,) = tpl["spec"]["containers"]
        assert _parse("learner", [_expand(a, c, tpl["metadata"]["labels"]) for a in c["args"]]).id == m
        volumes = {v["name"]: v for v in tpl["spec"]["volumes"]}
        assert volumes["keys"]["secret"]["secretName"] == f"ddiloco-learner-keys-{m}"
        assert volumes["state"]["persistentVolumeClaim"]["claimName"] == f"ddiloco-learner-state-{m}"


def test_the_example_runs_the_demo_config():
    assert (OVERLAY / "config.toml").read_text() == (ROOT / "configs" / "demo.toml").read_text()
    assert _config_text() == (OVERLAY / "config.toml").read_text()
    assert "keys/" in (OVERLAY / ".gitignore").read_text().split()
