"""`envace eval` with a bad user simulator: an endpoint that does not answer (probed before any model loads,
or failing mid-run) is a run error, not a task failure, and is never cached; a bad --user-model is named
as such before any model loads. Only loopback sockets are used."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from envace_core.cli import main
from envace_core.evaluation import harness
from envace_core.evaluation.options import BenchSpec, EvalOptions
from envace_core.roles.user import EndpointError, OpenAIChatClient


def _closed_port() -> int:
    """A loopback port nothing listens on (bound to get a free one, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """A loopback OpenAI-compatible server whose answers the test sets: `models` / `chat` are the HTTP
    status of GET /v1/models and POST /v1/chat/completions (200: a valid answer, or `body` when given);
    `models_raw`: the bytes a 200 GET answers with instead of a models list (e.g. a plain file's text)."""

    def __init__(self, models: int = 200, chat: int = 200, reply: str = "###STOP###", body: dict | None = None,
                 models_raw: bytes | None = None):
        self.models, self.chat, self.reply, self.body, self.calls = models, chat, reply, body, []
        self.models_raw = models_raw
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                outer.calls.append(("GET", self.path))
                if outer.models_raw is not None:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(outer.models_raw)))
                    self.end_headers()
                    self.wfile.write(outer.models_raw)
                    return
                self._send(outer.models, {"object": "list", "data": [{"id": "default"}]} if outer.models == 200
                           else {"error": "no such route"})

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.calls.append(("POST", self.path))
                ok = {"choices": [{"message": {"role": "assistant", "content": outer.reply}}]}
                self._send(outer.chat, outer.body or ok if outer.chat == 200 else {"error": "engine crashed"})

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/v1"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def over(tmp_path):
    return json.dumps({"model": {"compute_dtype": "float32"},
                       "store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "registry")}})


def _records(out: Path) -> list[dict]:
    return [json.loads(x) for f in sorted((out / "cache").rglob("tau2_*.jsonl")) for x in f.read_text().splitlines()]


# ------------------------------------------------------------------------------ --user-url preflight
def test_unreachable_user_url_stops_in_one_line_before_any_model_loads(eval_loads_no_model, over, tmp_path, capsys):
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    out = tmp_path / "eval"
    rc = main(["--profile", "test", "--overrides", over, "eval", "--model", "bundled:smollm2-135m-instruct",
               "--bench", "tau2:airline", "--limit", "1", "--user-url", url, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and err.startswith(f"envace: error: --user-url {url}: GET {url}/models failed")
    assert "Connection refused" in err or "ConnectionRefusedError" in err
    assert _records(out) == [] and not (out / "results.json").exists()


def test_only_the_endpoints_a_run_calls_are_probed(tmp_path):
    dead = f"http://127.0.0.1:{_closed_port()}/v1"
    tau2, vita = [BenchSpec("tau2", "airline")], [BenchSpec("vita", str(tmp_path))]

    def opts(**kw):
        return EvalOptions(model="m", benches="", out=str(tmp_path), **kw)

    # opening_request has no user simulator; bfcl has neither a user nor a judge
    assert harness._endpoints(opts(user_url=dead, protocol="opening_request"), tau2) == {}
    assert harness._endpoints(opts(user_url=dead, judge_url=dead), [BenchSpec("bfcl", "simple_python")]) == {}
    with pytest.raises(EndpointError, match=f"^--user-url {dead}: GET {dead}/models failed"):
        harness._endpoints(opts(user_url=dead), tau2)
    with pytest.raises(EndpointError, match=f"^--user-url {dead}:"):  # the user simulator judges VitaBench
        harness._endpoints(opts(user_url=dead, protocol="opening_request"), vita)
    with pytest.raises(EndpointError, match=f"^--judge-url {dead}: GET {dead}/models failed"):
        harness._endpoints(opts(judge_url=dead), vita)
    with _Server() as srv:
        clients = harness._endpoints(opts(user_url=srv.url, judge_url=srv.url), tau2 + vita)
    assert sorted(clients) == ["--judge-url", "--user-url"] and srv.calls == [("GET", "/v1/models")] * 2


def test_probe_falls_back_to_one_chat_token_and_names_timeouts_and_http_errors():
    with _Server(models=404) as srv:  # a server without /models: one chat request decides
        OpenAIChatClient(srv.url, "default", name="--user-url").probe()
    assert srv.calls == [("GET", "/v1/models"), ("POST", "/v1/chat/completions")]
    with _Server(models=404, chat=404) as srv, pytest.raises(EndpointError) as e:  # wrong base URL
        OpenAIChatClient(srv.url, "default", name="--user-url").probe()
    assert str(e.value).startswith(f"--user-url {srv.url}: POST {srv.url}/chat/completions failed (HTTP 404")
    with socket.socket() as s:  # accepts connections (backlog) but never answers
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
        with pytest.raises(EndpointError, match=r"GET .*/models failed \(timed out after 0.3s\)"):
            OpenAIChatClient(url, "default", name="--judge-url", probe_timeout=0.3).probe()


def test_chat_answers_that_are_not_chat_completions_are_endpoint_errors():
    with _Server(chat=500) as srv, pytest.raises(EndpointError, match=r"\(HTTP 500 .*engine crashed"):
        OpenAIChatClient(srv.url, "default", name="--user-url").chat([{"role": "user", "content": "hi"}], 4, 0.0, 0)
    with _Server(body={"text": "hello"}) as srv, pytest.raises(EndpointError) as e:
        OpenAIChatClient(srv.url, "default").chat([{"role": "user", "content": "hi"}], 4, 0.0, 0)
    assert "not an OpenAI chat completion (KeyError: 'choices')" in str(e.value) and '"text": "hello"' in str(e.value)


@pytest.mark.parametrize("raw", [b"just a text file\n", b'{"object": "list"}', b"[1, 2]", b'{"data": {}}'])
def test_a_2xx_models_answer_that_is_not_a_models_list_falls_back_to_the_chat_probe(raw):
    with _Server(models_raw=raw, chat=404) as srv, pytest.raises(EndpointError) as e:  # e.g. python -m http.server
        OpenAIChatClient(srv.url, "default", name="--user-url").probe()
    assert str(e.value).startswith(f"--user-url {srv.url}: POST {srv.url}/chat/completions failed (HTTP 404")
    with _Server(models_raw=raw) as srv:  # the chat route answers with text: the endpoint passes
        OpenAIChatClient(srv.url, "default", name="--user-url").probe()
    assert srv.calls == [("GET", "/v1/models"), ("POST", "/v1/chat/completions")]


NO_TEXT = [None, "", "  \n", 5, ["###STOP###"]]


@pytest.mark.parametrize("content", NO_TEXT)
def test_a_reply_with_no_message_text_is_an_endpoint_error_for_user_judge_and_probe(content):
    from envace_core.evaluation.vita import LLMJudge

    body = {"choices": [{"message": {"role": "assistant", "content": content}}]}
    with _Server(body=body) as srv:
        client = OpenAIChatClient(srv.url, "default", name="--user-url")
        with pytest.raises(EndpointError, match=f"^--user-url {srv.url}: POST {srv.url}/chat/completions failed "
                                                r"\(the reply has no message text"):
            client.chat([{"role": "user", "content": "hi"}], 4, 0.0, 0)
        judge = LLMJudge(client=OpenAIChatClient(srv.url, "default", name="--judge-url"))
        with pytest.raises(EndpointError, match="^--judge-url .*the reply has no message text"):
            judge([{"role": "user", "content": "hi"}], ["was polite"], [False])
        srv.models = 404  # no /models: the one-token chat probe must return text
        with pytest.raises(EndpointError, match="the reply has no message text"):
            client.probe()


@pytest.mark.parametrize("content", [None, ""])
def test_a_user_endpoint_replying_without_text_stops_the_run_and_caches_nothing(content, tiny_model_dir, over,
                                                                                 tmp_path, capsys):
    out = tmp_path / "eval"
    with _Server(body={"choices": [{"message": {"content": content}}]}) as srv:
        argv = ["--profile", "test", "--overrides", over, "eval", "--model", str(tiny_model_dir), "--bench",
                "tau2:airline", "--limit", "1", "--max-steps", "2", "--user-url", srv.url, "--out", str(out)]
        rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2, err
    assert err.startswith(f"envace: error: --user-url {srv.url}: POST {srv.url}/chat/completions failed (the reply "
                          "has no message text") and "not recorded" in err
    assert _records(out) == [] and not (out / "results.json").exists()


# ------------------------------------------------------------------------ --user-url failing mid-run
def test_user_endpoint_failing_mid_run_stops_the_run_caches_nothing_and_a_rerun_plays_the_task(
        tiny_model_dir, over, tmp_path, capsys):
    out = tmp_path / "eval"
    with _Server(chat=500) as srv:  # /models answers (the probe passes); every chat request fails
        argv = ["--profile", "test", "--overrides", over, "eval", "--model", str(tiny_model_dir), "--bench",
                "tau2:airline", "--limit", "1", "--max-steps", "4", "--user-url", srv.url, "--out", str(out)]
        rc = main(argv)
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert rc == 2
        assert err.startswith(f"envace: error: --user-url {srv.url}: POST {srv.url}/chat/completions failed "
                              "(HTTP 500") and "[during airline/2 trial 0; not recorded" in err
        assert _records(out) == [] and not (out / "results.json").exists()

        srv.chat = 200  # the endpoint works now: the same command plays the task afresh
        assert main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    [rec] = res["benches"][0]["results"]
    assert rec["error"] is None and rec["user_stats"]["calls"] >= 1 and rec["termination_reason"] != "error"
    assert res["work"]["tau2:airline"] == {"ran": 1, "cached": 0}
    assert [r["task_id"] for r in _records(out)] == ["airline/2"]


# ------------------------------------------------------------------------------------- the cache
def test_errored_trials_are_recorded_but_never_cached_nor_reused(tmp_path):
    from envace_core.envs.tau2.tasks import load_tasks
    from envace_core.evaluation.tau2 import _load_cache, run_tau2

    [task] = load_tasks("airline", "test", 1)
    cache = tmp_path / "tau2_airline.jsonl"

    def broken(domain, seed):
        raise RuntimeError("agent bug")

    rep = run_tau2([task], broken, "opening_request", cache_path=cache)
    [rec] = rep["results"]
    assert rec["termination_reason"] == "error" and "agent bug" in rec["error"] and not cache.exists()

    cache.write_text(json.dumps(rec) + "\n")  # an errored line an older version wrote
    assert _load_cache(cache) == {}

    def endpoint_down(domain, seed):
        raise EndpointError("--user-url http://127.0.0.1:1/v1: POST ... failed (ConnectionRefusedError)")

    with pytest.raises(EndpointError, match=rf"\[during {task.id} trial 0; not recorded"):
        run_tau2([task], endpoint_down, "opening_request", cache_path=cache)
    assert cache.read_text().splitlines() == [json.dumps(rec)]  # nothing appended


# -------------------------------------------------------------------------------- --user-model
@pytest.mark.parametrize("ref, needle", [
    ("/nope", "envace: error: --user-model '/nope': no such file or folder"),
    ("bundled:nope", "envace: error: --user-model: unknown bundled model 'bundled:nope'"),
    ("registry:nope", "envace: error: --user-model 'registry:nope': write registry:NAME@VERSION"),
])
def test_bad_user_model_is_named_as_such_before_any_model_loads(eval_loads_no_model, over, tmp_path, capsys, ref, needle):
    rc = main(["--profile", "test", "--overrides", over, "eval", "--model", "bundled:smollm2-135m-instruct",
               "--bench", "tau2:airline", "--limit", "1", "--user-model", ref, "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith(needle) and "--model '" not in err
    assert not (tmp_path / "e").exists()  # refused before --out is made


def test_a_bad_model_leaves_no_out_folder(eval_loads_no_model, over, tmp_path, capsys):
    rc = main(["--profile", "test", "--overrides", over, "eval", "--model", str(tmp_path / "nope"),
               "--bench", "tau2:airline", "--limit", "1", "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "nope" in err, err
    assert not (tmp_path / "e").exists()


def test_bad_judge_model_is_named_as_such(tmp_path):
    from envace_core.config import load_config
    from envace_core.models import ModelRefError

    opts = EvalOptions(model="m", benches="", out=str(tmp_path), judge_model="/nope")
    with pytest.raises(ModelRefError, match="^--judge-model '/nope': no such file or folder"):
        harness._side_model("--judge-model", "/nope", opts, load_config("test", ""))
