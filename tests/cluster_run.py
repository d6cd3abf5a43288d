"""Run serialized Flyte workflows the way a cluster does, without a cluster.

`package` serializes the repository with `pyflyte package` (every workflow, task and launch plan,
as `pyflyte register` would send them to flyteadmin) and `read_package` reads the protobufs back:
`flyteidl.admin.task_pb2.TaskSpec` (files `*_1.pb`), `workflow_pb2.WorkflowSpec` (`*_2.pb`) and
`launch_plan_pb2.LaunchPlan` (`*_3.pb`), the naming of flytekit's
`tools/serialize_helpers.persist_registrable_entities`.

`run_workflow` then plays FlytePropeller for a workflow of task nodes: it orders the nodes by their
`upstream_node_ids`, builds each node's inputs from its bindings (workflow inputs and upstream
outputs, as Flyte literals), writes them as a `LiteralMap` protobuf (`inputs.pb`) to S3, and starts
the task's serialized container command (`TaskTemplate.container.args`, i.e. flytekit's
`pyflyte-execute ... --resolver ... -- task-module M task-name T`) with Propeller's template
variables (`{{.input}}`, `{{.outputPrefix}}`, `{{.rawOutputDataPrefix}}`, `{{.checkpointOutputPrefix}}`,
`{{.prevCheckpointPrefix}}`) filled with s3:// URIs. Each task runs as a pod would: its own process,
an empty working directory and HOME, only the image's code (copied without `.git`, as the image has
it at /root) and the environment a pod gets (the template's env, Propeller's FLYTE_INTERNAL_*
variables, the data plane's storage settings, the task's secrets). Like Propeller it reads the
task's result from the output prefix: `outputs.pb` (a `LiteralMap`) or `error.pb` (an
`ErrorDocument`); `pyflyte-execute` exits 0 after a user error and leaves only `error.pb`.

Layout under the bucket follows Propeller's defaults (flytepropeller `storage` and
`ioutils`): `metadata/propeller/<project>-<domain>-<execution>/<node>/data/` for inputs.pb,
`.../data/<attempt>/` for outputs, `data/<execution>/<node>/<attempt>` for raw output data.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flyteidl.admin import launch_plan_pb2, task_pb2, workflow_pb2
from flyteidl.core import errors_pb2, literals_pb2, tasks_pb2, workflow_pb2 as core_workflow_pb2

REPO = Path(__file__).resolve().parent.parent
# What the images copy to /root (containers/*.dockerignore, tasks/images.py PACKAGE_FILES).
IMAGE_FILES = ("pyproject.toml", "README.md", "envace_core", "tasks", "workflows", ".dvc/config")
START_NODE = "start-node"
PROJECT, DOMAIN = "envace", "development"


class PodFailed(AssertionError):
    """A task's pod exited non-zero, wrote `error.pb`, or wrote no `outputs.pb`; the message holds
    the container command's stderr tail and the error document."""

    def __init__(self, message: str, result: "PodResult"):
        super().__init__(message)
        self.result = result


@dataclass
class Package:
    """A `pyflyte package` archive, read back: entities by name."""

    tasks: dict[str, tasks_pb2.TaskTemplate] = field(default_factory=dict)
    workflows: dict[str, core_workflow_pb2.WorkflowTemplate] = field(default_factory=dict)
    launch_plans: dict[str, launch_plan_pb2.LaunchPlanSpec] = field(default_factory=dict)
    images: dict[str, dict[str, Any]] = field(default_factory=dict)  # image name -> {"id", "commands"}


@dataclass
class PodResult:
    """One task execution: its command, exit status, output (stdout+stderr), wall and CPU (user +
    system) seconds, the output prefix, the non-loopback addresses it tried to connect to, and what it left there (outputs `LiteralMap`, or `ErrorDocument`, or neither)."""

    node_id: str
    task: str
    args: list[str]
    returncode: int
    log: str
    seconds: float
    cpu_seconds: float
    output_prefix: str
    network: list[str]
    outputs: literals_pb2.LiteralMap | None
    error: errors_pb2.ErrorDocument | None


