"""Deployment files agree with the CLI and with each other: Dockerfile, docker-compose.yml and
deploy/k8s/*.yaml are parsed (no Docker engine or cluster needed) and their commands, flags,
ROLLSERVE_* variables, ports, health checks and grace periods are checked against the real
`rollserve` parsers. The image's contract (entry point, environment, health check, stop signal)
is also run for real through the installed console script."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml
from helpers_server import free_port
from rollserve.server.config import ConfigError, ServerConfig, build_parser
from rollserve.server.serving import cli

ROOT = Path(__file__).resolve().parents[1]
K8S_DIR = ROOT / "deploy" / "k8s"
KUSTOMIZATION = K8S_DIR / "kustomization.yaml"
METRICS_PORT = 9090  # --metrics-port's default (0 turns metrics off)
MALLOC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
GPU_RESOURCE = "nvidia.com/gpu"


# ---- Dockerfile: a small line parser ----------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, ENV, ...
    args: str  # the rest, continuation lines joined


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions in order; comments dropped, backslash continuations joined (as Docker does)."""
    instructions: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # Docker also drops comment lines inside a continuation
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        instructions.append(Instruction(keyword.upper(), " ".join(args.split())))
        pending = ""
    assert not pending, "the Dockerfile ends inside a line continuation"
    return instructions


@dataclass(frozen=True)
class Dockerfile:
    instructions: list[Instruction]

    def all(self, keyword: str) -> list[str]:
        return [i.args for i in self.instructions if i.keyword == keyword]

    def one(self, keyword: str) -> str:
        values = self.all(keyword)
        assert len(values) == 1, f"expected one {keyword}, found {values}"
        return values[0]

    def index(self, keyword: str, contains: str) -> int:
        for position, instruction in enumerate(self.instructions):
            if instruction.keyword == keyword and contains in instruction.args:
                return position
        raise AssertionError(f"no {keyword} containing {contains!r}")

    def arg_defaults(self) -> dict[str, str]:
        pairs = (arg.partition("=") for arg in self.all("ARG"))
        return {name: default for name, _, default in pairs}

    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for args in self.all("ENV"):
            for token in shlex.split(args):
                name, sep, value = token.partition("=")
                assert sep, f"use ENV NAME=value, not the legacy form: {args!r}"
                env[name] = value
        return env

    def exec_form(self, keyword: str) -> list[str]:
        value = json.loads(self.one(keyword))  # exec form: no shell, signals reach rollserve
        assert isinstance(value, list) and all(isinstance(v, str) for v in value)
        return value

    def healthcheck(self) -> tuple[dict[str, str], list[str]]:
        """(--option -> value, the exec-form command)."""
        options_text, sep, command = self.one("HEALTHCHECK").partition(" CMD ")
        assert sep, "HEALTHCHECK needs a CMD"
        options = dict(opt.removeprefix("--").split("=", 1) for opt in options_text.split())
        return options, json.loads(command)


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return Dockerfile(parse_dockerfile((ROOT / "Dockerfile").read_text()))


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict[str, Any]]:
    """Every manifest under deploy/k8s, by (kind, name); kustomization.yaml is not one."""
    manifests: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(K8S_DIR.glob("*.yaml")):
        if path.name == KUSTOMIZATION.name:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in manifests, f"{key} defined twice"
            manifests[key] = doc | {"_file": path.name}
    return manifests


# ---- shared helpers ---------------------------------------------------------------------------


def duration_s(text: str | int | float) -> float:
    """Docker/compose durations: 10s, 1m30s, 1h, 500ms (a bare number is seconds)."""
    if isinstance(text, int | float):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(float(number) * scale[unit] for number, unit in parts)


