#!/usr/bin/env python3
"""Two weft replicas behind NVIDIA Dynamo's frontend and KV-aware router, end to end on
127.0.0.1 (file discovery, TCP request plane, ZMQ event plane: no etcd, no NATS).

Each replica is `integrations/dynamo/worker.py`, which starts its own `weft serve` with KV
events on. The run asserts:
- completions and streamed chat through the frontend, which tokenizes with the folder
  `weft export-tokenizer` writes from the GGUF, equal weft's own answers (greedy);
- a client that goes away mid-stream frees the request on its replica;
- with `--router-mode kv`, conversations that share a long prefix land on the replica that
  holds it: at least 80% of the ideal cached tokens (the per-request routing and cached
  counts are printed), and more than round-robin gets on the same kind of traffic;
- killing one replica mid-stream fails the request on it with an error, not a hang, and the
  frontend keeps serving from the other;
- SIGTERM of a worker lets its in-flight stream finish (weft drains within its grace).
TTFT p50 and throughput of both router modes are printed, not asserted.

    python3 scripts/dynamo_e2e.py [--weft target/release/weft] [--python DYNAMO_PYTHON]

Dynamo comes from ../shared/tools/install-dynamo.sh unless --python names its venv's python.
"""

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORDS = (
    "the river runs past old mill where children play each summer and birds sing in tall green trees while "
    "clouds drift over quiet hills a farmer walks his dog along stone walls to market with apples bread cheese "
    "honey wool for the town square"
).split()
BLOCK = 16
MODEL_NAME = "smollm2"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port, method, path, body=None, timeout=600):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request(method, path, json.dumps(body) if body is not None else None, {"content-type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    try:
        return r.status, json.loads(data)
    except ValueError:
        return r.status, data.decode(errors="replace")


def stream(port, path, body, timeout=600):
    """Streams a request: (status, seconds to the first content, text, finish_reason, error)."""
    t0 = time.monotonic()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, json.dumps(dict(body, stream=True)), {"content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        return r.status, None, "", None, r.read().decode(errors="replace")
    ttft, text, finish, error = None, "", None, None
    try:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
                continue
            for ch in chunk.get("choices", []):
                piece = ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.monotonic() - t0
                text += piece
                finish = ch.get("finish_reason") or finish
    except (http.client.HTTPException, OSError) as e:
        error = f"connection: {e}"
    c.close()
    return 200, ttft, text, finish, error


def metric(port, name):
    status, text = request(port, "GET", "/metrics")
    if status != 200:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


class Cluster:
    """The frontend and the workers, with their weft ports."""

    def __init__(self, python, weft, model, logs):
        self.python, self.weft, self.model, self.logs = python, weft, model, logs
        self.kv = tempfile.mkdtemp(prefix="weft-dynamo-kv-")
        self.env = dict(
            os.environ,
            DYN_FILE_KV=self.kv,
            DYN_TCP_RPC_HOST="127.0.0.1",
            DYN_EVENT_PLANE_HOST="127.0.0.1",
            DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1",
            DYN_SYSTEM_HOST="127.0.0.1",
            WEFT_BIN=weft,
        )
        self.flags = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
        # The frontend tokenizes with what `weft export-tokenizer` writes from the GGUF.
        self.folder = os.path.join(self.kv, "model")
        subprocess.run([weft, "export-tokenizer", "--model", model, "--out", self.folder], check=True)
        self.frontend = None
        self.port = free_port()
        self.workers = {}

    def log(self, name):
        return open(os.path.join(self.logs, name + ".log"), "ab")

    def start_frontend(self, mode):
        cmd = [self.python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(self.port)]
        cmd += self.flags + ["--router-mode", mode, "--kv-cache-block-size", str(BLOCK)]
        out = self.log(f"frontend-{mode}")
        self.frontend = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def stop_frontend(self):
        self.frontend.send_signal(signal.SIGTERM)
        try:
            self.frontend.wait(30)
        except subprocess.TimeoutExpired:
            self.frontend.kill()
            self.frontend.wait()

    def start_worker(self, name):
        port = free_port()
        cmd = [self.python, os.path.join(REPO, "integrations", "dynamo", "worker.py"), "--model", self.model]
        cmd += ["--served-model-name", MODEL_NAME, "--weft-port", str(port), "--model-path", self.folder]
        cmd += self.flags
        cmd += ["--", "--threads", "1", "--kv-cache-memory", "256M", "--block-size", str(BLOCK)]
        out = self.log(f"worker-{name}")
        proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self.workers[name] = (proc, port)

    def weft_pid(self, name):
        proc, _ = self.workers[name]
        out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        return int(out[0]) if out else None

    def wait_ready(self, names):
        deadline = time.monotonic() + 300
        for name in names:
            _, port = self.workers[name]
            while True:
                try:
                    if request(port, "GET", "/health", timeout=5)[0] == 200:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, f"replica {name} never became healthy"
                time.sleep(0.2)
        # The frontend serves the model once it has discovered the workers.
        while True:
            try:
                status, body = request(self.port, "GET", "/v1/models", timeout=5)
                if status == 200 and any(m["id"] == MODEL_NAME for m in body["data"]):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the frontend never listed the model"
            time.sleep(0.2)
        time.sleep(2)

    def stop(self):
        for proc, _ in self.workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in self.workers.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.frontend and self.frontend.poll() is None:
            self.stop_frontend()
        shutil.rmtree(self.kv, ignore_errors=True)


def conversations(rng, count, system_words):
    convs = []
    for c in range(count):
        system = f"You are assistant number {c}. " + " ".join(rng.choice(WORDS) for _ in range(system_words))
        convs.append([{"role": "system", "content": system}])
    return convs


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def workload(cluster, mode, seed, count, system_words, turns):
    """Multi-turn conversations through the frontend, one request at a time in a shuffled
    order per turn; per request: replica, prompt tokens, cached tokens, ideal, TTFT. The ideal
    is the longest whole-block prefix shared with an earlier prompt of the conversation; the
    cache also holds the earlier replies' tokens, so a router can beat it slightly."""
    rng = random.Random(seed)
    convs = conversations(rng, count, system_words)
    ports = {n: p for n, (_, p) in cluster.workers.items()}
    sent = {c: [] for c in range(count)}
    rows = []
    t0 = time.monotonic()
    generated = 0
    for turn in range(turns):
        order = list(range(count))
        rng.shuffle(order)
        for c in order:
            convs[c].append({"role": "user", "content": f"Turn {turn}: tell me about the {rng.choice(WORDS)}."})
            _, tok = request(ports["a"], "POST", "/tokenize", {"messages": convs[c]})
            ids = tok["tokens"]
            ideal = max((common_prefix(ids, p) for p in sent[c]), default=0)
            ideal = min(ideal, len(ids) - 1) // BLOCK * BLOCK
            before = {n: (metric(p, "weft:prefix_cache_queries_total"), metric(p, "weft:prefix_cache_hits_total"))
                      for n, p in ports.items()}
            body = {"model": MODEL_NAME, "messages": convs[c], "max_tokens": 16, "temperature": 0}
            status, ttft, text, finish, error = stream(cluster.port, "/v1/chat/completions", body)
            assert status == 200 and error is None, (status, error)
            after = {n: (metric(p, "weft:prefix_cache_queries_total"), metric(p, "weft:prefix_cache_hits_total"))
                     for n, p in ports.items()}
            replica = [n for n in ports if after[n][0] != before[n][0]]
            assert len(replica) == 1, f"one replica served the request: {before} -> {after}"
            n = replica[0]
            cached = int(after[n][1] - before[n][1])
            rows.append({"mode": mode, "conv": c, "turn": turn, "replica": n, "prompt": len(ids), "cached": cached,
                         "ideal": ideal, "ttft": ttft})
            sent[c].append(ids)
            generated += 16
            convs[c].append({"role": "assistant", "content": text})
    elapsed = time.monotonic() - t0
    return rows, elapsed


def report(rows, elapsed):
    cached = sum(r["cached"] for r in rows)
    ideal = sum(r["ideal"] for r in rows)
    ttfts = [r["ttft"] for r in rows if r["ttft"] is not None]
    mode = rows[0]["mode"]
    print(f"DYNAMO {mode}: {len(rows)} requests in {elapsed:.1f} s ({len(rows) / elapsed:.2f} req/s), "
          f"cached {cached} of ideal {ideal} tokens ({100 * cached / max(ideal, 1):.0f}%), "
          f"TTFT p50 {statistics.median(ttfts):.3f} s (min {min(ttfts):.3f}, max {max(ttfts):.3f})")
    for r in rows:
        print(f"  {mode} conv {r['conv']} turn {r['turn']}: replica {r['replica']}, prompt {r['prompt']}, "
              f"cached {r['cached']} (ideal {r['ideal']}), TTFT {r['ttft']:.3f} s")
    return cached, ideal, statistics.median(ttfts)


def same_answers(cluster):
    """Greedy completions and streamed chat through the frontend equal weft's own."""
    _, port = cluster.workers["a"]
    for prompt in ["The capital of France is", "Once upon a time, in a quiet village,", "def fibonacci(n):"]:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
        s1, via = request(cluster.port, "POST", "/v1/completions", dict(body, model=MODEL_NAME))
        s2, direct = request(port, "POST", "/v1/completions", body)
        assert (s1, s2) == (200, 200), (via, direct)
        assert via["choices"][0]["text"] == direct["choices"][0]["text"], (via, direct)
    for question in ["Hi, who are you?", "Name three colours."]:
        messages = [{"role": "user", "content": question}]
        body = {"messages": messages, "max_tokens": 24, "temperature": 0}
        status, _, text, finish, error = stream(cluster.port, "/v1/chat/completions", dict(body, model=MODEL_NAME))
        _, direct = request(port, "POST", "/v1/chat/completions", body)
        assert status == 200 and error is None, error
        assert text == direct["choices"][0]["message"]["content"], (text, direct)
        assert finish == direct["choices"][0]["finish_reason"], (finish, direct)
    print("DYNAMO answers: completions and streamed chat through the frontend equal weft's own")


def cancel(cluster):
    """A client that goes away mid-stream: the replica stops the request and frees its blocks."""
    c = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=60)
    body = {"model": MODEL_NAME, "prompt": "Write a long story.", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    c.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    chunks = 0
    while chunks < 3:
        chunks += r.readline().startswith(b"data: ")
    c.close()
    t0 = time.monotonic()
    ports = [p for _, p in cluster.workers.values()]
    while any(metric(p, "weft:num_requests_running") or metric(p, "weft:kv_cache_usage_perc") for p in ports):
        assert time.monotonic() - t0 < 30, "a cancelled request still runs"
        time.sleep(0.05)
    print(f"DYNAMO cancel: a client gone mid-stream freed its replica's request in {time.monotonic() - t0:.2f} s")


def kill_one(cluster):
    """SIGKILL the replica serving a long stream: that stream ends in an error (no hang), the
    frontend goes on serving from the other replica."""
    result = {}
    body = {"model": MODEL_NAME, "prompt": "Write a long story about a river.", "max_tokens": 2000,
            "temperature": 0, "ignore_eos": True}
    t = threading.Thread(target=lambda: result.update(r=stream(cluster.port, "/v1/completions", body, timeout=120)))
    t.start()
    victim = None
    deadline = time.monotonic() + 60
    while victim is None:
        for name, (_, port) in cluster.workers.items():
            if metric(port, "weft:num_requests_running") == 1.0:
                victim = name
        assert time.monotonic() < deadline, "the long stream never started"
        time.sleep(0.05)
    time.sleep(0.5)
    pid = cluster.weft_pid(victim)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    t.join(120)
    assert not t.is_alive(), "the stream on the killed replica hangs"
    status, _, text, finish, error = result["r"]
    assert status != 200 or error is not None or finish not in ("length", "stop"), result
    print(f"DYNAMO kill: replica {victim}'s weft killed mid-stream; the stream ended in "
          f"{time.monotonic() - t0:.1f} s with {'an error: ' + str(error)[:120] if error else f'status {status}'}")
    # Its worker notices and leaves; the frontend serves from the other replica.
    proc, _ = cluster.workers[victim]
    proc.wait(60)
    survivor = next(n for n in cluster.workers if n != victim)
    ok = 0
    for i in range(6):
        s, r = request(cluster.port, "POST", "/v1/completions",
                       {"model": MODEL_NAME, "prompt": f"Count to {i}:", "max_tokens": 4, "temperature": 0})
        ok += s == 200
    assert ok == 6, f"{ok} of 6 requests after the kill succeeded"
    print(f"DYNAMO kill: 6 of 6 later requests served by replica {survivor}")
    return survivor


def drain(cluster, name):
    """SIGTERM a worker while it streams: the stream finishes."""
    result = {}
    body = {"model": MODEL_NAME, "prompt": "Tell me a story.", "max_tokens": 120, "temperature": 0,
            "ignore_eos": True}
    t = threading.Thread(target=lambda: result.update(r=stream(cluster.port, "/v1/completions", body, timeout=120)))
    t.start()
    _, port = cluster.workers[name]
    deadline = time.monotonic() + 60
    while metric(port, "weft:num_requests_running") != 1.0:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.05)
    proc, _ = cluster.workers[name]
    proc.send_signal(signal.SIGTERM)
    t.join(120)
    status, _, text, finish, error = result["r"]
    assert (status, error, finish) == (200, None, "length"), result
    proc.wait(120)
    print(f"DYNAMO drain: SIGTERM mid-stream; the stream finished ({finish}), the worker exited {proc.returncode}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weft", default=os.path.join(REPO, "target", "release", "weft"))
    ap.add_argument("--python", help="Dynamo's python (default: ../shared/tools/install-dynamo.sh installs it)")
    ap.add_argument("--model", help="default: SmolLM2 Q4_1 from ../shared/models")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--system-words", type=int, default=1150, help="about 1,500 tokens")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--logs", default=os.path.join(REPO, "target", "dynamo-e2e"))
    args = ap.parse_args()
    shared = os.environ.get("WEFT_SHARED_MODELS", os.path.join(REPO, "..", "shared", "models"))
    model = args.model or os.path.join(shared, "smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf")
    python = args.python
    if python is None:
        installer = os.path.join(REPO, "..", "shared", "tools", "install-dynamo.sh")
        python = subprocess.run(["bash", installer], check=True, capture_output=True, text=True).stdout.strip()
    os.makedirs(args.logs, exist_ok=True)
    results = {}
    for mode in ["kv", "round-robin"]:
        cluster = Cluster(python, os.path.abspath(args.weft), model, args.logs)
        try:
            cluster.start_frontend(mode)
            cluster.start_worker("a")
            cluster.start_worker("b")
            cluster.wait_ready(["a", "b"])
            if mode == "kv":
                same_answers(cluster)
                cancel(cluster)
            rows, elapsed = workload(cluster, mode, 1, args.conversations, args.system_words, args.turns)
            results[mode] = report(rows, elapsed) + (len(rows) / elapsed,)
            if mode == "kv":
                survivor = kill_one(cluster)
                drain(cluster, survivor)
        finally:
            cluster.stop()
    (kv_cached, kv_ideal, kv_ttft, kv_rate), (rr_cached, _, rr_ttft, rr_rate) = results["kv"], results["round-robin"]
    print(f"DYNAMO kv vs round-robin: TTFT p50 {kv_ttft:.3f} vs {rr_ttft:.3f} s ({rr_ttft / kv_ttft:.2f}x lower), "
          f"cached tokens {kv_cached} vs {rr_cached}, throughput {kv_rate:.2f} vs {rr_rate:.2f} req/s")
    assert kv_cached >= 0.8 * kv_ideal, f"the KV router cached {kv_cached} of an ideal {kv_ideal} tokens"
    assert kv_cached > rr_cached, "the KV router caches more than round-robin"
    print("DYNAMO 0")


if __name__ == "__main__":
    main()