# --------------------------------------------------------------------------------- serialization
# Runs pyflyte in-process after naming every ImageSpec of tasks/images.py as a prebuilt image
# (`--image <ImageSpec.id>=<image_name()>`, flytekit's ImageConfig lookup): flytekit then puts that
# name in the templates without asking a registry whether the image exists (which needs the network,
# and fails under FLYTE_IMG_FAST_FAIL when it cannot), as when the images are built outside flytekit.
# It also writes <output>.images.json: {image name: {"id": ImageSpec.id, "commands": build commands}}.
_PACKAGE = """
import json, sys
from flytekit import ImageSpec
from flytekit.clis.sdk_in_container.pyflyte import main
import tasks.images as images
specs = [v for v in vars(images).values() if isinstance(v, ImageSpec)]
named = [a for i in specs for a in ("--image", f"{i.id}={i.image_name()}")]
with open(sys.argv[sys.argv.index("--output") + 1] + ".images.json", "w") as f:
    json.dump({i.image_name(): {"id": i.id, "commands": list(i.commands or [])} for i in specs}, f)
sys.argv = ["pyflyte", "--pkgs", "workflows", "package", *named, *sys.argv[1:]]
main()
"""


def package(out: Path, registry: str = "registry.example.com/envace", env: dict[str, str] | None = None,
            timeout: float = 180) -> Path:
    """`pyflyte --pkgs workflows package --image ... --copy none --source . --output OUT` from the
    repository root (the workflows import every task module), with ENVACE_IMAGE_REGISTRY=`registry`
    and the task images named as prebuilt (`_PACKAGE`); returns OUT (`read_package` reads it and
    OUT.images.json). AssertionError with pyflyte's output when it fails."""
    args = ["--image", f"{registry}/envace-default:unused", "--copy", "none", "--source", ".",
            "--output", str(out), "--force"]
    t0 = time.monotonic()
    code, log, cpu = run_command([sys.executable, "-c", _PACKAGE, *args], REPO,
                          {**os.environ, "ENVACE_IMAGE_REGISTRY": registry, **(env or {})}, timeout)
    if code != 0 or not out.is_file():
        raise AssertionError(f"pyflyte package {' '.join(args)} failed ({code}):\n{log[-6000:]}")
    print(f"pyflyte package: {time.monotonic() - t0:.1f} s, {cpu:.1f} s CPU")
    return out


_ENTITY_FILE = re.compile(r"\d+_(.+)_([123])\.pb")


def read_package(tgz: Path) -> Package:
    """Every TaskSpec / WorkflowSpec / LaunchPlanSpec in a `pyflyte package` archive, by name."""
    sidecar = Path(f"{tgz}.images.json")
    pkg = Package(images=json.loads(sidecar.read_text()) if sidecar.is_file() else {})
    with tarfile.open(tgz) as tar:
        for member in tar.getmembers():
            data = tar.extractfile(member).read() if member.isfile() else None
            if data is None:
                continue
            m = _ENTITY_FILE.fullmatch(Path(member.name).name)
            if m is None:
                raise ValueError(f"{tgz}: unexpected member {member.name!r}")
            name, kind = m.groups()
            if kind == "1":
                pkg.tasks[name] = task_pb2.TaskSpec.FromString(data).template
            elif kind == "2":
                pkg.workflows[name] = workflow_pb2.WorkflowSpec.FromString(data).template
            else:
                pkg.launch_plans[name] = launch_plan_pb2.LaunchPlan.FromString(data).spec
    return pkg


# ------------------------------------------------------------------------------------- literals
def string_literal(value: str) -> literals_pb2.Literal:
    return literals_pb2.Literal(scalar=literals_pb2.Scalar(primitive=literals_pb2.Primitive(string_value=value)))