def interpolate(value: str) -> str:
    """Compose's ${NAME:-default} / ${NAME-default} / ${NAME}, as on a machine with none set."""
    return re.sub(r"\$\{\w+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)


def serve_flags() -> set[str]:
    return {option for action in build_parser()._actions for option in action.option_strings}


def check_serve_args(args: list[str], env: Mapping[str, str]) -> ServerConfig:
    """`args` start with a real subcommand, name only real flags, and parse to a ServerConfig."""
    assert args and args[0] == "serve", f"the first argument must be `serve`: {args}"
    unknown = {a.split("=")[0] for a in args[1:] if a.startswith("--")} - serve_flags()
    assert not unknown, f"not flags of `rollserve serve`: {sorted(unknown)}"
    check_env_names(env)
    try:
        return ServerConfig.from_args(args[1:], env)
    except ConfigError as exc:
        pytest.fail(f"rollserve would refuse {args} with {dict(env)}: {exc}")


def check_env_names(env: Mapping[str, str]) -> None:
    field_names = {f.name for f in fields(ServerConfig)}
    for name in env:
        if name.startswith("ROLLSERVE_"):
            field = name.removeprefix("ROLLSERVE_").lower()
            assert field in field_names, f"{name} is not a ServerConfig field"


def check_health_command(command: list[str], port: int) -> None:
    """`rollserve health --target 127.0.0.1:PORT ...`, and its flags exist in the health CLI."""
    assert command[:2] == ["rollserve", "health"], command
    target = command[command.index("--target") + 1]
    assert target == f"127.0.0.1:{port}", f"health probes {target}, the server is on {port}"
    # Run it against a port where nothing listens: an unknown flag or bad value would be an
    # argparse error (SystemExit 2); real flags give exit 1 (UNAVAILABLE).
    args = [a.replace(target, f"127.0.0.1:{free_port()}") for a in command[1:]]
    try:
        assert cli.main(args) == 1
    except SystemExit as exc:
        pytest.fail(f"`rollserve health` refuses {command[2:]} (exit {exc.code})")


def ports_of(mappings: list[str]) -> set[int]:
    """Container ports of compose `ports` entries: "50051", "8080:50051", "127.0.0.1:1:2/tcp"."""
    return {int(str(m).split("/")[0].rsplit(":", 1)[-1]) for m in mappings}


def image_config(dockerfile: Dockerfile, env: Mapping[str, str], args: list[str]) -> ServerConfig:
    """The config a container gets: image ENV, then the orchestrator's env, then its args."""
    return check_serve_args(args, {**dockerfile.env(), **env})


def expose_ports(dockerfile: Dockerfile) -> set[int]:
    return {int(p.split("/")[0]) for args in dockerfile.all("EXPOSE") for p in args.split()}


def metrics_port(config: ServerConfig) -> int:
    # --metrics-port is being added next to this file; until it lands the port is the constant.
    return int(getattr(config, "metrics_port", METRICS_PORT))


def dockerfile_uid(dockerfile: Dockerfile) -> int:
    users = dockerfile.all("USER")
    assert users, "the image must not run as root"
    return int(users[-1].split(":")[0])  # numeric: Kubernetes' runAsNonRoot can check it


# ---- Dockerfile -------------------------------------------------------------------------------


def test_base_image_is_a_pinned_cuda_pytorch(dockerfile: Dockerfile) -> None:
    defaults = dockerfile.arg_defaults()
    for source in dockerfile.all("FROM"):
        image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults[m.group(1) or m.group(2)], source)
        image = image.split(" AS ")[0].split(" as ")[0]
        name, _, tag = image.partition(":")
        assert tag and tag != "latest" and "latest" not in tag, f"unpinned base image {image}"
        assert re.match(r"\d+\.\d+\.\d+-cuda\d+\.\d+", tag), f"not a versioned CUDA tag: {image}"
        assert name in ("pytorch/pytorch", "docker.io/pytorch/pytorch"), image


def test_the_image_has_a_c_compiler_for_tritons_kernel_launchers(dockerfile: Dockerfile) -> None:
    # torch.compile on CUDA (the engine's decode step and scoring) builds Triton's launchers with
    # a C compiler at run time; without one every compiled function runs eager, several times
    # slower. pytorch/pytorch's runtime base images long shipped none.
    installs = [
        instruction.args
        for instruction in dockerfile.instructions
        if instruction.keyword == "RUN" and "apt-get install" in instruction.args
    ]
    assert any(re.search(r"\bgcc\b", args) and "libc6-dev" in args for args in installs), installs


def test_dockerfile_basic_lint(dockerfile: Dockerfile) -> None:
    # hadolint's most useful rules, by hand.
    for instruction in dockerfile.instructions:
        assert instruction.keyword != "ADD", "use COPY (ADD fetches URLs and unpacks archives)"
        assert instruction.keyword != "MAINTAINER"
        if instruction.keyword == "RUN":
            assert "sudo " not in instruction.args
            assert not re.search(r"\bcd\s", instruction.args), "use WORKDIR, not cd"
            if "apt-get install" in instruction.args:
                assert "--no-install-recommends" in instruction.args
            if "pip install" in instruction.args:
                assert "--no-cache-dir" in instruction.args
        if instruction.keyword == "WORKDIR":
            assert instruction.args.startswith("/"), "WORKDIR must be absolute"
    for keyword in ("ENTRYPOINT", "CMD", "STOPSIGNAL", "HEALTHCHECK"):
        dockerfile.one(keyword)  # exactly one: a second silently overrides the first


