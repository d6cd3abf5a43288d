"""The main job run the way a Flyte cluster runs it (tests/cluster_run.py plays FlytePropeller).

The workflows are serialized with `pyflyte package`; each task of the train workflow then runs
through the container command its serialized template names (flytekit's `pyflyte-execute`), in
its own process, working directory and HOME, with only the image's code, its inputs and outputs
as Flyte literal protobufs on a loopback S3 server (moto), and the store, registry and base model
in that S3 too. Nothing passes between tasks but the literals and the blob store.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.cluster_run import (
    REPO,
    S3Plane,
    image_root,
    launch_inputs,
    package,
    read_package,
    run_command,
    run_task,
    run_workflow,
)

TRAIN_WF = "workflows.train.train"
TRAIN_TASKS = ["tasks.preflight.resolve_config", "tasks.curate.curate", "tasks.warm_start.warm_start",
               "tasks.train.rollout_and_train", "tasks.validate.validate", "tasks.evaluate.evaluate",
               "tasks.register.register"]
HMAC_KEY = "cluster-test-signing-key"


@pytest.fixture(scope="module")
def cluster(s3_server, request, tmp_path_factory):
    """The serialized package, the image's code, the S3 plane, the tiny base model in S3, and the
    refusal test's resolve_config pod, started as soon as the package exists: the pods of a
    workflow run one at a time on one core (OMP_NUM_THREADS=1), so it runs on the other one."""
    root = tmp_path_factory.mktemp("cluster")
    with ThreadPoolExecutor(max_workers=1) as background:
        packaged = background.submit(package, root / "envace.tgz")  # ~10 s of CPU, meanwhile:
        plane = S3Plane(s3_server.client, s3_server.bucket, s3_server.endpoint, key_id="testing",
                        secret="testing", region="us-east-1")
        model_uri = plane.uri("models/tiny-llama")
        plane.upload_dir(request.getfixturevalue("tiny_model_dir"), model_uri)
        pkg = read_package(packaged.result())
        code = image_root(root / "image-root", pkg.images)
        # every secret a task declares gets a value, as an operator's Flyte secret would provide it
        secrets = {(s.group, s.key): HMAC_KEY for t in pkg.tasks.values() for s in t.security_context.secrets}
        env = SimpleNamespace(pkg=pkg, code=code, plane=plane, model_uri=model_uri, secrets=secrets, root=root)
        local_root = launch_inputs(pkg.launch_plans[TRAIN_WF], profile="test",
                                   overrides=_overrides(env, registry=plane.uri("envace/registry-local-root")))
        env.refusal_dir = root / "refusal-pods"
        env.refusal = background.submit(run_task, plane, pkg.tasks["tasks.preflight.resolve_config"], local_root,
                                        workdir=env.refusal_dir, code=code, execution="clocal1", node_id="n0",
                                        secrets=secrets, images=pkg.images)
        yield env


def _overrides(cluster, **store: str) -> str:
    return json.dumps({"model": {"ref": cluster.model_uri, "compute_dtype": "float32"}, "store": store})


def _pod_files(workdir: Path) -> dict[str, list[str]]:
    """What each pod left in its working directory (its ephemeral disk outside HOME)."""
    return {d.name: sorted(str(p.relative_to(d / "cwd")) for p in (d / "cwd").rglob("*"))
            for d in sorted(workdir.iterdir())}


def test_train_workflow_runs_task_by_task_like_a_cluster(cluster, tmp_path):
    pkg, plane = cluster.pkg, cluster.plane
    # everything `pyflyte register` would send: all workflows, their tasks, the launch plans
    assert {TRAIN_WF, "workflows.evaluate.evaluate", "workflows.rehearse.rehearse",
            "workflows.adapt_tools.adapt_tools"} <= set(pkg.workflows)
    assert {TRAIN_WF, "envace_weekly_retrain"} <= set(pkg.launch_plans)
    assert set(TRAIN_TASKS) <= set(pkg.tasks)
    for name in TRAIN_TASKS:
        assert pkg.tasks[name].container.args[0] == "pyflyte-execute", name

    store, registry = plane.uri("envace/store"), plane.uri("envace/registry")
    inputs = launch_inputs(pkg.launch_plans[TRAIN_WF], profile="test",
                           overrides=_overrides(cluster, root=store, registry=registry))
    t0 = time.monotonic()
    outputs, results = run_workflow(plane, pkg, TRAIN_WF, inputs, workdir=tmp_path / "pods",
                                    code=cluster.code, execution="ctrain1", secrets=cluster.secrets,
                                    images=pkg.images)
    took = {r.task.rsplit(".", 1)[-1]: (round(r.seconds, 1), round(r.cpu_seconds, 1)) for r in results}
    print(f"cluster run: {time.monotonic() - t0:.1f} s; per task (wall s, CPU s): {took}")

    assert [r.task for r in results] == TRAIN_TASKS
    assert all(r.returncode == 0 and r.error is None and not r.network for r in results)
    # no stage wrote to its pod's disk: a relative .envace/ there would be lost with the pod
    assert not [f for files in _pod_files(tmp_path / "pods").values() for f in files if ".envace" in f]

    entry = json.loads(outputs.literals["o0"].scalar.primitive.string_value)
    name, version = entry["name"], entry["version"]
    assert plane.keys(f"{registry}/{name}/{version}/"), "nothing registered in S3"
    assert any(k.startswith("envace/store/runs/") for k in plane.keys(store)), "no checkpoint in the S3 store"
    from envace_core.store.registry import Registry

    reg = Registry(registry)  # this process reaches the moto server through the s3_server fixture's AWS_*
    assert reg.list() == [(name, version)]
    manifest = reg.show(name, version)
    assert any(k.startswith("artifacts/adapter/") for k in manifest["artifacts"])
    assert manifest["config"]["store"]["registry"] == registry
    assert manifest["base_model"]["ref"] == cluster.model_uri
    assert "ctrain1" in manifest["execution_id"]  # the Flyte execution, from the pod's context
    # the warm_start task's output reached register through rollout_and_train (no SFT here: fresh LoRA)
    assert re.fullmatch(r"[0-9a-f]{12}", manifest["warm_start"]["warm_start_id"]), manifest["warm_start"]
    assert manifest["warm_start"]["adapter_uri"] is None
    # lineage in a pod without .git: the commit the image was built from (its BUILD_INFO.json)
    built_from = json.loads((cluster.code / "envace_core" / "BUILD_INFO.json").read_text())["commit"]
    assert (manifest["code"]["commit"], manifest["code"]["commit_source"]) == (built_from, "BUILD_INFO.json")
    assert subprocess.run(["git", "cat-file", "-e", f"{built_from}^{{commit}}"], cwd=REPO).returncode == 0
    register_image = pkg.tasks["tasks.register.register"].container.image
    assert manifest["code"]["image_spec_id"] == pkg.images[register_image]["id"]
    assert manifest.get("signature"), "register got no HMAC key from its Flyte secret"

    # `envace registry verify` from yet another process, HOME and directory, against the S3 registry
    (tmp_path / "verify" / "home").mkdir(parents=True)
    env = {**cluster.plane.env, "HOME": str(tmp_path / "verify" / "home"), "PYTHONPATH": str(cluster.code),
           "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "ENVACE_REGISTRY_HMAC_KEY": HMAC_KEY}
    t0 = time.monotonic()
    code, log, cpu = run_command([str(Path(sys.executable).parent / "envace"), "registry", "verify",
                                  f"{name}@{version}", "--profile", "test", "--overrides",
                                  json.dumps({"store": {"registry": registry}})], tmp_path / "verify", env, 120)
    print(f"envace registry verify: {time.monotonic() - t0:.1f} s, {cpu:.1f} s CPU")
    assert code == 0 and f"OK {name}@{version}: every artifact matches" in log, log


def test_resolve_config_in_a_pod_refuses_a_local_store_root(cluster):
    """store.root left at its default (.envace/store, the pod's own disk) fails the first task in
    seconds with one message naming store.root; nothing is written there."""
    result = cluster.refusal.result(timeout=300)  # started by the fixture (store.registry and model.ref in S3)
    print(f"resolve_config refused in {result.seconds:.1f} s ({result.cpu_seconds:.1f} s CPU)")
    assert not result.network, result.network
    assert result.returncode == 0  # pyflyte-execute exits 0 after a user error; Propeller reads error.pb
    assert result.outputs is None and result.error is not None, result.log[-3000:]
    doc = result.error.error
    assert doc.kind == doc.NON_RECOVERABLE  # a retry cannot fix a setting
    assert doc.message.count("Traceback (most recent call last)") == 1, doc.message  # one error, no chain
    summary = doc.message.rsplit("Message:", 1)[-1].strip()  # flytekit: "Trace: ... Message: <Type>: <msg>"
    assert summary.startswith("ConfigError:") and "store.root='.envace/store'" in summary, doc.message
    # the legal settings are not blamed: the message is about store.root alone
    assert not [s for s in ("store.registry", "model.ref", "data.dvc_remote") if s in summary], summary
    assert "store.root" in result.log  # the pod's log (what `kubectl logs` shows) says it too
    assert result.seconds < 60  # imports and one S3 listing; no model is loaded
    assert _pod_files(cluster.refusal_dir) == {"n0-0": []}  # nothing written to the pod's disk