def launch_inputs(plan: launch_plan_pb2.LaunchPlanSpec, **values: str) -> literals_pb2.LiteralMap:
    """The workflow inputs flyteadmin builds for an execution of `plan`: its fixed inputs, its
    defaults, and `values` (strings) for the rest. ValueError for a fixed or unknown input."""
    fixed = dict(plan.fixed_inputs.literals)
    params = dict(plan.default_inputs.parameters)
    bad = [k for k in values if k in fixed or k not in params]
    if bad:
        raise ValueError(f"launch plan does not take inputs {bad} (fixed: {sorted(fixed)}, "
                         f"free: {sorted(set(params) - set(fixed))})")
    out = literals_pb2.LiteralMap()
    for name, p in params.items():
        if name in values:
            out.literals[name].CopyFrom(string_literal(values[name]))
        elif p.HasField("default"):
            out.literals[name].CopyFrom(p.default)
        elif p.required:
            raise ValueError(f"launch plan input {name!r} is required")
    for name, lit in fixed.items():
        out.literals[name].CopyFrom(lit)
    return out


def _bound(binding: Any, outputs: dict[str, literals_pb2.LiteralMap]) -> literals_pb2.Literal:
    kind = binding.WhichOneof("value")
    if kind == "promise":  # flytekit serializes a workflow input's node id as "" (GLOBAL_INPUT_NODE_ID)
        return outputs[binding.promise.node_id or START_NODE].literals[binding.promise.var]
    if kind == "scalar":
        return literals_pb2.Literal(scalar=binding.scalar)
    raise NotImplementedError(f"binding kind {kind!r} (only promises and scalars are wired here)")


def node_order(wf: core_workflow_pb2.WorkflowTemplate) -> list[Any]:
    """The workflow's nodes in an order that respects `upstream_node_ids` (serialized order on ties)."""
    done, order, nodes = {START_NODE}, [], list(wf.nodes)
    while nodes:
        ready = [n for n in nodes if set(n.upstream_node_ids) <= done]
        if not ready:
            raise ValueError(f"cycle among nodes {[n.id for n in nodes]}")
        order.append(ready[0])
        done.add(ready[0].id)
        nodes.remove(ready[0])
    return order


# ----------------------------------------------------------------------------------------- pods
class S3Plane:
    """The blob store Propeller and the pods share: a bucket on an S3-compatible endpoint.

    `client` is a boto3 S3 client for it; `env` is what a pod needs to reach it: flytekit's data
    plane settings (FLYTE_AWS_*, as flyte-sandbox's default pod environment) and the AWS SDK's
    (AWS_*, as a service account's credentials would be).
    """

    def __init__(self, client: Any, bucket: str, endpoint: str, key_id: str, secret: str, region: str):
        self.client, self.bucket = client, bucket
        self.env = {
            "FLYTE_AWS_ENDPOINT": endpoint, "FLYTE_AWS_ACCESS_KEY_ID": key_id,
            "FLYTE_AWS_SECRET_ACCESS_KEY": secret,
            "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": region, "AWS_EC2_METADATA_DISABLED": "true",
        }

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _key(self, uri: str) -> str:
        prefix = f"s3://{self.bucket}/"
        assert uri.startswith(prefix), uri
        return uri[len(prefix):]

    def put(self, uri: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(uri), Body=data)

    def get(self, uri: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(uri))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def keys(self, prefix_uri: str) -> list[str]:
        """Object keys under a prefix URI (all pages)."""
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                         Prefix=self._key(prefix_uri)):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out

    def upload_dir(self, local: Path, uri: str) -> None:
        for f in sorted(p for p in local.rglob("*") if p.is_file()):
            self.client.upload_file(str(f), self.bucket, f"{self._key(uri)}/{f.relative_to(local).as_posix()}")


def image_root(dest: Path, images: dict[str, dict[str, Any]] | None = None) -> Path:
    """The image's /root: the files the containers copy (without `.git`, `.envace` or `__pycache__`),
    then the images' build commands that write `envace_core/BUILD_INFO.json` (`images` from
    `Package.images`), run with /root replaced by `dest`. The other build commands install packages
    this environment already has (`uv pip install`) or clean what was not copied, and are not run."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in IMAGE_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "BUILD_INFO.json"))
        else:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    stamps = {c for spec in (images or {}).values() for c in spec["commands"] if "BUILD_INFO.json" in c}
    for cmd in sorted(stamps):
        subprocess.run(["bash", "-c", cmd.replace("/root/", f"{dest}/")], check=True, timeout=30)
    return dest


# sitecustomize.py of every pod (like tests/conftest.py's _no_network): a connection to anything but
# loopback fails as it would offline, and is written to the pod's network.log, which `check` refuses
# (a library that swallows the error cannot hide it).
_OFFLINE = """
import os, socket
_connect = socket.socket.connect
def _guarded(self, address):
    host = address[0] if isinstance(address, tuple) else address
    if self.family in (socket.AF_INET, socket.AF_INET6) and isinstance(host, str) \\
            and not (host.startswith("127.") or host in ("localhost", "::1")):
        with open(os.path.join(os.path.dirname(__file__), "network.log"), "a") as log:
            log.write(f"{address}\\n")
        raise OSError(f"pod tried the network: {address}")
    return _connect(self, address)