def test_entrypoint_and_cmd_name_the_console_script_and_a_subcommand(
    dockerfile: Dockerfile,
) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert dockerfile.exec_form("ENTRYPOINT") == ["rollserve"]
    assert scripts["rollserve"] == "rollserve.server.serving.cli:main"
    command = dockerfile.exec_form("CMD")
    assert command[0] in cli.COMMANDS and command == ["serve"]


def test_environment_defaults(dockerfile: Dockerfile) -> None:
    env = dockerfile.env()
    check_env_names(env)
    assert env["ROLLSERVE_HOST"] == "0.0.0.0"
    assert env["PYTHONUNBUFFERED"] == "1"
    # Same tuned malloc as the Makefile's `make serve` (docs/reference/transport.md).
    makefile = (ROOT / "Makefile").read_text()
    for name in MALLOC_VARS:
        make_value = re.search(rf"^export {name} \?= (\d+)$", makefile, re.M)
        assert make_value and env[name] == make_value.group(1), name
    assert image_config(dockerfile, {}, ["serve"]).host == "0.0.0.0"


def test_ports_user_volume_and_stop_signal(dockerfile: Dockerfile) -> None:
    assert {ServerConfig().port, METRICS_PORT} <= expose_ports(dockerfile)
    assert dockerfile_uid(dockerfile) != 0
    assert json.loads(dockerfile.one("VOLUME")) == ["/models"]
    assert dockerfile.one("STOPSIGNAL") == "SIGTERM"  # what the server drains on
    # USER comes after the last RUN (which may need root) and before the entry point.
    keywords = [i.keyword for i in dockerfile.instructions]
    last_user = len(keywords) - 1 - keywords[::-1].index("USER")
    assert "RUN" not in keywords[last_user:]


def test_healthcheck_runs_rollserve_health_on_the_served_port(dockerfile: Dockerfile) -> None:
    options, command = dockerfile.healthcheck()
    check_health_command(command, ServerConfig().port)
    # Docker's timeout must leave the probe time to answer with its own deadline.
    probe_timeout_s = float(command[command.index("--timeout-s") + 1])
    assert duration_s(options["timeout"]) > probe_timeout_s
    assert duration_s(options["start-period"]) >= 120, "large models take minutes to load"
    assert int(options["retries"]) >= 1 and duration_s(options["interval"]) > 0


def test_dependency_layer_precedes_sources_and_covers_every_package(
    dockerfile: Dockerfile,
) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = dockerfile.arg_defaults()["EXTRAS"].split(",")
    assert "server" in extras and set(extras) <= set(pyproject["project"]["optional-dependencies"])
    deps = dockerfile.index("RUN", '".[${EXTRAS}]"')
    assert dockerfile.index("COPY", "pyproject.toml") < deps < dockerfile.index("COPY", "server/")
    assert "--constraint" in dockerfile.instructions[deps].args, "the base image's torch is kept"
    assert dockerfile.index("COPY", "server/") < dockerfile.index("RUN", "--no-deps .")
    # The placeholder folders of the dependency layer must be every package folder, or the
    # placeholder build fails; the later COPYs must bring every one of them.
    stub_dirs = set(_stub_dirs(dockerfile.instructions[deps].args))
    package_dirs = set(_package_dirs(pyproject))
    assert stub_dirs <= package_dirs
    uncovered = {p for p in package_dirs if not any(s.startswith(p) for s in stub_dirs)}
    assert not uncovered, f"layer 1 lacks placeholder folders for {uncovered}"
    copied = set(_copy_sources(dockerfile))
    assert {d.split("/")[0] for d in stub_dirs} <= copied


