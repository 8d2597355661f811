# The operator image: a static (musl) binary on a distroless base, running as non-root.
#   docker build -t localhost/pelican:0.2.0-dev .
#   docker buildx build --platform linux/amd64,linux/arm64 -t <registry>/pelican:0.2.0-dev --push .
# Without Docker (and what CI runs on its node): `scripts/image pelican pelican.tar` builds the release binary from
# exactly what the COPY lines below name (copied into an empty directory, built offline: a file missing here fails
# CI), links it statically against glibc and puts it with the same user (65532), entrypoint, ports and CA bundle into
# an OCI image tar for `ctr images import`, `docker load` or `podman load`.
FROM rust:1.95-alpine AS build
RUN apk add --no-cache musl-dev
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
COPY src src
COPY contract contract
COPY benches benches
COPY examples examples
RUN cargo build --release --locked --bin pelican && strip target/release/pelican

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /src/target/release/pelican /usr/local/bin/pelican
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["/usr/local/bin/pelican"]
CMD ["run"]
