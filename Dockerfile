# taskgate: one static-ish binary on a small Debian base.
#
#   podman build --format docker -t taskgate .
#   (umask 077 && openssl rand -hex 32 > operator.token)   # keep it: it is the operator's
#   podman run -d -p 8080:8080 -v taskgate-data:/data \
#     -e TASKGATE_OPERATOR_TOKEN="$(cat operator.token)" taskgate
#
# (docs/operations.md, "Container", has the rest.)
#
# The base images are build arguments, so the image also builds where only
# local base images exist (see scripts/container-smoke): the build stage
# needs cargo on its PATH (as in the official rust image, or a toolchain
# mounted at /usr/local/cargo and /usr/local/rustup) and apt for gcc.
ARG RUST_IMAGE=docker.io/library/rust:1.95-bookworm
ARG RUNTIME_IMAGE=docker.io/library/debian:bookworm-slim

FROM ${RUST_IMAGE} AS build
ENV CARGO_HOME=/usr/local/cargo \
    RUSTUP_HOME=/usr/local/rustup \
    PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    CARGO_TARGET_DIR=/build/target \
    CARGO_PROFILE_RELEASE_DEBUG=false \
    CARGO_PROFILE_RELEASE_STRIP=symbols
# The image's binary has no symbols and no debug information (about a
# quarter of the size); local release builds keep their line tables
# (Cargo.toml) for profiles and backtraces. Set before the dependency layer,
# so both layers build with one profile.
# ring and mimalloc compile C with the system's cc (as any Rust build of
# them does); a no-op where the image has one.
RUN command -v cc >/dev/null 2>&1 || (apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*)
WORKDIR /build
# Dependencies first, in their own layer: rebuilt only when a manifest or
# the lock file changes. Stub sources stand in for the workspace's crates
# (only `-p taskgate` is built, but every member's manifest must parse).
COPY Cargo.toml Cargo.lock ./
COPY bench/Cargo.toml bench/
COPY fuzz/Cargo.toml fuzz/
COPY testkit/Cargo.toml testkit/
RUN mkdir -p src bench/src fuzz/src testkit/src \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs fuzz/src/lib.rs testkit/src/lib.rs \
    && echo 'fn main() {}' > bench/src/main.rs \
    && cargo build --release --locked -p taskgate \
    && rm -rf src bench/src fuzz/src testkit/src
# Then the whole build context: whatever the crate reads at build time
# (src/, ui/, openapi/, ...) is there. `.dockerignore` keeps out only what
# is generated or local (target/, .git, node_modules, data directories).
COPY . .
# Touch so cargo rebuilds the crate itself, not the cached stub.
RUN touch src/main.rs src/lib.rs \
    && cargo build --release --locked -p taskgate \
    && cp /build/target/release/taskgate /taskgate

FROM ${RUNTIME_IMAGE}
RUN groupadd --system --gid 10001 taskgate \
    && useradd --system --uid 10001 --gid taskgate --home-dir /data --shell /usr/sbin/nologin taskgate \
    && mkdir -p /data && chown taskgate:taskgate /data
COPY --from=build /taskgate /usr/local/bin/taskgate
USER taskgate:taskgate
# PATH too: a base image made with debootstrap sets none, and without it
# `podman kube play` finds no command given by name (`sh`, `id`).
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    TASKGATE_LISTEN=0.0.0.0:8080 \
    TASKGATE_DATA_DIR=/data \
    TASKGATE_SERVER=http://127.0.0.1:8080
VOLUME /data
EXPOSE 8080
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=6s --start-period=30s --retries=3 \
    CMD ["taskgate", "health"]
ENTRYPOINT ["taskgate"]
CMD ["serve"]
