# Builds the assistd binary and runs it as a non-root user. Used by docker-compose.yml.
#   docker build -t assistd .
FROM rust:1-bookworm AS build
WORKDIR /src
# Dependencies first, in a layer of their own: it is rebuilt only when Cargo.toml or
# Cargo.lock change, not at every change of the code (the same as cargo-chef's two steps).
COPY Cargo.toml Cargo.lock ./
RUN mkdir -p src/bin/assistd-bench \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs \
    && echo 'fn main() {}' > src/bin/assistd-bench/main.rs \
    && cargo build --release --locked --bin assistd \
    && rm -rf src target/release/.fingerprint/assistd-* target/release/deps/assistd-* \
        target/release/deps/libassistd-* target/release/assistd
# The code (migrations and templates are compiled into the binary).
COPY . .
RUN cargo build --release --locked --bin assistd

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --home-dir /app --create-home assistd
WORKDIR /app
COPY --from=build /src/target/release/assistd /usr/local/bin/assistd
# The example configurations and workflows (`--config /app/config/examples/<name>.toml`).
COPY --chown=assistd:assistd config/ /app/config/
USER assistd
# Beyond loopback: start-up then demands an admin token of at least 32 bytes.
ENV ASSISTD_SERVER__LISTEN=0.0.0.0:8787
EXPOSE 8787
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8787/readyz || exit 1
ENTRYPOINT ["assistd"]
CMD ["serve"]
