#!/usr/bin/env python3
"""A soak of realistic mixed traffic against `weft serve` (Python standard library only).

Starts the server, then sends a seeded mix from several client threads at once: prompt
lengths drawn from workloads/chat-mix.json (short chat turns to several thousand tokens),
multi-turn chats that share a long system prompt, completions and chat, streamed and not,
n > 1, stop strings, logprobs, clients that disconnect mid-stream, and a prompt over the
context. It asserts that no response is a 5xx, that the over-long prompt is a 400 naming
max_model_len, that weft:engine_failures_total stays 0, that sequences were preempted (the
cache is small for that), that every KV block is free once idle, and that each greedy answer
equals the same request sent again alone.

    python3 scripts/soak.py [--weft target/release/weft] [--model PATH] [--requests 40] [--seed 0]
        [--kv-cache-memory 80M] [--serve-arg=--speculative-config --serve-arg='{...}']

The model defaults to SmolLM2 from ../shared/models, else the copy `weft generate` caches.
"""

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORDS = (
    "the river runs past old mill where children play each summer and birds sing in tall green trees while "
    "clouds drift over quiet hills a farmer walks his dog along stone walls to market with apples bread cheese "
    "honey wool for the town square"
).split()


# Longest prompt in words: with its output, within the cache the server gets.
LONGEST = 4500


def default_model():
    rel = os.path.join("smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf")
    shared = os.environ.get("WEFT_SHARED_MODELS", os.path.join(HERE, "..", "..", "shared", "models"))
    cache = os.environ.get("WEFT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "weft"
    )
    for path in (os.path.join(shared, rel), os.path.join(cache, rel)):
        if os.path.exists(path):
            return path
    return None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def draw(rng, buckets):
    """A length from a bucket chosen by weight."""
    b = rng.choices(buckets, weights=[x["weight"] for x in buckets])[0]
    return rng.randint(b["min"], b["max"])


