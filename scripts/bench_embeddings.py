#!/usr/bin/env python3
"""Embeddings throughput, weft against llama-server --embeddings on the same GGUF file, in
one run: each round starts each server in turn (alternating which goes first), sends the
same inputs (token ids, so both embed exactly the same tokens) as one /v1/embeddings request
after a warm-up, and times it. Prints inputs/s per round, then medians with their range and
the ratio per round.

    python3 scripts/bench_embeddings.py --weft target/release/weft \\
        --llama-server DIR/llama-server --model FILE.gguf [--inputs 64 --tokens 128 --rounds 3]
"""

import argparse
import json
import random
import re
import statistics
import subprocess
import threading
import time
import urllib.request


def post(base, body):
    req = urllib.request.Request(f"{base}/v1/embeddings", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def wait_healthy(base, proc):
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(0.3)
    raise SystemExit("server never became healthy")


def start(cmd, port_pattern=None, port=None):
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    if port_pattern:
        for line in proc.stderr:
            m = re.search(port_pattern, line)
            if m:
                base = m.group(1)
                break
    else:
        base = f"http://127.0.0.1:{port}"
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    wait_healthy(base, proc)
    return proc, base


def timed(base, inputs):
    post(base, {"input": inputs[:2]})  # warm-up
    t = time.perf_counter()
    r = post(base, {"input": inputs})
    took = time.perf_counter() - t
    assert len(r["data"]) == len(inputs), r
    return len(inputs) / took


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weft", default="target/release/weft")
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--inputs", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=8, help="llama-server slots (-np)")
    args = ap.parse_args()
    rng = random.Random(0)
    inputs = [[rng.randrange(1000, 30000) for _ in range(args.tokens)] for _ in range(args.inputs)]
    weft_cmd = [args.weft, "serve", "--port", "0", "--model", args.model, "--threads", str(args.threads)]
    ctx = args.parallel * (args.tokens + 16)
    llama_cmd = [args.llama_server, "-m", args.model, "--embeddings", "--pooling", "last", "-t", str(args.threads),
                 "-np", str(args.parallel), "-c", str(ctx), "-b", str(ctx), "-ub", str(ctx), "--port", "18093"]
    rates = {"weft": [], "llama-server": []}
    for r in range(args.rounds):
        order = ["weft", "llama-server"] if r % 2 == 0 else ["llama-server", "weft"]
        for name in order:
            if name == "weft":
                proc, base = start(weft_cmd, port_pattern=r"weft: listening on (\S+)")
            else:
                proc, base = start(llama_cmd, port=18093)
            try:
                rates[name].append(timed(base, inputs))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
        print(f"round {r + 1}: weft {rates['weft'][-1]:.1f} inputs/s, llama-server "
              f"{rates['llama-server'][-1]:.1f} inputs/s, ratio {rates['weft'][-1] / rates['llama-server'][-1]:.2f}x",
              flush=True)
    for name, v in rates.items():
        print(f"{name}: median {statistics.median(v):.1f} inputs/s ({min(v):.1f}-{max(v):.1f})")
    ratios = [w / l for w, l in zip(rates["weft"], rates["llama-server"])]
    print(f"weft / llama-server: median {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x), "
          f"{args.inputs} inputs of {args.tokens} tokens, {args.threads} threads")


if __name__ == "__main__":
    main()
