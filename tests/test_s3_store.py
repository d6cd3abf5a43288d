"""S3Store against a real S3-compatible server (moto) on loopback: see the `s3_server` fixture."""

import json
import os
import uuid
from pathlib import Path

import pytest
from botocore.exceptions import ConnectionClosedError

from envace_core.store.base import StoreError
from envace_core.store.files import dir_checksums, sha256_bytes
from envace_core.store.local import LocalStore
from envace_core.store.s3 import S3Store
from envace_core.store.uri import open_store

MiB = 1 << 20


@pytest.fixture
def store(s3_server, tmp_path):
    """A fresh prefix of the test bucket; files of 5 MiB or more go multipart in 5 MiB parts."""
    return _store(s3_server, tmp_path, f"t-{uuid.uuid4().hex[:8]}")


def _store(s3_server, tmp_path, prefix, cache="cache"):
    return S3Store(f"{s3_server.root}/{prefix}", cache_dir=tmp_path / cache,
                   multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)


def _src(tmp_path, name="src", **files):
    d = tmp_path / name
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data if isinstance(data, bytes) else data.encode())
    return d


def _obj(store, key):
    return f"{store.prefix}/{key}"


def _fail_uploads_after_first_object(store):
    """Make the server 'drop the connection' for every upload except the first object's."""
    seen = {"first": None, "failed_attempts": 0}

    def hook(request, **kw):
        obj = request.url.split("?")[0]
        if seen["first"] in (None, obj):
            seen["first"] = obj
            return
        seen["failed_attempts"] += 1
        raise ConnectionClosedError(endpoint_url=request.url)

    for op in ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload"):
        store.client.meta.events.register(f"before-send.s3.{op}", hook)
    return seen


def test_open_store_and_single_objects_round_trip(s3_server, store, monkeypatch, tmp_path):
    monkeypatch.setenv("ENVACE_CACHE", str(tmp_path / "envcache"))
    opened = open_store(f"{s3_server.root}/x/")
    assert isinstance(opened, S3Store) and opened.root == f"{s3_server.root}/x"
    assert opened.cache_dir == tmp_path / "envcache" / "s3-store" / s3_server.bucket / "x"
    assert opened.uri("a//b") == f"{s3_server.root}/x/a/b"
    opened.check()

    assert store.write_bytes("blob/a.bin", b"\x00abc") == sha256_bytes(b"\x00abc")
    assert store.read_bytes("blob/a.bin") == b"\x00abc"
    store.write_json("meta/m.json", {"b": 1, "a": [1, 2]})
    assert store.read_json("meta/m.json") == {"a": [1, 2], "b": 1}
    assert store.exists("meta/m.json") and not store.exists("meta/nope.json")
    store.write_bytes("bad.json", b"{not json")
    with pytest.raises(StoreError, match="corrupt"):
        store.read_json("bad.json")
    with pytest.raises(StoreError, match="not found"):
        store.read_bytes("missing")
    with pytest.raises(StoreError, match="invalid artifact key"):
        store.read_bytes("../escape")
    with pytest.raises(StoreError, match="get_dir"):
        store.path("blob")


