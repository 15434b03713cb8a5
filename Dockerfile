# weft in a container, from a release build made first (`cargo build --release`):
#   docker build -t weft .
#   docker run -p 8000:8000 -v /path/to/models:/models weft serve --host 0.0.0.0 --model /models/m.gguf
# BASE is any glibc image at least as new as the build host's (Debian bookworm by default).
ARG BASE=debian:bookworm-slim
FROM ${BASE}
COPY target/release/weft /usr/local/bin/weft
USER 65532:65532
EXPOSE 8000 5557 5558
ENTRYPOINT ["/usr/local/bin/weft"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
