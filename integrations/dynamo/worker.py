"""weft as an NVIDIA Dynamo backend: a `dynamo.common.backend.LLMEngine` in front of one
`weft serve`, so that Dynamo's frontend and KV-aware router can spread requests over many weft
replicas.

    python integrations/dynamo/worker.py --model M [Dynamo's worker flags] [-- weft serve options]

The worker starts `weft serve` on loopback (the binary from $WEFT_BIN, else PATH, else the
repository's release build), or attaches to a running one with --weft-url. It registers weft's
block size and KV blocks (read from its `vllm:cache_config_info` metric), forwards each
request's token ids and sampling options to weft's /v1/completions with `return_token_ids`,
streams the token ids back, cancels by closing the stream when Dynamo says the request
stopped, relays weft's KV events (its ZMQ stream, vLLM's wire) to the router, and on SIGTERM
lets weft drain its requests within `--shutdown-grace`.

The frontend tokenizes and applies the chat template itself, from the model folder: a
Hugging Face directory; for a GGUF, the folder beside it when it holds tokenizer.json, else
one `weft export-tokenizer` writes from the GGUF (--model-path names another).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, AsyncGenerator, Optional

import aiohttp
from dynamo.common.backend import EngineConfig, LLMEngine, LlmRegistration, WorkerConfig
from dynamo.common.backend.publisher import ZmqSource
from dynamo.common.backend.run import run

REPO = Path(__file__).resolve().parents[2]

# Dynamo's sampling options and stop conditions, as weft's /v1/completions names them.
SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
}
STOPS = {"max_tokens": "max_tokens", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos"}
# weft's finish reasons as Dynamo's: an abort is a cancellation.
FINISH = {"stop": "stop", "length": "length", "abort": "cancelled"}


def weft_binary() -> str:
    """$WEFT_BIN, else `weft` on PATH, else this repository's release build."""
    if os.environ.get("WEFT_BIN"):
        return os.environ["WEFT_BIN"]
    on_path = shutil.which("weft")
    if on_path:
        return on_path
    built = REPO / "target" / "release" / "weft"
    if built.exists():
        return str(built)
    sys.exit("weft not found: set WEFT_BIN, put weft on PATH, or run `cargo build --release`")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_folder(model: str, explicit: Optional[str]) -> str:
    """The folder the frontend reads the tokenizer and chat template from: the one given, the
    model's own, or one `weft export-tokenizer` writes from the GGUF into weft's cache."""
    if explicit:
        return explicit
    p = Path(model)
    folder = p if p.is_dir() else p.parent
    if (folder / "tokenizer.json").exists():
        return str(folder)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "weft" / "dynamo" / p.stem
    subprocess.run([weft_binary(), "export-tokenizer", "--model", model, "--out", str(cache)], check=True)
    return str(cache)