def test_put_dir_multipart_get_dir_and_resume(s3_server, store, tmp_path):
    big = os.urandom(9 * MiB + 17)
    src = _src(tmp_path, big=big, **{"state.json": json.dumps({"history": [1, 2]}),
                                      "adapter/adapter_config.json": "{}", "adapter/copy.json": "{}"})
    sums = store.put_dir(src, "runs/r1/checkpoint")
    assert set(sums) == {"big", "state.json", "adapter/adapter_config.json", "adapter/copy.json"}

    # the 9 MiB file went up in two 5 MiB-threshold parts; identical files are stored once
    big_obj = {"Bucket": s3_server.bucket, "Key": _obj(store, f"runs/r1/checkpoint/objects/{sums['big']}")}
    assert s3_server.client.head_object(**big_obj, PartNumber=1)["PartsCount"] == 2
    assert s3_server.client.head_object(**big_obj)["ETag"].strip('"').endswith("-2")
    listed = s3_server.client.list_objects_v2(Bucket=s3_server.bucket, Prefix=_obj(store, "runs/"))
    assert len(listed["Contents"]) == 3 + 1  # 3 distinct contents + the commit object

    # resume as stages.train does, from a fresh process-like store with an empty cache
    fresh = _store(s3_server, tmp_path, store.prefix, cache="cache2")
    assert fresh.exists("runs/r1/checkpoint") and fresh.exists("runs/r1/checkpoint/state.json")
    assert not fresh.exists("runs/r1/checkpoint/nope.json")
    assert fresh.read_json("runs/r1/checkpoint/state.json") == {"history": [1, 2]}
    local = fresh.get_dir("runs/r1/checkpoint")
    assert local.is_relative_to(tmp_path / "cache2")
    assert (local / "big").read_bytes() == big and (local / "adapter" / "copy.json").read_text() == "{}"
    assert json.loads((local / "CHECKSUMS.json").read_text()) == sums
    assert fresh.verify_dir("runs/r1/checkpoint") == []
    fresh.client.download_file = None  # a second get_dir is served from the verified cache
    assert fresh.get_dir("runs/r1/checkpoint") == local
    assert fresh.list_dirs("runs") == ["runs/r1/checkpoint"]


def test_tampered_objects_are_reported_by_name(s3_server, store, tmp_path):
    sums = store.put_dir(_src(tmp_path, **{"a.bin": b"weights", "b.bin": b"other"}), "ckpt")
    s3_server.client.put_object(Bucket=s3_server.bucket, Key=_obj(store, f"ckpt/objects/{sums['a.bin']}"),
                                Body=b"evil")
    with pytest.raises(StoreError, match=r"'a\.bin'.*corrupt"):
        store.get_dir("ckpt")
    assert store.verify_dir("ckpt") == ["a.bin"]
    with pytest.raises(StoreError, match="corrupt"):
        store.read_bytes("ckpt/a.bin")
    assert not list((tmp_path / "cache").rglob("a.bin"))  # nothing half-verified left in the cache
    s3_server.client.put_object(Bucket=s3_server.bucket, Key=_obj(store, f"ckpt/objects/{sums['a.bin']}"),
                                Body=b"weights")
    s3_server.client.delete_object(Bucket=s3_server.bucket, Key=_obj(store, f"ckpt/objects/{sums['b.bin']}"))
    with pytest.raises(StoreError, match="missing from S3"):
        store.get_dir("ckpt")
    assert store.verify_dir("ckpt") == ["b.bin"]

    store.write_bytes("single", b"good")
    s3_server.client.put_object(Bucket=s3_server.bucket, Key=_obj(store, "single"), Body=b"bad!",
                                Metadata={"sha256": sha256_bytes(b"good")})
    with pytest.raises(StoreError, match="corrupt"):
        store.read_bytes("single")