def text_of(rng, words):
    """About `words` tokens of text."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Client:
    def __init__(self, port):
        self.port = port

    def conn(self, timeout=600):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def post(self, path, body):
        """(status, parsed JSON or text) of a non-streamed request."""
        c = self.conn()
        try:
            c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            raw = r.read().decode()
            try:
                return r.status, json.loads(raw)
            except ValueError:
                return r.status, raw
        finally:
            c.close()

    def stream(self, path, body, stop_after=None):
        """(status, text per choice index, finish reasons) of a streamed request; with
        `stop_after`, the connection is dropped after that many events."""
        c = self.conn()
        try:
            c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                return r.status, r.read().decode(), None
            texts, finish, events = {}, {}, 0
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for ch in chunk.get("choices", []):
                    i = ch["index"]
                    piece = ch.get("text")
                    if piece is None:
                        piece = (ch.get("delta") or {}).get("content") or ""
                    texts[i] = texts.get(i, "") + piece
                    if ch.get("finish_reason"):
                        finish[i] = ch["finish_reason"]
                events += 1
                if stop_after is not None and events >= stop_after:
                    # A client that goes away mid-stream: close the socket under the response.
                    c.sock.shutdown(socket.SHUT_RDWR)
                    return 200, texts, "disconnected"
            return 200, texts, finish
        finally:
            c.close()

    def get(self, path):
        c = self.conn(timeout=30)
        try:
            c.request("GET", path)
            r = c.getresponse()
            return r.status, r.read().decode()
        finally:
            c.close()


def metric(text, name):
    m = re.search(r"^" + re.escape(name) + r"(?:\{[^}]*\})? ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def plan(rng, mix, requests, most_words):
    """The seeded requests: (kind, endpoint, body, greedy, disconnect_after)."""
    out = []
    for _ in range(requests):
        words = min(draw(rng, mix["prompt_tokens"]), LONGEST, most_words)
        max_tokens = min(draw(rng, mix["output_tokens"]), 32)
        chat = rng.random() < 0.5
        body = {"max_tokens": max_tokens, "temperature": 0, "seed": rng.randint(0, 1000)}
        if chat:
            body["messages"] = [{"role": "user", "content": text_of(rng, words)}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = text_of(rng, words)
            path = "/v1/completions"
        roll = rng.random()
        if roll < 0.15:
            body.update(n=rng.choice([2, 3]), temperature=0.8)
        elif roll < 0.3:
            body["stop"] = [rng.choice(WORDS), " " + rng.choice(WORDS)]
        elif roll < 0.45:
            if chat:
                body.update(logprobs=True, top_logprobs=3)
            else:
                body["logprobs"] = 3
        stream = rng.random() < 0.5
        body["stream"] = stream
        disconnect = rng.randint(1, 4) if stream and rng.random() < 0.2 else None
        greedy = body["temperature"] == 0 and disconnect is None
        out.append(("request", path, body, greedy, disconnect))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weft", default=os.path.join(HERE, "..", "target", "release", "weft"))
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-memory", default="80M", help="small enough that sequences are preempted")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more argument for weft serve")
    args = ap.parse_args()
    if args.model is None:
        raise SystemExit("soak: no SmolLM2 in ../shared/models or weft's cache; pass --model")
    with open(os.path.join(HERE, "..", "workloads", "chat-mix.json")) as f:
        mix = json.load(f)

    port = free_port()
    # By default a cache (about 3,500 tokens of SmolLM2) that holds the longest request but
    # not every stream at once, so that sequences are preempted too.
    cmd = [args.weft, "serve", "--model", args.model, "--port", str(port), "--kv-cache-memory", args.kv_cache_memory] + args.serve_arg
    print("soak:", " ".join(cmd), flush=True)
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = []
    threading.Thread(target=lambda: log.extend(server.stderr), daemon=True).start()
    client = Client(port)
    failures = []
    try:
        for _ in range(600):
            try:
                if client.get("/health")[0] == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None:
                raise SystemExit("soak: the server exited:\n" + "".join(log))
            time.sleep(0.5)
        else:
            raise SystemExit("soak: the server did not become healthy")
        ctx = json.loads(client.get("/v1/models")[1])["data"][0].get("max_model_len", 8192)

        # Prompts within the context with room for the output and a chat template, so that
        # small-context models and small vocabularies get their share of long prompts, not 400s.
        sample = text_of(random.Random(args.seed), 200)
        per_word = client.post("/tokenize", {"prompt": sample})[1]["count"] / 200
        most_words = max(10, int((ctx - 100) / per_word))

        rng = random.Random(args.seed)
        work = plan(rng, mix, args.requests, most_words)
        # Multi-turn chats: a shared long system prompt, then turns that carry the history.
        system = text_of(rng, min(1500, most_words // 3))
        convs = [[text_of(rng, rng.randint(10, 80)) for _ in range(3)] for _ in range(args.conversations)]
        results, lock = [], threading.Lock()

        def record(item, status, got, finish):
            with lock:
                results.append((item, status, got, finish))
                if status >= 500:
                    failures.append(f"{item[1]} answered {status}: {got}")

        def run(item):
            _, path, body, _, disconnect = item
            if body["stream"]:
                status, got, finish = client.stream(path, body, disconnect)
            else:
                status, got = client.post(path, body)
                finish = None
            record(item, status, got, finish)

        def conversation(turns):
            messages = [{"role": "system", "content": system}]
            for t in turns:
                messages.append({"role": "user", "content": t})
                body = {"messages": list(messages), "max_tokens": 24, "temperature": 0, "stream": False}
                item = ("turn", "/v1/chat/completions", body, True, None)
                status, got = client.post(item[1], body)
                record(item, status, got, None)
                if status != 200:
                    return
                messages.append({"role": "assistant", "content": got["choices"][0]["message"]["content"]})

        queue = list(work)
        qlock = threading.Lock()

        def worker():
            while True:
                with qlock:
                    if not queue:
                        return
                    item = queue.pop()
                try:
                    run(item)
                except Exception as e:  # noqa: BLE001 - any failure of a client is a finding
                    with lock:
                        failures.append(f"{item[1]}: {type(e).__name__}: {e}")

        start = time.time()
        threads = [threading.Thread(target=worker) for _ in range(args.clients)]
        threads += [threading.Thread(target=conversation, args=(c,)) for c in convs]
        for t in threads:
            t.start()
        # A prompt over the context while the rest runs: a 400 that names max_model_len.
        status, got = client.post("/v1/completions", {"prompt": text_of(rng, ctx + 500), "max_tokens": 4})
        if status != 400 or "max_model_len" not in json.dumps(got):
            failures.append(f"an over-long prompt got {status}: {str(got)[:300]}")
        for t in threads:
            t.join()
        busy = time.time() - start

        # Idle: every block free, nothing failed inside the engine.
        for _ in range(100):
            text = client.get("/metrics")[1]
            if metric(text, "weft:num_requests_running") == 0 and metric(text, "weft:kv_cache_usage_perc") == 0:
                break
            time.sleep(0.2)
        engine_failures = metric(text, "weft:engine_failures_total") or 0
        if engine_failures:
            failures.append(f"weft:engine_failures_total is {engine_failures}")
        if metric(text, "weft:kv_cache_usage_perc") != 0 or metric(text, "weft:num_requests_running") != 0:
            failures.append("the KV cache is not empty once idle")
        if not metric(text, "weft:num_preemptions_total"):
            failures.append("no sequence was preempted: pass a smaller --kv-cache-memory")

        # Greedy answers again, alone.
        compared = 0
        for item, status, got, finish in results:
            _, path, body, greedy, _ = item
            if not greedy or status != 200:
                continue
            again = dict(body, stream=False)
            s2, alone = client.post(path, again)
            if s2 != 200:
                failures.append(f"alone: {path} answered {s2}")
                continue

            def texts(resp):
                return [c.get("text", (c.get("message") or {}).get("content")) for c in resp["choices"]]

            mine = [got[i] for i in sorted(got)] if body["stream"] else texts(got)
            if mine != texts(alone):
                failures.append(f"{path}: greedy answer in the soak {mine!r} differs from alone {texts(alone)!r}")
            compared += 1

        prompts = [len(i[2].get("prompt", "").split()) or sum(len(m["content"].split()) for m in i[2]["messages"]) for i, *_ in results]
        statuses, refusals = {}, set()
        for _, s, got, _ in results:
            statuses[s] = statuses.get(s, 0) + 1
            if 400 <= s < 500:
                try:
                    body = got if isinstance(got, dict) else json.loads(got)
                    refusals.add(body["error"]["message"])
                except (ValueError, KeyError, TypeError):
                    refusals.add(str(got)[:200])
        print(
            f"soak: {len(results)} requests in {busy:.0f} s from {args.clients} clients and {len(convs)} conversations; "
            f"statuses {statuses}; prompt words {min(prompts)}-{max(prompts)} (median {sorted(prompts)[len(prompts) // 2]}); "
            f"disconnects {sum(1 for r in results if r[3] == 'disconnected')}; greedy answers compared alone {compared}; "
            f"preemptions {metric(text, 'weft:num_preemptions_total')}; prefix-cache hit tokens {metric(text, 'weft:prefix_cache_hits_total')}; "
            f"engine failures {engine_failures}",
            *(f"\n  refused: {r}" for r in sorted(refusals)),
            flush=True,
        )
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    if failures:
        print("soak: FAILED", *failures, sep="\n  ", file=sys.stderr)
        print("".join(log[-40:]), file=sys.stderr)
        sys.exit(1)
    print("soak: 1 passed, 0 failed")


if __name__ == "__main__":
    main()
