# Builds the assistd binary and runs it. Used by docker-compose.yml.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/assistd /usr/local/bin/assistd
ENV ASSISTD_SERVER__LISTEN=0.0.0.0:8787
EXPOSE 8787
ENTRYPOINT ["assistd"]
CMD ["serve"]