def test_server_failing_mid_upload_commits_nothing(s3_server, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    good = _store(s3_server, tmp_path, prefix)
    v1 = _src(tmp_path, "v1", **{"a.bin": b"v1-a", "b.bin": b"v1-b", "state.json": '{"it": 1}'})
    good.put_dir(v1, "models/m/1")
    good.put_dir(v1, "runs/r/checkpoint")

    flaky = _store(s3_server, tmp_path, prefix, cache="cache-flaky")
    seen = _fail_uploads_after_first_object(flaky)
    v2 = _src(tmp_path, "v2", **{"a.bin": b"v2-a", "b.bin": b"v2-b", "state.json": '{"it": 2}'})
    with pytest.raises(StoreError, match="cannot reach S3") as err:
        flaky.put_dir(v2, "runs/r/checkpoint")
    assert err.value.__cause__ is None and "'b.bin'" in str(err.value)
    assert seen["failed_attempts"] == 2  # bounded retries (AWS_MAX_ATTEMPTS), then give up
    # the old complete version is still what readers get, intact
    assert good.read_json("runs/r/checkpoint/state.json") == {"it": 1}
    assert (good.get_dir("runs/r/checkpoint") / "b.bin").read_bytes() == b"v1-b"
    assert good.verify_dir("runs/r/checkpoint") == []

    # a brand-new key whose upload failed does not exist at all
    with pytest.raises(StoreError):
        flaky.put_dir(v2, "models/m/2")
    assert not good.exists("models/m/2") and not good.exists("models/m/2/state.json")
    with pytest.raises(StoreError, match="not found.*did not finish"):
        good.get_dir("models/m/2")
    assert good.list_dirs("models") == ["models/m/1"]  # registry listing skips the failed version
    assert good.list_dirs() == ["models/m/1", "runs/r/checkpoint"]

    # a later successful re-upload replaces the commit and drops the unreferenced objects
    sums = good.put_dir(v2, "runs/r/checkpoint")
    assert good.read_json("runs/r/checkpoint/state.json") == {"it": 2}
    objs = s3_server.client.list_objects_v2(Bucket=s3_server.bucket, Prefix=_obj(good, "runs/r/checkpoint/objects/"))
    assert {o["Key"].rsplit("/", 1)[1] for o in objs["Contents"]} == set(sums.values())
    with pytest.raises(StoreError, match="already exists"):
        good.put_dir(v2, "runs/r/checkpoint", overwrite=False)


def test_missing_credentials_bucket_and_endpoint_give_clear_errors(s3_server, store, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sekrit-value-42")
    nobucket = S3Store("s3://envace-no-such-bucket/p", cache_dir=tmp_path)
    for call in (lambda: nobucket.exists("k"), lambda: nobucket.write_bytes("k", b"x"), nobucket.check,
                 lambda: nobucket.get_dir("k")):
        with pytest.raises(StoreError, match="'envace-no-such-bucket' does not exist") as err:
            call()
        assert "sekrit" not in str(err.value) and err.value.__cause__ is None

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    nocreds = S3Store(store.root, cache_dir=tmp_path)
    with pytest.raises(StoreError, match="no AWS credentials.*AWS_ACCESS_KEY_ID.*AWS_PROFILE"):
        nocreds.write_bytes("k", b"x")
    with pytest.raises(StoreError, match="no AWS credentials"):
        nocreds.put_dir(_src(tmp_path, f="x"), "d")

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    import socket

    with socket.socket() as s:  # a loopback port with nobody listening
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed}")
    with pytest.raises(StoreError, match="cannot reach S3.*AWS_ENDPOINT_URL"):
        S3Store(store.root, cache_dir=tmp_path).read_bytes("k")


def test_local_store_has_the_same_directory_api(tmp_path):
    local = open_store(str(tmp_path / "store"))
    assert isinstance(local, LocalStore)
    local.put_dir(_src(tmp_path, a="1"), "models/m/1")
    local.put_dir(_src(tmp_path, "s2", a="2"), "models/m/2")
    assert local.get_dir("models/m/1") == local.path("models/m/1")
    assert local.list_dirs("models") == ["models/m/1", "models/m/2"] == local.list_dirs()
    with pytest.raises(StoreError, match="not found"):
        local.get_dir("models/m/3")
    local.check()


# ----------------------------------------------------------------------- the registry on S3 --

def _registry(s3_server):
    from envace_core.store.registry import Registry

    return Registry(f"{s3_server.root}/reg-{uuid.uuid4().hex[:8]}")


def _commit(s3_server, reg, name, version):
    key = f"{reg._s3.prefix}/{name}/{version}/CHECKSUMS.json"
    return json.loads(s3_server.client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read())


def _overwrite(s3_server, reg, name, version, rel, body):
    """What an attacker with bucket write access does: replace a committed file's object in place."""
    sha = _commit(s3_server, reg, name, version)[rel]
    s3_server.client.put_object(Bucket=s3_server.bucket, Key=f"{reg._s3.prefix}/{name}/{version}/objects/{sha}",
                                Body=body)


def test_s3_registry_register_list_show_verify_and_refuse_duplicate(s3_server, tmp_path):
    from envace_core.store.registry import RegistryError

    reg = _registry(s3_server)
    art = _src(tmp_path, "art", **{"adapter/adapter_model.safetensors": b"weights", "config.json": "{}"})
    uri = reg.register("m", "1", art, {"dataset": {"dvc": {"md5": "abc.dir"}}, "metrics": {"pass^1": 0.5}})
    assert uri == f"{reg.root}/m/1" == reg.uri("m", "1")
    reg.register("m", "2", art, {})
    reg.register("other", "1", art, {})
    assert reg.list() == [("m", "1"), ("m", "2"), ("other", "1")]
    man = reg.show("m", "1")
    assert man["name"] == "m" and man["dataset"]["dvc"]["md5"] == "abc.dir"
    assert set(man["artifacts"]) == {"artifacts/adapter/adapter_model.safetensors", "artifacts/config.json"}
    assert man["artifacts"]["artifacts/config.json"] == sha256_bytes(b"{}")
    assert reg.verify("m", "1") == []
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("m", "1", art, {})
    with pytest.raises(RegistryError, match="not registered"):
        reg.show("m", "9")
    with pytest.raises(RegistryError, match="invalid model name"):
        reg.register("../x", "1", art, {})
    with pytest.raises(RegistryError, match="no local directory"):
        reg.version_dir("m", "1")


def test_s3_registry_verify_reports_tampered_objects_and_rewritten_commits(s3_server, tmp_path):
    from envace_core.store.registry import RegistryError
    from envace_core.store.s3 import S3Store

    reg = _registry(s3_server)
    art = _src(tmp_path, "art", **{"adapter.safetensors": b"weights", "config.json": "{}"})
    reg.register("m", "1", art, {})
    _overwrite(s3_server, reg, "m", "1", "artifacts/adapter.safetensors", b"evil")
    assert reg.verify("m", "1") == ["artifacts/adapter.safetensors"]

    # an attacker re-commits the version with a new artifact but the old manifest: still caught
    reg.register("m", "2", art, {})
    forged = reg._s3.get_dir("m/2")
    (forged / "artifacts" / "config.json").write_text('{"lr": 1}')
    S3Store(reg.root, cache_dir=tmp_path / "attacker").put_dir(forged, "m/2")
    assert reg.verify("m", "2") == ["artifacts/config.json"]

    # a replaced manifest object: show refuses it, verify names it (and any other bad file)
    reg.register("m", "3", art, {})
    _overwrite(s3_server, reg, "m", "3", "manifest.json", b'{"artifacts": {}}')
    with pytest.raises(RegistryError, match="corrupt.*cannot be trusted"):
        reg.show("m", "3")
    _overwrite(s3_server, reg, "m", "3", "artifacts/config.json", b"{}!")
    assert reg.verify("m", "3") == ["artifacts/config.json", "manifest.json"]


def test_s3_registry_signed_manifest_detects_an_edited_metric(s3_server, tmp_path, monkeypatch):
    from envace_core.store.registry import BAD_SIGNATURE
    from envace_core.store.s3 import S3Store

    monkeypatch.setenv("ENVACE_REGISTRY_HMAC_KEY", "k3y")
    reg = _registry(s3_server)
    reg.register("m", "1", _src(tmp_path, "art", w="w"), {"metrics": {"pass^1": 0.1}})
    assert reg.show("m", "1")["signature"]["alg"] == "HMAC-SHA256" and reg.verify("m", "1") == []
    local = reg._s3.get_dir("m/1")
    man = json.loads((local / "manifest.json").read_text())
    man["metrics"]["pass^1"] = 0.9
    (local / "manifest.json").write_text(json.dumps(man))
    S3Store(reg.root, cache_dir=tmp_path / "attacker").put_dir(local, "m/1")  # a consistent re-commit
    assert reg.show("m", "1")["metrics"]["pass^1"] == 0.9
    assert reg.verify("m", "1") == [BAD_SIGNATURE]


def test_s3_registry_listing_skips_a_version_whose_upload_failed(s3_server, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    reg = _registry(s3_server)
    art = _src(tmp_path, "art", **{"a.bin": b"a", "b.bin": b"b"})
    reg.register("m", "1", art, {})
    seen = _fail_uploads_after_first_object(reg._s3)
    with pytest.raises(StoreError, match="cannot reach S3"):
        reg.register("m", "2", art, {})
    assert seen["failed_attempts"] == 2
    assert reg.list() == [("m", "1")]  # nothing half-registered is listed
    from envace_core.store.registry import Registry

    again = Registry(reg.root)  # a fresh client, without the failing hook
    again.register("m", "2", art, {})  # the failed attempt did not block the version
    assert again.list() == [("m", "1"), ("m", "2")] and again.verify("m", "2") == []


def test_s3_registry_refuses_a_concurrent_duplicate(s3_server, tmp_path, monkeypatch):
    from envace_core.store.registry import Registry, RegistryError

    reg = _registry(s3_server)
    art = _src(tmp_path, "art", w="w")
    reg.register("m", "1", art, {})
    late = Registry(reg.root)
    monkeypatch.setattr(late, "_exists", lambda name, version: False)  # it checked before the other wrote
    with pytest.raises(RegistryError, match="registered concurrently"):
        late.register("m", "1", art, {"metrics": {"other": 1}})
    assert "other" not in reg.show("m", "1").get("metrics", {})


def test_cli_registry_list_show_verify_on_s3(s3_server, tmp_path, capsys):
    from envace_core.cli import main

    reg = _registry(s3_server)
    reg.register("m", "1", _src(tmp_path, "art", **{"adapter.safetensors": b"weights"}), {"execution_id": "x"})
    over = f"store.registry={reg.root}"
    assert main(["--overrides", over, "registry", "list"]) == 0
    assert capsys.readouterr().out.split() == ["m@1"]
    assert main(["--overrides", over, "registry", "show", "m@1"]) == 0
    assert json.loads(capsys.readouterr().out)["execution_id"] == "x"
    assert main(["--overrides", over, "registry", "verify", "m@1"]) == 0
    assert capsys.readouterr().out.startswith("OK m@1")
    _overwrite(s3_server, reg, "m", "1", "artifacts/adapter.safetensors", b"evil")
    assert main(["--overrides", over, "registry", "verify", "m@1"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("TAMPERED m@1") and "artifacts/adapter.safetensors" in out
    assert main(["--overrides", over, "registry", "show", "m@2"]) == 2
    assert "not registered" in capsys.readouterr().err


def test_the_commit_object_is_the_atomic_pointer_and_recover_dir_cleans_what_a_kill_left(s3_server, tmp_path,
                                                                                      monkeypatch):
    """An upload stopped at any point (a BaseException, as a kill: no clean-up runs) leaves the
    previous commit in force; `recover_dir` deletes the objects no commit names and says so."""
    store = _store(s3_server, tmp_path, f"t-{uuid.uuid4().hex[:8]}")
    key = "runs/r/checkpoint"
    v1 = _src(tmp_path, "v1", **{"a.bin": b"v1-a", "b.bin": b"v1-b", "state.json": '{"it": 1}'})
    v2 = _src(tmp_path, "v2", **{"a.bin": b"v2-a", "b.bin": b"v2-b", "state.json": '{"it": 2}'})
    assert store.recover_dir(key) == []  # nothing there yet

    def objects():
        r = s3_server.client.list_objects_v2(Bucket=s3_server.bucket, Prefix=_obj(store, f"{key}/objects/"))
        return {o["Key"].rsplit("/", 1)[1] for o in r.get("Contents", [])}

    class Killed(BaseException):
        pass

    real_upload = store.client.upload_file
    for n in range(3):  # killed after n of the first upload's 3 objects: nothing is committed
        calls = []

        def upload(*a, calls=calls, n=n, **k):
            if len(calls) == n:
                raise Killed
            calls.append(a)
            return real_upload(*a, **k)

        monkeypatch.setattr(store.client, "upload_file", upload)
        with pytest.raises(Killed):
            store.put_dir(v1, key)
        assert not store.exists(f"{key}/state.json") and len(objects()) == n
        notes = store.recover_dir(key)
        assert objects() == set() and (notes == [] if n == 0 else
                                       len(notes) == 1 and f"removed {n} object(s)" in notes[0]
                                       and "never committed" in notes[0])
    monkeypatch.setattr(store.client, "upload_file", real_upload)
    sums1 = store.put_dir(v1, key)

    # killed after the new commit object, before the old objects' garbage collection
    monkeypatch.setattr(S3Store, "_collect_garbage", lambda self, k, keep: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        store.put_dir(v2, key)
    assert store.read_json(f"{key}/state.json") == {"it": 2}  # the pointer moved in one PUT
    sums2 = set(dir_checksums(v2).values())
    assert objects() == set(sums1.values()) | sums2
    monkeypatch.undo()
    notes = store.recover_dir(key)
    assert len(notes) == 1 and "removed 3 object(s)" in notes[0] and "not named by its commit" in notes[0]
    assert objects() == sums2 and store.verify_dir(key) == []
    assert (store.get_dir(key) / "b.bin").read_bytes() == b"v2-b" and store.recover_dir(key) == []


def test_transient_s3_failures_are_transient_errors_and_permanent_ones_are_not(s3_server, store, tmp_path,
                                                                                 monkeypatch):
    from botocore.awsrequest import AWSResponse

    from envace_core import TransientError
    from envace_core.store.s3 import TransientStoreError

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    store.write_bytes("k", b"x")
    busy = S3Store(store.root, cache_dir=tmp_path)
    calls = []

    class Raw:  # an HTTP body for botocore's response parser
        def stream(self, **kw):
            yield b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"

    def slow_down(request, **kw):
        calls.append(request.url)
        return AWSResponse(request.url, 503, {}, Raw())

    busy.client.meta.events.register("before-send.s3.GetObject", slow_down)
    with pytest.raises(TransientStoreError, match=r"SlowDown \(HTTP 503\).*s3://.*/k.*may pass on retry") as err:
        busy.read_bytes("k")
    assert isinstance(err.value, TransientError) and isinstance(err.value, StoreError) and len(calls) == 2
    with pytest.raises(StoreError) as gone:
        S3Store("s3://envace-no-such-bucket/p", cache_dir=tmp_path).check()
    assert not isinstance(gone.value, TransientError)
    import socket

    with socket.socket() as s:  # a loopback port with nobody listening
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed}")
    with pytest.raises(TransientError, match="cannot reach S3"):
        S3Store(store.root, cache_dir=tmp_path).read_bytes("k")


def test_a_registry_model_in_an_s3_registry_is_downloaded_verified_and_cached(s3_server, tmp_path, monkeypatch):
    from envace_core.models import ModelRefError, resolve_model_ref

    monkeypatch.setenv("ENVACE_CACHE", str(tmp_path / "cache"))
    reg = _registry(s3_server)
    art = _src(tmp_path, "art", **{"adapter/adapter_config.json": '{"peft_type": "LORA", "r": 2}',
                                   "adapter/adapter_model.safetensors": b"lora", "config.json": "{}"})
    reg.register("m", "1", art, {"base_model": {"ref": "bundled:smollm2-135m-instruct", "sha256": "b"}})
    m = resolve_model_ref("registry:m@1", reg.root)
    adapter = Path(m.adapter_dir)
    assert adapter.is_relative_to(tmp_path / "cache") and (adapter / "adapter_model.safetensors").read_bytes() == b"lora"
    assert m.base_ref == "bundled:smollm2-135m-instruct" and m.manifest["name"] == "m"
    assert resolve_model_ref("registry:m@1", reg.root).adapter_dir == m.adapter_dir  # the cached copy
    with pytest.raises(ModelRefError, match="not registered"):
        resolve_model_ref("registry:m@2", reg.root)

    reg.register("m", "3", art, {"base_model": {"ref": "bundled:smollm2-135m-instruct"}})
    _overwrite(s3_server, reg, "m", "3", "artifacts/adapter/adapter_model.safetensors", b"evil")
    with pytest.raises(ModelRefError, match="fails verification.*adapter_model.safetensors.*corrupt"):
        resolve_model_ref("registry:m@3", reg.root)