class WeftEngine(LLMEngine):
    def __init__(self, args: argparse.Namespace, weft_args: list[str]):
        self.args = args
        self.weft_args = weft_args
        self.url: Optional[str] = args.weft_url
        self.process: Optional[subprocess.Popen] = None
        self.events_endpoint: Optional[str] = None
        self.session: Optional[aiohttp.ClientSession] = None
        # Open weft streams by Dynamo request id, closed to cancel.
        self.streams: dict[str, aiohttp.ClientResponse] = {}
        self.watchdog: Optional[asyncio.Task] = None

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple["WeftEngine", WorkerConfig]:
        argv = list(sys.argv[1:] if argv is None else argv)
        weft_args: list[str] = []
        if "--" in argv:
            at = argv.index("--")
            argv, weft_args = argv[:at], argv[at + 1 :]
        p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        p.add_argument("--model", required=True, help="what weft serves: a GGUF file or a model directory")
        p.add_argument("--model-path", help="the folder the frontend tokenizes with (default: the model's)")
        p.add_argument("--served-model-name", help="the model's name in the API (default: the folder's name)")
        p.add_argument("--weft-url", help="attach to a running weft serve (started with --kv-events-config)")
        p.add_argument("--weft-port", type=int, default=0, help="port of the weft this worker starts (0: any)")
        p.add_argument("--kv-events-port", type=int, default=0, help="weft's KV-event port (0: any)")
        p.add_argument("--kv-events-endpoint", help="with --weft-url: the ZMQ endpoint of its KV events")
        p.add_argument("--namespace", default="dynamo")
        p.add_argument("--component", default="backend")
        p.add_argument("--endpoint", default="generate")
        p.add_argument("--endpoint-types", default="chat,completions")
        p.add_argument("--discovery-backend", default=os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"))
        p.add_argument("--request-plane", default=os.environ.get("DYN_REQUEST_PLANE", "tcp"))
        p.add_argument("--event-plane", default=os.environ.get("DYN_EVENT_PLANE"))
        p.add_argument("--disable-kv-routing", action="store_true", help="publish no KV events")
        args = p.parse_args(argv)
        args.model_path = model_folder(args.model, args.model_path)
        name = args.served_model_name or Path(args.model_path).name
        config = WorkerConfig(
            namespace=args.namespace,
            component=args.component,
            endpoint=args.endpoint,
            model_name=args.model_path,
            served_model_name=name,
            endpoint_types=args.endpoint_types,
            discovery_backend=args.discovery_backend,
            request_plane=args.request_plane,
            event_plane=args.event_plane,
            enable_kv_routing=not args.disable_kv_routing,
        )
        args.served_model_name = name
        return cls(args, weft_args), config

    async def start(self, worker_id: int) -> EngineConfig:
        del worker_id
        if self.url is None:
            self.url = self.spawn()
        else:
            self.events_endpoint = self.args.kv_events_endpoint
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        await self.wait_ready()
        block_size, blocks = await self.cache_info()
        async with self.session.get(f"{self.url}/v1/models") as r:
            context = (await r.json())["data"][0]["max_model_len"]
        print(f"weft-dynamo: weft at {self.url}, {blocks} KV blocks of {block_size}", file=sys.stderr, flush=True)
        self.watchdog = asyncio.get_running_loop().create_task(self.watch())
        return EngineConfig(
            model=self.args.model_path,
            served_model_name=self.args.served_model_name,
            llm=LlmRegistration(context_length=context, kv_cache_block_size=block_size, total_kv_blocks=blocks),
        )

    async def watch(self) -> None:
        """A weft that dies (or stops answering /health three times running) takes its worker
        down, so that the router stops sending it requests."""
        assert self.session is not None
        misses = 0
        while misses < 3:
            await asyncio.sleep(0.5)
            if self.process is not None and self.process.poll() is not None:
                break
            try:
                async with self.session.get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    misses = 0 if r.status == 200 else misses + 1
            except (aiohttp.ClientError, asyncio.TimeoutError):
                misses += 1
        print(f"weft-dynamo: weft at {self.url} is gone; stopping the worker", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    def spawn(self) -> str:
        """Starts `weft serve` on loopback with its KV events on, and returns its URL."""
        port = self.args.weft_port or free_port()
        events = self.args.kv_events_port or free_port()
        self.events_endpoint = f"tcp://127.0.0.1:{events}"
        kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}"}
        cmd = [weft_binary(), "serve", "--model", self.args.model, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--served-model-name", self.args.served_model_name, "--kv-events-config", json.dumps(kv)]
        cmd += self.weft_args
        print("weft-dynamo: " + " ".join(cmd), file=sys.stderr, flush=True)
        self.process = subprocess.Popen(cmd)
        return f"http://127.0.0.1:{port}"

    async def wait_ready(self) -> None:
        assert self.session is not None
        for _ in range(1200):
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"weft serve exited with status {self.process.returncode}")
            try:
                async with self.session.get(f"{self.url}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError(f"weft at {self.url} did not become healthy")

    async def cache_info(self) -> tuple[int, int]:
        """Block size and total blocks, from `vllm:cache_config_info`'s labels."""
        assert self.session is not None
        async with self.session.get(f"{self.url}/metrics") as r:
            text = await r.text()
        for line in text.splitlines():
            if line.startswith("vllm:cache_config_info{"):
                labels = dict(
                    kv.split("=", 1) for kv in line[line.index("{") + 1 : line.index("}")].split(",") if "=" in kv
                )
                return int(labels["block_size"].strip('"')), int(labels["num_gpu_blocks"].strip('"'))
        raise RuntimeError(f"weft at {self.url} publishes no vllm:cache_config_info")

    async def kv_event_sources(self) -> list:
        if self.args.disable_kv_routing or not self.events_endpoint:
            return []
        return [ZmqSource(endpoint=self.events_endpoint)]

    def body(self, request: dict[str, Any]) -> dict[str, Any]:
        """Dynamo's preprocessed request as weft's completion request."""
        body: dict[str, Any] = {"prompt": list(request["token_ids"]), "stream": True, "return_token_ids": True}
        for ours, theirs in SAMPLING.items():
            v = (request.get("sampling_options") or {}).get(ours)
            if v is not None:
                body[theirs] = v
        stops = request.get("stop_conditions") or {}
        for ours, theirs in STOPS.items():
            if stops.get(ours) is not None:
                body[theirs] = stops[ours]
        hidden = stops.get("stop_token_ids_hidden") or []
        if hidden and not stops.get("ignore_eos"):
            body["stop_token_ids"] = list(hidden)
        # Dynamo detokenizes, and applies stop strings, itself.
        body["skip_special_tokens"] = False
        return body

    async def generate(self, request: dict[str, Any], context: Any) -> AsyncGenerator[dict[str, Any], None]:
        assert self.session is not None
        rid = context.id()
        prompt = len(request["token_ids"])
        generated = 0
        async with self.session.post(f"{self.url}/v1/completions", json=self.body(request)) as r:
            if r.status != 200:
                raise ValueError(f"weft refused the request ({r.status}): {await r.text()}")
            self.streams[rid] = r
            try:
                async for line in r.content:
                    if context.is_stopped():
                        break
                    line = line.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(f"weft: {chunk['error']}")
                    for choice in chunk.get("choices", []):
                        ids = choice.get("token_ids") or []
                        generated += len(ids)
                        out: dict[str, Any] = {"token_ids": ids, "index": 0}
                        if choice.get("finish_reason"):
                            out["finish_reason"] = FINISH.get(choice["finish_reason"], choice["finish_reason"])
                            out["completion_usage"] = {
                                "prompt_tokens": prompt,
                                "completion_tokens": generated,
                                "total_tokens": prompt + generated,
                            }
                        yield out
            finally:
                self.streams.pop(rid, None)

    async def abort(self, context: Any) -> None:
        r = self.streams.pop(context.id(), None)
        if r is not None:
            # Closing the stream is weft's cancellation: it frees the request's blocks.
            r.close()

    async def cleanup(self) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None
        if self.session is not None:
            await self.session.close()
            self.session = None
        if self.process is not None and self.process.poll() is None:
            # weft drains what runs within its --shutdown-grace, then exits.
            self.process.send_signal(signal.SIGTERM)
            await asyncio.get_running_loop().run_in_executor(None, self.process.wait)
        self.process = None


if __name__ == "__main__":
    run(WeftEngine)
