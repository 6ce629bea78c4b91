"""Every file under infra/ is checked: it parses, has its tool's required keys, names commands that
exist, and (for the local scripts) really starts and stops a Ray head and an S3-compatible server."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from pipeline.cli import COMMANDS
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
ACCELERATE_CONFIGS = sorted((INFRA / "accelerate").glob("*.yaml"))
RAYJOBS = sorted((INFRA / "ray").glob("rayjob-*.yaml"))
YAML_FILES = sorted(INFRA.rglob("*.yaml"))
TEXT_FILES = sorted(p for p in INFRA.rglob("*") if p.is_file() and p.suffix in (".yaml", ".sh", ".md"))
SECRET_NAME = re.compile(r"(SECRET|PASSWORD|ACCESS_KEY|(^|_)TOKEN($|_))", re.IGNORECASE)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def header_command(path: Path) -> list[str]:
    """The command on the file's first line (``# <command>``), as argv; a trailing ``(...)`` note is dropped."""
    first = path.read_text().splitlines()[0]
    assert first.startswith("# "), f"{rel(path)} must begin with '# <the command that uses it>'"
    return shlex.split(re.sub(r"\s+\(.*\)\s*$", "", first[2:]))


def strip_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Split leading ``NAME=value`` assignments off a command."""
    env = {}
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        name, value = argv.pop(0).split("=", 1)
        env[name] = value
    return env, argv


def module_exists(name: str) -> bool:
    if name == "train" and not (ROOT / "train").is_dir():
        pytest.skip("train/ is not in this tree yet; its entry point is checked once it lands")
    return importlib.util.find_spec(name) is not None


def module_options(module_name: str) -> set[str] | None:
    """Option strings of a bucketeer job module's parser, or None while the module is a placeholder."""
    command = module_name.rsplit(".", 1)[-1]
    if COMMANDS.get(command, (None,))[0] != module_name:
        return None
    parser = argparse.ArgumentParser()
    importlib.import_module(module_name).add_arguments(parser)
    positionals = [a for a in parser._actions if not a.option_strings]
    if not positionals:  # placeholder modules take no arguments yet
        return None
    return {s for a in parser._actions for s in a.option_strings}


def check_job_command(argv: list[str], where: str) -> None:
    """``python -m pipeline.<job> ARGS``: the module exists, and every ``--option`` is one it takes."""
    assert argv[:2] == ["python", "-m"], f"{where}: expected 'python -m <module> ...', got {argv}"
    module = argv[2]
    assert module_exists(module), f"{where}: module {module} does not exist"
    options = module_options(module)
    if options is None:
        return
    used = {a.split("=", 1)[0] for a in argv[3:] if a.startswith("--")}
    assert used <= options, f"{where}: {module} has no option(s) {sorted(used - options)}"


# ---------------------------------------------------------------- every file


@pytest.mark.parametrize("path", YAML_FILES, ids=rel)
def test_yaml_parses_and_begins_with_its_command(path):
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict) and doc, f"{rel(path)} is not a YAML mapping"
    argv = strip_env(header_command(path))[1]
    assert argv[0] in ("accelerate", "ray", "kubectl"), f"{rel(path)}: unexpected command {argv[0]}"
    if rel(path) != "infra/ray/runtime_env.yaml":
        assert rel(path) in argv, f"{rel(path)}: its command must name the file itself"


def test_infra_names_only_commands_and_modules_that_exist():
    subcommands, modules = set(), set()
    for path in TEXT_FILES:
        text = path.read_text()
        subcommands |= set(re.findall(r"(?:^|#\s+|`|&&\s+|;\s+)bucketeer ([a-z][a-z-]*)", text, re.MULTILINE))
        modules |= set(re.findall(r"\bpython3? -m ([A-Za-z_][\w.]*)", text))
        modules |= set(re.findall(r"\baccelerate launch [^\n]*? -m ([A-Za-z_][\w.]*)", text))
    assert {"scan", "plan"} <= subcommands, subcommands
    assert subcommands <= set(COMMANDS), f"unknown bucketeer subcommands: {sorted(subcommands - set(COMMANDS))}"
    assert {"pipeline.scan", "pipeline.embed", "train"} <= modules, modules
    for module in sorted(modules - {"train"}):
        assert module_exists(module), f"infra/ names `python -m {module}`, which does not exist"
    if (ROOT / "train").is_dir():
        assert module_exists("train.__main__"), "`-m train` needs train/__main__.py"