def test_dependency_layer_builds_without_sources(dockerfile: Dockerfile, tmp_path: Path) -> None:
    # Replay layer 1 with setuptools: only pyproject.toml, README.md and empty package folders.
    deps = dockerfile.instructions[dockerfile.index("RUN", '".[${EXTRAS}]"')]
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    for folder in _stub_dirs(deps.args):
        (tmp_path / folder).mkdir(parents=True)
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    result = subprocess.run(
        [*command, "-w", str(tmp_path / "wheels"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert list((tmp_path / "wheels").glob("rollserve-*.whl"))


def test_copied_paths_exist_and_are_not_dockerignored(dockerfile: Dockerfile) -> None:
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert not any(p.startswith("!") for p in ignored), "keep .dockerignore free of exceptions"
    assert {".git", ".venv"} <= set(ignored)
    sources = _copy_sources(dockerfile)
    for source in sources:
        assert not any(Path(source).match(p) for p in ignored), f"{source} is dockerignored"
    missing = [s for s in sources if not (ROOT / s).exists()]
    if missing == ["examples"]:
        pytest.skip("examples/ is not written yet; `docker build` needs it")
    assert not missing, f"COPY sources missing from the repository: {missing}"


def _copy_sources(dockerfile: Dockerfile) -> list[str]:
    """Source paths of every COPY (the last word is the destination; --options skipped)."""
    words = [args.split()[:-1] for args in dockerfile.all("COPY")]
    return [w.rstrip("/") for group in words for w in group if not w.startswith("--")]


def _stub_dirs(run_args: str) -> list[str]:
    match = re.search(r"mkdir -p ([^&]+)&&", run_args)
    assert match, "layer 1 creates the package folders with mkdir -p"
    return match.group(1).split()


def _package_dirs(pyproject: dict[str, Any]) -> list[str]:
    """Folder of every package in pyproject, through its package-dir mapping."""
    tool = pyproject["tool"]["setuptools"]
    mapping = tool["package-dir"]
    folders = []
    for package in tool["packages"]:
        root = max((r for r in mapping if package == r or package.startswith(r + ".")), key=len)
        folders.append("/".join([mapping[root], *package[len(root) + 1 :].split(".")]).rstrip("/"))
    return folders


# ---- docker-compose.yml -----------------------------------------------------------------------


def _compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    assert isinstance(env, dict), "write environment as a mapping"
    return {name: interpolate(str(value)) for name, value in env.items()}


def _compose_server(compose: dict[str, Any], dockerfile: Dockerfile) -> ServerConfig:
    service = compose["services"]["rollserve"]
    args = service.get("command", dockerfile.exec_form("CMD"))
    return image_config(dockerfile, _compose_env(service), args)


def test_compose_server_service(compose: dict[str, Any], dockerfile: Dockerfile) -> None:
    service = compose["services"]["rollserve"]
    config = _compose_server(compose, dockerfile)
    assert service["build"] in (".", {"context": "."})
    assert "entrypoint" not in service, "the image's rollserve entry point serves"
    assert ports_of(service["ports"]) == {config.port, metrics_port(config)}
    assert any(str(v).split(":")[1] == "/models" for v in service["volumes"])
    assert "models" in compose["volumes"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(
        d["driver"] == "nvidia" and "gpu" in d["capabilities"] and d["count"] in (1, "all")
        for d in devices
    ), devices


def test_compose_healthcheck_and_stop_grace(
    compose: dict[str, Any], dockerfile: Dockerfile
) -> None:
    service = compose["services"]["rollserve"]
    config = _compose_server(compose, dockerfile)
    health = service["healthcheck"]
    assert health["test"][0] == "CMD"
    check_health_command(health["test"][1:], config.port)
    probe_timeout_s = float(health["test"][health["test"].index("--timeout-s") + 1])
    assert duration_s(health["timeout"]) > probe_timeout_s
    assert duration_s(health["start_period"]) >= 120 and int(health["retries"]) >= 1
    drain_s = config.drain_delay_s + config.shutdown_grace_s
    assert duration_s(service["stop_grace_period"]) > drain_s, "docker would SIGKILL a drain"


def test_compose_trainer_waits_for_a_healthy_server(
    compose: dict[str, Any], dockerfile: Dockerfile
) -> None:
    server, trainer = compose["services"]["rollserve"], compose["services"]["trainer"]
    assert trainer["depends_on"]["rollserve"]["condition"] == "service_healthy"
    assert trainer["image"] == server["image"], "the trainer runs from the server's image"
    assert trainer["entrypoint"] == ["python", "examples/train_grpo.py"]
    command = trainer["command"]
    port = _compose_server(compose, dockerfile).port
    assert command[command.index("--target") + 1] == f"rollserve:{port}"
    assert "--out" in command
    assert trainer["healthcheck"] == {"disable": True}, "the image's probe is for servers"
    assert "deploy" not in trainer, "the GPU is the server's"


@pytest.mark.slow
def test_example_trainer_accepts_the_compose_flags(compose: dict[str, Any]) -> None:
    script = ROOT / "examples" / "train_grpo.py"
    if not script.exists():
        pytest.skip("examples/train_grpo.py is not written yet")
    result = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    flags = [a for a in compose["services"]["trainer"]["command"] if a.startswith("--")]
    assert all(flag in result.stdout for flag in flags), result.stdout


def test_docker_compose_config_accepts_the_file() -> None:
    docker = shutil.which("docker")
    probe = subprocess.run([docker, "compose", "version"], capture_output=True) if docker else None
    if probe is None or probe.returncode != 0:
        pytest.skip("docker compose is not installed")
    result = subprocess.run(
        [docker, "compose", "-f", str(ROOT / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert set(yaml.safe_load(result.stdout)["services"]) == {"rollserve", "trainer"}


# ---- deploy/k8s -------------------------------------------------------------------------------


def _pod_spec(k8s: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    return k8s[("Deployment", "rollserve")]["spec"]["template"]["spec"]


def _container(k8s: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    (container,) = _pod_spec(k8s)["containers"]
    return container


def _k8s_config(k8s: dict[tuple[str, str], dict[str, Any]], dockerfile: Dockerfile) -> ServerConfig:
    container = _container(k8s)
    assert "command" not in container, "command would replace the image's rollserve entry point"
    env = {item["name"]: str(item["value"]) for item in container.get("env", [])}
    return image_config(dockerfile, env, [str(a) for a in container["args"]])


def _named_port(container: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


def test_k8s_manifests_are_complete(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    kinds = {kind for kind, _ in k8s}
    assert {"Deployment", "Service", "PersistentVolumeClaim", "PodDisruptionBudget"} <= kinds
    for doc in k8s.values():
        assert doc["apiVersion"] and doc["metadata"]["labels"]["app.kubernetes.io/name"]
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
    assert kustomization["kind"] == "Kustomization"
    files = {doc["_file"] for doc in k8s.values()}
    assert set(kustomization["resources"]) == files, "kustomization.yaml must list every manifest"


def test_k8s_deployment_matches_the_cli(
    k8s: dict[tuple[str, str], dict[str, Any]], dockerfile: Dockerfile
) -> None:
    container = _container(k8s)
    config = _k8s_config(k8s, dockerfile)
    assert _named_port(container, "grpc") == config.port == ServerConfig().port
    assert _named_port(container, "metrics") == metrics_port(config) == METRICS_PORT
    resources = container["resources"]
    assert int(resources["limits"][GPU_RESOURCE]) >= 1
    assert (
        resources.get("requests", {}).get(GPU_RESOURCE, resources["limits"][GPU_RESOURCE])
        == (resources["limits"][GPU_RESOURCE])
    ), "extended resources need requests == limits"
    name, _, tag = container["image"].partition(":")
    kustomize_images = yaml.safe_load(KUSTOMIZATION.read_text())["images"]
    assert name in {image["name"] for image in kustomize_images}
    assert tag and tag != "latest"


def test_k8s_probes_use_grpc_health_on_the_serving_port(
    k8s: dict[tuple[str, str], dict[str, Any]], dockerfile: Dockerfile
) -> None:
    container = _container(k8s)
    port = _k8s_config(k8s, dockerfile).port
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]
        assert probe["grpc"]["port"] == port, f"{kind} probes another port"
        assert probe["grpc"].get("service", "") in ("", "rollserve.v1.Rollout"), kind
    assert container["readinessProbe"]["grpc"].get("service", "") == ""
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "slow model loads"


def test_k8s_termination_grace_covers_drain_and_shutdown(
    k8s: dict[tuple[str, str], dict[str, Any]], dockerfile: Dockerfile
) -> None:
    config = _k8s_config(k8s, dockerfile)
    assert config.drain_delay_s > 0, "endpoints need a drain delay before calls are refused"
    grace_s = _pod_spec(k8s)["terminationGracePeriodSeconds"]
    assert grace_s > config.drain_delay_s + config.shutdown_grace_s


def test_k8s_pod_runs_as_the_image_user_with_models_from_the_claim(
    k8s: dict[tuple[str, str], dict[str, Any]], dockerfile: Dockerfile
) -> None:
    pod = _pod_spec(k8s)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == dockerfile_uid(dockerfile)
    (models,) = [m for m in _container(k8s)["volumeMounts"] if m["mountPath"] == "/models"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == models["name"]]
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in k8s
    assert _k8s_config(k8s, dockerfile).actor.startswith("/models/")


def test_k8s_services_select_the_pods(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    deployment = k8s[("Deployment", "rollserve")]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    container = _container(k8s)
    headless = k8s[("Service", "rollserve-headless")]["spec"]
    assert headless["clusterIP"] == "None"  # one DNS record per ready pod
    assert not headless.get("publishNotReadyAddresses", False)
    for (kind, _), doc in k8s.items():
        if kind == "Service":
            assert doc["spec"]["selector"].items() <= labels.items()
            for port in doc["spec"]["ports"]:
                assert _named_port(container, port["targetPort"]) == port["port"]
        if kind == "PodDisruptionBudget":
            assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (grpc_port,) = headless["ports"]
    assert grpc_port["port"] == ServerConfig().port
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == METRICS_PORT


def test_kubectl_kustomize_renders_the_folder(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S_DIR)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    rendered = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(result.stdout)}
    assert rendered == {key for key in k8s if key[0] != "Kustomization"}


# ---- metrics port -----------------------------------------------------------------------------


def test_metrics_port_default_is_the_exposed_one(dockerfile: Dockerfile) -> None:
    assert METRICS_PORT in expose_ports(dockerfile)
    assert metrics_port(ServerConfig()) == METRICS_PORT


# ---- the image's contract, outside Docker ------------------------------------------------------


def _console_script() -> str:
    # The venv's own script first: a pyenv shim would pick whichever Python is active.
    beside = Path(sys.executable).with_name("rollserve")
    found = str(beside) if beside.exists() else shutil.which("rollserve")
    if found is None:
        pytest.fail("the rollserve console script is not installed (pip install -e .)")
    return found


def test_console_script_health_exits_1_when_nothing_listens() -> None:
    command = [_console_script(), "health", "--target", f"127.0.0.1:{free_port()}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "UNAVAILABLE" in result.stdout


def test_console_script_serve_help_exits_0() -> None:
    result = subprocess.run(
        [_console_script(), "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "--actor" in result.stdout and "ROLLSERVE_" in result.stdout


@pytest.mark.slow
def test_image_contract_serve_healthcheck_and_stop_signal(
    dockerfile: Dockerfile, compose: dict[str, Any], tmp_path: Path
) -> None:
    # What `docker compose up rollserve` runs, minus Docker: ENTRYPOINT + compose command with
    # the image's and compose's environment; then the HEALTHCHECK; then the STOPSIGNAL.
    service = compose["services"]["rollserve"]
    port_file = tmp_path / "port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSERVE_")}
    env |= dockerfile.env() | _compose_env(service)
    # Loopback and a free port for the test machine; the CPU keeps the test the same everywhere.
    env |= {"ROLLSERVE_HOST": "127.0.0.1", "ROLLSERVE_PORT": "0", "ROLLSERVE_DEVICE": "cpu"}
    env["ROLLSERVE_PORT_FILE"] = str(port_file)
    command = [_console_script(), *service["command"]]
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        port = _wait_for_port_file(proc, port_file, timeout_s=120)
        _, health = dockerfile.healthcheck()
        probe = [_console_script(), *health[1:]]
        probe[probe.index("--target") + 1] = f"127.0.0.1:{port}"
        deadline_s = time.monotonic() + 120
        while (
            result := subprocess.run(probe, capture_output=True, text=True, timeout=60)
        ).returncode:
            assert proc.poll() is None and time.monotonic() < deadline_s, result.stdout
            time.sleep(0.2)
        assert "SERVING" in result.stdout
        proc.send_signal(signal.Signals[dockerfile.one("STOPSIGNAL")])
        assert proc.wait(timeout=duration_s(service["stop_grace_period"])) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log_text = log_path.read_text(errors="replace")
    assert "Traceback" not in log_text, log_text


def _wait_for_port_file(proc: subprocess.Popen[bytes], port_file: Path, timeout_s: float) -> int:
    deadline_s = time.monotonic() + timeout_s
    while not port_file.exists():
        assert proc.poll() is None, f"server exited with {proc.returncode} during start-up"
        assert time.monotonic() < deadline_s, "server did not bind in time"
        time.sleep(0.1)
    return int(port_file.read_text())