socket.socket.connect = _guarded
"""


_TEMPLATE_VAR = re.compile(r"\{\{\s*\.(\w+)\s*\}\}")


def fill_args(args: list[str], values: dict[str, str]) -> list[str]:
    """Propeller's substitution of `{{.name}}` in a container's args; KeyError for an unknown name."""
    def sub(m: re.Match) -> str:
        if m.group(1) not in values:
            raise KeyError(f"template variable {m.group(0)} has no value (have {sorted(values)})")
        return values[m.group(1)]
    return [_TEMPLATE_VAR.sub(sub, a) for a in args]


def pod_env(template: tasks_pb2.TaskTemplate, plane: S3Plane, home: Path, code: Path, execution: str,
            node_id: str, attempt: int, secrets: dict[tuple[str, str], str], extra: dict[str, str],
            image_id: str | None = None) -> dict[str, str]:
    """A pod's environment: the image's (PATH, PYTHONPATH=/root equivalent, HOME), the template's
    env, Propeller's FLYTE_INTERNAL_* / FLYTE_ATTEMPT_NUMBER, the storage settings, and each declared
    secret as Flyte's secret webhook mounts it: the Secret's `env_var`, else flytekit's
    `_FSEC_<GROUP>_<KEY>`, or a file under FLYTE_SECRETS_DEFAULT_DIR for a FILE secret. KeyError when
    the template declares a secret that `secrets` ((group, key) -> value) has no value for."""
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home), "PYTHONPATH": str(code), "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    }
    if image_id:  # flytekit's ImageSpec builder bakes ENV _F_IMG_ID=<ImageSpec.id> into the image
        env["_F_IMG_ID"] = image_id
    env.update({kv.key: kv.value for kv in template.container.env})
    tid = template.id
    env.update({
        "FLYTE_INTERNAL_EXECUTION_ID": execution, "FLYTE_INTERNAL_EXECUTION_PROJECT": PROJECT,
        "FLYTE_INTERNAL_EXECUTION_DOMAIN": DOMAIN, "FLYTE_INTERNAL_TASK_PROJECT": tid.project or PROJECT,
        "FLYTE_INTERNAL_TASK_DOMAIN": tid.domain or DOMAIN, "FLYTE_INTERNAL_TASK_NAME": tid.name,
        "FLYTE_INTERNAL_TASK_VERSION": tid.version or "v0", "FLYTE_INTERNAL_NODE_ID": node_id,
        "FLYTE_ATTEMPT_NUMBER": str(attempt),
    })
    env.update(plane.env)
    for s in template.security_context.secrets:
        value = secrets[(s.group, s.key)]
        # Flyte's secret webhook: the named variable if the Secret gives one, else flytekit's
        # `_FSEC_<GROUP>[_<GROUP_VERSION>]_<KEY>` (SecretsManager._get_secrets_env_var)
        parts = [p.upper() for p in (s.group, s.group_version, s.key) if p]
        if s.mount_requirement == s.FILE:  # a file under FLYTE_SECRETS_DEFAULT_DIR/<group>/<key>
            path = home.parent / "secrets" / "/".join(p.lower() for p in (s.group, s.group_version, s.key) if p)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(value)
            env["FLYTE_SECRETS_DEFAULT_DIR"] = str(home.parent / "secrets")
        else:
            env[s.env_var or "_FSEC_" + "_".join(parts)] = value
    env.update(extra)
    return env


def run_command(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str, float]:
    """Run a command to the end: (exit status, stdout+stderr, its CPU seconds (user + system, its
    own rusage from wait4, so other processes running meanwhile do not count)). Killed after `timeout` s."""
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed: list[bool] = []
    killer = threading.Timer(timeout, lambda: (killed.append(True), proc.kill()))
    killer.start()
    try:
        log = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        killer.cancel()
        proc.stdout.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if killed:
        log += f"\n[killed after {timeout} s]"
    return proc.returncode, log, usage.ru_utime + usage.ru_stime


def run_task(plane: S3Plane, template: tasks_pb2.TaskTemplate, inputs: literals_pb2.LiteralMap, *,
             workdir: Path, code: Path, execution: str, node_id: str, attempt: int = 0,
             secrets: dict[tuple[str, str], str] | None = None, extra_env: dict[str, str] | None = None,
             images: dict[str, dict[str, Any]] | None = None, timeout: float = 300) -> PodResult:
    """One task attempt as a pod: inputs.pb to S3, the template's container args with Propeller's
    variables filled, run in `workdir/<node>-<attempt>/{cwd,home}` with no network but loopback
    (`_OFFLINE`); reads outputs.pb or error.pb back. `images`: `Package.images` (for _F_IMG_ID)."""
    base = f"metadata/propeller/{PROJECT}-{DOMAIN}-{execution}/{node_id}/data"
    inputs_uri, output_prefix = plane.uri(f"{base}/inputs.pb"), plane.uri(f"{base}/{attempt}")
    raw = plane.uri(f"data/{execution}/{node_id}/{attempt}")
    plane.put(inputs_uri, inputs.SerializeToString())
    args = fill_args(list(template.container.args), {
        "input": inputs_uri, "inputPrefix": plane.uri(base), "outputPrefix": output_prefix,
        "rawOutputDataPrefix": raw, "checkpointOutputPrefix": f"{raw}/_flytecheckpoints",
        "prevCheckpointPrefix": '""',
    })
    pod = workdir / f"{node_id}-{attempt}"
    (pod / "cwd").mkdir(parents=True)
    (pod / "home").mkdir()
    (pod / "offline").mkdir()
    (pod / "offline" / "sitecustomize.py").write_text(_OFFLINE)
    image_id = (images or {}).get(template.container.image, {}).get("id")
    env = pod_env(template, plane, pod / "home", code, execution, node_id, attempt, secrets or {}, extra_env or {},
                  image_id)
    env["PYTHONPATH"] += f"{os.pathsep}{pod / 'offline'}"
    t0 = time.monotonic()
    returncode, log, cpu = run_command(args, pod / "cwd", env, timeout)
    seconds = time.monotonic() - t0
    out, err = plane.get(f"{output_prefix}/outputs.pb"), plane.get(f"{output_prefix}/error.pb")
    net = pod / "offline" / "network.log"
    return PodResult(node_id=node_id, task=template.id.name, args=args, returncode=returncode,
                     log=log, seconds=seconds, cpu_seconds=cpu, output_prefix=output_prefix,
                     network=net.read_text().splitlines() if net.is_file() else [],
                     outputs=literals_pb2.LiteralMap.FromString(out) if out is not None else None,
                     error=errors_pb2.ErrorDocument.FromString(err) if err is not None else None)


def check(result: PodResult) -> literals_pb2.LiteralMap:
    """The outputs of a successful attempt; PodFailed (with the log tail and error message) otherwise."""
    if result.returncode == 0 and result.error is None and result.outputs is not None and not result.network:
        return result.outputs
    why = (f"exit {result.returncode}" if result.returncode else
           f"tried the network: {result.network}" if result.network else
           "error.pb written" if result.error is not None else "no outputs.pb")
    msg = result.error.error.message if result.error is not None else ""
    raise PodFailed(f"task {result.task} (node {result.node_id}) failed: {why}\n--- error.pb ---\n{msg[-6000:]}"
                    f"\n--- log tail ---\n{result.log[-6000:]}", result)


_COMPARE = {0: lambda a, b: a == b, 1: lambda a, b: a != b, 2: lambda a, b: a > b,
            3: lambda a, b: a >= b, 4: lambda a, b: a < b, 5: lambda a, b: a <= b}  # ComparisonExpression.Operator


def _operand(op: Any, scope: dict[str, literals_pb2.Literal]) -> Any:
    kind = op.WhichOneof("val")
    if kind == "var":
        prim = scope[op.var].scalar.primitive
    elif kind == "primitive":
        prim = op.primitive
    else:
        prim = op.scalar.primitive
    return getattr(prim, prim.WhichOneof("value"))


def _holds(expr: Any, scope: dict[str, literals_pb2.Literal]) -> bool:
    """A branch condition (flyteidl BooleanExpression) over the branch node's inputs."""
    if expr.WhichOneof("expr") == "comparison":
        c = expr.comparison
        return _COMPARE[c.operator](_operand(c.left_value, scope), _operand(c.right_value, scope))
    left, right = _holds(expr.conjunction.left_expression, scope), _holds(expr.conjunction.right_expression, scope)
    return (left and right) if expr.conjunction.operator == 0 else (left or right)  # AND = 0, OR = 1