def test_job_commands_shown_in_infra_use_options_the_jobs_take():
    seen = 0
    for path in TEXT_FILES:
        text = re.sub(r"\\\n#?\s*", " ", path.read_text())  # join continued lines, also inside comments
        for command in re.findall(r"python -m pipeline\.\w+[^\n`]*", text):
            check_job_command(shlex.split(command), rel(path))
            seen += 1
    assert seen >= 6


# ---------------------------------------------------------------- accelerate


def test_accelerate_configs_cover_the_documented_layouts():
    docs = {p.name: yaml.safe_load(p.read_text()) for p in ACCELERATE_CONFIGS}
    layouts = {
        (d["distributed_type"], d["num_machines"], d["num_processes"], d.get("fsdp_config", {}).get("fsdp_version"),
         d.get("deepspeed_config", {}).get("zero_stage"), d["use_cpu"])
        for d in docs.values()
    }  # fmt: skip
    assert ("MULTI_GPU", 1, 8, None, None, False) in layouts
    assert ("MULTI_GPU", 4, 32, None, None, False) in layouts
    assert ("FSDP", 1, 8, 2, None, False) in layouts
    assert ("DEEPSPEED", 1, 8, None, 1, False) in layouts
    assert docs["cpu-2proc.yaml"]["num_processes"] == 2 and docs["cpu-2proc.yaml"]["use_cpu"] is True


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=rel)
def test_accelerate_config_is_accepted_by_accelerate(path):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    raw = yaml.safe_load(path.read_text())
    for key in ("compute_environment", "distributed_type", "num_processes", "num_machines", "machine_rank",
                "mixed_precision", "use_cpu"):  # fmt: skip
        assert key in raw, f"{rel(path)} lacks {key}"
    config = ClusterConfig.from_yaml_file(str(path))  # raises on unknown top-level keys
    assert config.num_processes % config.num_machines == 0
    # nested keys become `accelerate launch` options; one it does not know would be silently ignored
    dests = {a.dest for a in launch_command_parser()._actions}
    for key in raw.get("fsdp_config", {}):
        assert key in dests, f"{rel(path)}: fsdp_config.{key} is not an accelerate option"
    for key in raw.get("deepspeed_config", {}):
        assert key in dests, f"{rel(path)}: deepspeed_config.{key} is not an accelerate option"

    env, argv = strip_env(header_command(path))
    assert argv[:2] == ["accelerate", "launch"]
    # every flag of the documented command exists ($NODE_RANK-style placeholders stand for numbers)
    args = launch_command_parser().parse_args([re.sub(r"^\$\w+$", "0", a) for a in argv[2:]])
    assert args.config_file == rel(path)
    assert args.module and args.training_script == "train"
    assert {"--plan", "--cache"} <= set(args.training_script_args)
    world = re.search(r"--world-size (\d+)", path.read_text())
    assert world and int(world.group(1)) == config.num_processes, f"{rel(path)}: plan world size != num_processes"
    if module_exists("train"):
        out = subprocess.run(
            [sys.executable, "-m", "train", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        help_text = out.stdout + out.stderr
        if "not available yet" in help_text:  # the placeholder trainer takes no options yet
            return
        assert out.returncode == 0, help_text
        for option in (a for a in args.training_script_args if a.startswith("--")):
            assert option in help_text, f"{rel(path)}: `python -m train` has no option {option}"


@pytest.mark.dist
def test_cpu_2proc_config_launches_two_gloo_ranks(tmp_path):
    """The cpu-2proc command, exactly as its header gives it, with a probe in place of the trainer."""
    path = INFRA / "accelerate" / "cpu-2proc.yaml"
    env, argv = strip_env(header_command(path))
    argv = argv[: argv.index("-m")]  # `accelerate launch --config_file ...` up to the training module
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch.distributed as dist\nfrom accelerate import Accelerator\n"
        "a = Accelerator()\n"
        # one file per rank: two processes printing to one pipe interleave their lines
        "import sys\n"
        "open(f'{sys.argv[1]}/rank-{a.process_index}.txt', 'w')"
        ".write(f'{a.process_index} {a.num_processes} {a.distributed_type.value} {dist.get_backend()}')\n"
    )
    accelerate = str(Path(sys.executable).parent / "accelerate")
    argv = [accelerate, *argv[1:], "--main_process_port", str(free_port()), str(probe), str(tmp_path)]
    out = subprocess.run(argv, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = sorted(p.read_text().split() for p in tmp_path.glob("rank-*.txt"))
    assert ranks == [["0", "2", "MULTI_CPU", "gloo"], ["1", "2", "MULTI_CPU", "gloo"]], out.stdout


# ---------------------------------------------------------------- ray


def test_runtime_env_is_accepted_by_ray():
    from ray.runtime_env import RuntimeEnv

    path = INFRA / "ray" / "runtime_env.yaml"
    raw = yaml.safe_load(path.read_text())
    RuntimeEnv(**raw)  # raises on unknown fields and bad types
    assert not any(SECRET_NAME.search(k) for k in raw.get("env_vars", {})), "no credentials in runtime_env"
    for line in (line for line in path.read_text().splitlines() if line.startswith("# ray job submit")):
        argv = shlex.split(line[2:])
        assert argv[:3] == ["ray", "job", "submit"]
        assert argv[argv.index("--runtime-env") + 1] == rel(path) and argv[argv.index("--working-dir") + 1] == "."
        check_job_command(argv[argv.index("--") + 1 :], rel(path))


def test_cluster_launcher_config_is_valid_for_ray():
    import jsonschema
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((INFRA / "ray" / "cluster-aws.yaml").read_text())
    for key in ("cluster_name", "provider", "available_node_types", "head_node_type", "setup_commands"):
        assert key in raw
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(raw, schema)  # Ray's own schema: no unknown keys anywhere
    validate_config(prepare_config(raw))

    types = raw["available_node_types"]
    assert raw["head_node_type"] in types and raw["provider"]["type"] == "aws"
    workers = {name: t for name, t in types.items() if name != raw["head_node_type"]}
    assert any(t["resources"].get("GPU", 0) >= 1 for t in workers.values()), "a GPU worker group for embed"
    assert any(t["resources"].get("CPU", 0) >= 1 and not t["resources"].get("GPU") for t in workers.values())
    assert any("pip install" in c and "bucketeer" in c for c in raw["setup_commands"])
    for local in raw["file_mounts"].values():
        assert local.startswith("~") or (ROOT / local).exists()
    assert all("RAY_AUTH_MODE=token" in c for c in raw["head_start_ray_commands"] + raw["worker_start_ray_commands"]
               if "ray start" in c)  # fmt: skip
    assert not re.search(r"(?i)aws_secret_access_key\s*[:=]", (INFRA / "ray" / "cluster-aws.yaml").read_text())


@pytest.mark.parametrize("path", RAYJOBS, ids=rel)
def test_rayjob_spec(path):
    from ray.runtime_env import RuntimeEnv

    doc = yaml.safe_load(path.read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob" and doc["metadata"]["name"]
    spec = doc["spec"]
    check_job_command(shlex.split(spec["entrypoint"]), rel(path))
    RuntimeEnv(**yaml.safe_load(spec["runtimeEnvYAML"]))
    cluster = spec["rayClusterSpec"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    gpus = 0
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            assert container["image"]
            for var in container.get("env", []):
                if SECRET_NAME.search(var["name"]):
                    assert "value" not in var, f"{rel(path)}: {var['name']} inline; take it from a Secret"
                    assert var["valueFrom"]["secretKeyRef"]["name"]
            gpus += int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
    names = {v["name"] for c in groups[0]["template"]["spec"]["containers"] for v in c.get("env", [])}
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= names
    module = shlex.split(spec["entrypoint"])[2]
    if module == "pipeline.embed":
        assert gpus >= 1, "the embed job needs a GPU worker group (nvidia.com/gpu limits)"
    else:
        assert gpus == 0, "the scan job reads headers only: no GPUs"


# ---------------------------------------------------------------- local scripts (real processes)


def script_env(state_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(BUCKETEER_LOCAL_DIR=str(state_dir), PYTHON=sys.executable, **extra)
    return env


def read_env_file(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^export (\w+)=(.*)$", path.read_text(), re.MULTILINE))


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def kill_group(pid_file: Path) -> None:
    """Last-resort cleanup of a process group a script started, by the pid it recorded."""
    if pid_file.exists():
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def wait_gone(pgid: int, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not group_alive(pgid)


@pytest.mark.s3
@pytest.mark.slow
def test_local_s3_endpoint_starts_serves_and_stops(tmp_path):
    import s3fs

    state = tmp_path / "state"
    port = free_port()
    env = script_env(state, S3_PORT=str(port), S3_BUCKET="demo")
    try:
        up = subprocess.run([INFRA / "local" / "s3-up.sh"], env=env, capture_output=True, text=True, timeout=120)
        assert up.returncode == 0, up.stderr
        assert f'--storage-options \'{{"endpoint_url": "http://127.0.0.1:{port}"}}\'' in up.stdout
        printed = read_env_file(state / "s3.env")
        assert printed["AWS_ENDPOINT_URL"] == f"http://127.0.0.1:{port}"
        pid = int((state / "s3.pid").read_text())

        # the printed endpoint serves the bucket the script created, through s3fs as bucketeer uses it
        fs = s3fs.S3FileSystem(
            key=printed["AWS_ACCESS_KEY_ID"], secret=printed["AWS_SECRET_ACCESS_KEY"],
            client_kwargs={"endpoint_url": printed["AWS_ENDPOINT_URL"]}, use_listings_cache=False,
        )  # fmt: skip
        fs.pipe_file("demo/hello.txt", b"hello")
        assert fs.cat_file("demo/hello.txt") == b"hello"

        again = subprocess.run([INFRA / "local" / "s3-up.sh"], env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode != 0 and "already running" in again.stderr

        down = subprocess.run([INFRA / "local" / "s3-down.sh"], env=env, capture_output=True, text=True, timeout=60)
        assert down.returncode == 0, down.stderr
        assert wait_gone(pid, 10) and not (state / "s3.pid").exists()
    finally:
        kill_group(state / "s3.pid")


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.full
def test_local_ray_head_takes_authenticated_jobs_and_stops(tmp_path):
    import psutil

    from manifests.manifest import write_manifest
    from manifests.buckets import BucketSpec
    from tests.factories import manifest_tables

    manifest = tmp_path / "manifest"
    samples, errors = manifest_tables(40, seed=3)
    write_manifest(str(manifest), samples, errors, source="file:///data", spec=BucketSpec())

    # Ray puts unix sockets under its temp dir (108-byte limit): keep the state folder short
    state = Path(tempfile.mkdtemp(prefix="bkt-", dir="/tmp"))
    ports = [free_port() for _ in range(9)]
    extra = (
        f"--ray-client-server-port {ports[2]} --dashboard-agent-listen-port {ports[3]} "
        f"--dashboard-agent-grpc-port {ports[4]} --node-manager-port {ports[5]} --object-manager-port {ports[6]} "
        f"--runtime-env-agent-port {ports[7]} --metrics-export-port {ports[8]}"
    )  # explicit free ports: other Ray instances may hold Ray's defaults on this machine
    env = script_env(state, RAY_PORT=str(ports[0]), RAY_DASHBOARD_PORT=str(ports[1]), RAY_NUM_CPUS="1",
                     RAY_START_EXTRA_ARGS=extra)  # fmt: skip
    try:
        up = subprocess.run([INFRA / "local" / "ray-up.sh"], env=env, capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        pgid = int((state / "ray.pid").read_text())
        client = {**env, **read_env_file(state / "ray.env")}
        assert client["RAY_AUTH_MODE"] == "token" and Path(client["RAY_AUTH_TOKEN_PATH"]).stat().st_mode & 0o077 == 0
        assert client["RAY_API_SERVER_ADDRESS"] == f"http://127.0.0.1:{ports[1]}"

        # loopback only: every port the head's processes listen on is on 127.0.0.1
        pids = {p.pid for p in psutil.process_iter() if _pgid(p.pid) == pgid}
        listening = {(c.laddr.ip, c.laddr.port) for c in psutil.net_connections("inet")
                     if c.pid in pids and c.status == "LISTEN"}  # fmt: skip
        assert listening and all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for ip, _ in listening), listening

        # the documented submission: runtime_env.yaml + this checkout as working dir, a real bucketeer job
        submit = subprocess.run(
            ["ray", "job", "submit", "--runtime-env", "infra/ray/runtime_env.yaml", "--working-dir", ".", "--",
             "python", "-m", "pipeline.stats", str(manifest), "--json"],
            cwd=ROOT, env=client, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
        assert f'"samples": {samples.num_rows}' in submit.stdout

        # without the token the job API refuses
        anonymous = {k: v for k, v in client.items() if not k.startswith("RAY_AUTH")}
        refused = subprocess.run(["ray", "job", "list"], env=anonymous, capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0 and "Unauthorized" in refused.stdout + refused.stderr

        down = subprocess.run([INFRA / "local" / "ray-down.sh"], env=env, capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr
        assert wait_gone(pgid, 30), "processes of the head's group survived ray-down.sh"
        assert not (state / "ray.pid").exists()
    finally:
        kill_group(state / "ray.pid")
        subprocess.run(["rm", "-rf", str(state)], check=False)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
