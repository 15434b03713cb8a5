#!/usr/bin/env bash
# Builds the Dockerfile's image and health-checks a container of it serving SmolLM2: /health
# answers 200, a completion works, and `docker stop` (SIGTERM) ends it with status 0. Needs a
# Docker daemon; where none runs, it says why and exits 0. Without registry access the base
# image is made from Debian's packages with debootstrap (cached in ~/.cache/weft-docker).
#   bash scripts/docker_check.sh [MODEL.gguf]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-$(cd .. && pwd)/shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf}
if ! err=$(docker info 2>&1 >/dev/null); then
  echo "DOCKER skipped: no Docker daemon ($(echo "$err" | tail -1))"
  exit 0
fi
# The image holds a release build, not the one the tests made (fault injection on).
cargo build --release
base=debian:bookworm-slim
if ! docker image inspect "$base" >/dev/null 2>&1 && ! docker pull -q "$base" >/dev/null 2>&1; then
  base=weft-base:bookworm
  if ! docker image inspect "$base" >/dev/null 2>&1; then
    cache=$HOME/.cache/weft-docker
    mkdir -p "$cache"
    if [ ! -f "$cache/bookworm.tar" ]; then
      root=$(mktemp -d)
      debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >/dev/null
      tar -C "$root" -cf "$cache/bookworm.tar" .
      rm -rf "$root"
    fi
    docker import "$cache/bookworm.tar" "$base" >/dev/null
  fi
fi
docker build -q --build-arg BASE="$base" -t weft:check . >/dev/null
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
id=$(docker run -d -p "127.0.0.1:$port:8000" -v "$(dirname "$model"):/models:ro" weft:check \
  serve --host 0.0.0.0 --port 8000 --model "/models/$(basename "$model")" --kv-cache-memory 256M)
trap 'docker rm -f "$id" >/dev/null 2>&1 || true' EXIT
for _ in $(seq 300); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")" = 200 ] && break
  sleep 0.2
done
curl -sf "http://127.0.0.1:$port/health" >/dev/null || { docker logs "$id"; echo "DOCKER 1: never healthy"; exit 1; }
curl -sf "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
  -d '{"prompt": "Hello", "max_tokens": 4}' | grep -q '"finish_reason"'
docker stop -t 30 "$id" >/dev/null
status=$(docker inspect -f '{{.State.ExitCode}}' "$id")
[ "$status" = 0 ] || { docker logs "$id"; echo "DOCKER 1: exit status $status after SIGTERM"; exit 1; }
echo "DOCKER 0: image built from $base, healthy, answered, stopped cleanly"