class _Run:
    """One execution: node ids of nested nodes are prefixed by their parents' ids (`n0-n1`), as
    Propeller names sub-node executions."""

    def __init__(self, plane: S3Plane, pkg: Package, kw: dict[str, Any]):
        self.plane, self.pkg, self.kw, self.results = plane, pkg, kw, []

    def workflow(self, wf: core_workflow_pb2.WorkflowTemplate, inputs: literals_pb2.LiteralMap,
                 prefix: str) -> literals_pb2.LiteralMap:
        outputs: dict[str, literals_pb2.LiteralMap] = {START_NODE: inputs}
        for node in node_order(wf):
            outputs[node.id] = self.node(node, outputs, prefix)
        final = literals_pb2.LiteralMap()
        for b in wf.outputs:
            final.literals[b.var].CopyFrom(_bound(b.binding, outputs))
        return final

    def node(self, node: Any, outputs: dict[str, literals_pb2.LiteralMap], prefix: str) -> literals_pb2.LiteralMap:
        node_id = f"{prefix}{node.id}"
        node_inputs = literals_pb2.LiteralMap()
        for b in node.inputs:
            node_inputs.literals[b.var].CopyFrom(_bound(b.binding, outputs))
        target = node.WhichOneof("target")
        if target == "task_node":
            result = run_task(self.plane, self.pkg.tasks[node.task_node.reference_id.name], node_inputs,
                              node_id=node_id, **self.kw)
            self.results.append(result)
            return check(result)
        if target == "workflow_node" and node.workflow_node.WhichOneof("reference") == "sub_workflow_ref":
            sub = self.pkg.workflows[node.workflow_node.sub_workflow_ref.name]
            return self.workflow(sub, node_inputs, f"{node_id}-")
        if target == "branch_node":  # Propeller decides a branch itself; no pod runs for it
            if_else = node.branch_node.if_else
            scope = dict(node_inputs.literals)
            for case in [if_else.case, *if_else.other]:
                if _holds(case.condition, scope):
                    return self.node(case.then_node, outputs, f"{node_id}-")
            if if_else.HasField("else_node"):
                return self.node(if_else.else_node, outputs, f"{node_id}-")
            raise AssertionError(f"branch {node_id}: no case holds ({if_else.error.message})")
        raise NotImplementedError(f"node {node_id}: {target} nodes are not run here")


def run_workflow(plane: S3Plane, pkg: Package, workflow: str, inputs: literals_pb2.LiteralMap,
                 **kw: Any) -> tuple[literals_pb2.LiteralMap, list[PodResult]]:
    """Run `workflow` as Propeller would: nodes in dependency order, task nodes as pods
    (`run_task`, keyword arguments `kw`), sub-workflows inline, branches decided on their inputs;
    outputs wired to inputs by the serialized bindings. Returns the workflow's outputs and each
    task attempt's result. PodFailed at the first failed task (later nodes are not started)."""
    run = _Run(plane, pkg, kw)
    return run.workflow(pkg.workflows[workflow], inputs, ""), run.results
