#!/usr/bin/env bash
# Make a Docker-compatible container engine available for the tests (testcontainers) and for
# docker/compose.yaml, on a Debian machine that has none. Run as root.
#
#   source scripts/container_engine.sh           # sets up and exports into this shell
#   eval "$(bash scripts/container_engine.sh)"   # the same, from another script
#   bash scripts/container_engine.sh stop        # stops the API service it started
#
# When a Docker engine already answers (DOCKER_HOST, or /var/run/docker.sock), it does nothing
# and exports nothing: testcontainers and `docker compose` use that engine and pull `redis:7`.
# Otherwise:
#   1. apt-get install podman, runc and podman-compose (once);
#   2. /etc/containers/containers.conf: runc, no default ulimits, no pids limit (the default
#      runtime crun and the default ulimits are refused inside this kind of container);
#   3. a Redis image built with no registry: a root filesystem holding the installed
#      redis-server and redis-cli plus the libraries `ldd` lists, `podman import`ed as
#      localhost/hma-redis-test:<major.minor>, also tagged docker.io/library/redis:<major> so
#      compose.yaml's `image: redis:7` resolves to it without a pull;
#   4. `podman system service` on a unix socket (the Docker API testcontainers speaks);
#   5. exports DOCKER_HOST, TESTCONTAINERS_RYUK_DISABLED=true (no Ryuk image here; the fixtures
#      stop their containers), TESTCONTAINERS_CONNECTION_MODE=docker_host (these machines have a
#      /.dockerenv, which makes testcontainers look for a gateway that does not exist) and
#      HMA_REDIS_TEST_IMAGE (the image tests/support/containers.py starts).
# Idempotent: a second run finds the packages, the image and the running service (~1 s).

HMA_CE_DIR=${HMA_CE_DIR:-/run/hma-redis}
HMA_CE_SOCKET="$HMA_CE_DIR/podman.sock"
HMA_CE_IMAGE_REPO=localhost/hma-redis-test
# Bump when the image's recipe below changes: an image with another recipe is rebuilt.
HMA_CE_RECIPE=2

_hma_ce_log() { echo "container_engine: $*" >&2; }

# True when a Docker API answers on unix socket $1.
_hma_ce_ping() {
    [ -S "$1" ] || return 1
    if command -v curl >/dev/null; then
        [ "$(curl -s --max-time 3 --unix-socket "$1" http://d/_ping 2>/dev/null)" = OK ]
        return
    fi
    python3 -c 'import socket, sys
s = socket.socket(socket.AF_UNIX); s.settimeout(3); s.connect(sys.argv[1])
s.sendall(b"GET /_ping HTTP/1.0\r\nHost: d\r\n\r\n")
sys.exit(s.recv(4096).split(b"\r\n\r\n", 1)[-1] != b"OK")' "$1" 2>/dev/null
}

# True when a Docker engine other than ours answers: then there is nothing to do.
_hma_ce_other_engine() {
    local host=${DOCKER_HOST:-unix:///var/run/docker.sock}
    case "$host" in
    "unix://$HMA_CE_SOCKET") return 1 ;;
    unix://*) _hma_ce_ping "${host#unix://}" ;;
    *) curl -s --max-time 3 "http://${host#tcp://}/_ping" 2>/dev/null | grep -qx OK ;;
    esac
}

_hma_ce_install() {
    command -v podman >/dev/null && command -v runc >/dev/null &&
        command -v podman-compose >/dev/null && command -v curl >/dev/null && return 0
    _hma_ce_log "installing podman, runc, podman-compose (apt)"
    local pkgs="podman runc podman-compose curl"
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $pkgs >/dev/null ||
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $pkgs >/dev/null; }
}

_hma_ce_configure() {
    local conf=/etc/containers/containers.conf want
    want='# written by hma_redis scripts/container_engine.sh: crun and the default ulimits are
# refused inside this kind of container; runc without them works.
[containers]
default_ulimits = []
pids_limit = 0

[engine]
runtime = "runc"'
    [ "$(cat "$conf" 2>/dev/null)" = "$want" ] && return 0
    if [ -s "$conf" ] && ! grep -q 'hma_redis scripts/container_engine.sh' "$conf"; then
        cp "$conf" "$conf.before-hma-redis"
        _hma_ce_log "kept the previous $conf as $conf.before-hma-redis"
    fi
    mkdir -p /etc/containers
    printf '%s\n' "$want" >"$conf"
}

# Build the Redis image from the host's redis-server (no registry); prints the image name.
_hma_ce_image() {
    local version mm major image recipe old
    command -v redis-server >/dev/null ||
        { _hma_ce_log "redis-server is not installed (bash scripts/setup.sh installs it)"; return 1; }
    version=$(redis-server --version | sed -n 's/.* v=\([0-9.]*\).*/\1/p')
    [ -n "$version" ] || { _hma_ce_log "cannot read redis-server's version"; return 1; }
    mm=${version%.*}
    major=${version%%.*}
    image="$HMA_CE_IMAGE_REPO:$mm"
    recipe=$(podman image inspect --format '{{index .Labels "hma.recipe"}}' "$image" 2>/dev/null)
    if [ "$recipe" != "$HMA_CE_RECIPE" ]; then
        _hma_ce_log "building $image from redis-server $version (no registry)"
        old=$(podman image inspect --format '{{.Id}}' "$image" 2>/dev/null)
        _hma_ce_build "$image" || return 1
        # The previous build, now untagged (still used by a container: kept, harmless).
        [ -z "$old" ] || podman rmi "$old" >/dev/null 2>&1 || true
    fi
    # compose.yaml says `image: redis:7`: the same image under that name, found without a pull.
    podman tag "$image" "docker.io/library/redis:$major" || return 1
    echo "$image"
}

# A root filesystem with redis-server, redis-cli and /bin/sh (compose health checks run through
# a shell) plus every library `ldd` lists, imported as image $1.
_hma_ce_build() {
    local root bin lib status=0
    root=$(mktemp -d)
    mkdir -p "$root/usr/local/bin" "$root/bin" "$root/data" "$root/tmp" "$root/etc"
    cp -L "$(command -v redis-server)" "$(command -v redis-cli)" "$root/usr/local/bin/"
    cp -L /bin/sh "$root/bin/sh"
    for bin in "$root/usr/local/bin/redis-server" "$root/usr/local/bin/redis-cli" /bin/sh; do
        for lib in $(ldd "$bin" | grep -o '/[^ ]*'); do
            cp -L --parents "$lib" "$root"
        done
    done
    echo 'root:x:0:0:root:/root:/bin/sh' >"$root/etc/passwd"
    tar -C "$root" -c . | podman import --quiet \
        --change "LABEL hma.recipe=$HMA_CE_RECIPE" \
        --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' \
        --change 'WORKDIR /data' \
        --change 'EXPOSE 6379' \
        --change 'CMD ["redis-server", "--protected-mode", "no", "--save", "", "--appendonly", "no"]' \
        - "$1" >/dev/null || status=$?
    rm -rf "$root"
    return $status
}

_hma_ce_service() {
    _hma_ce_ping "$HMA_CE_SOCKET" && return 0
    mkdir -p "$HMA_CE_DIR"
    rm -f "$HMA_CE_SOCKET"
    # setsid + redirected output: the service outlives this script and holds no caller's pipe;
    # started from / so that removing the checkout it was started from does not break it.
    (cd / && exec setsid podman system service --time=0 "unix://$HMA_CE_SOCKET" \
        >"$HMA_CE_DIR/service.log" 2>&1 </dev/null) &
    echo $! >"$HMA_CE_DIR/service.pid"
    local i
    for i in $(seq 100); do
        _hma_ce_ping "$HMA_CE_SOCKET" && return 0
        sleep 0.1
    done
    _hma_ce_log "podman system service did not answer on $HMA_CE_SOCKET; log:"
    tail -20 "$HMA_CE_DIR/service.log" >&2
    return 1
}

# Set everything up; print the export lines on stdout (nothing when another engine answers).
_hma_ce_main() {
    local start=$SECONDS image
    if _hma_ce_other_engine; then
        _hma_ce_log "a Docker engine answers at ${DOCKER_HOST:-unix:///var/run/docker.sock}; nothing to do"
        return 0
    fi
    # Explicit checks, not `set -e`: bash ignores -e inside `if x=$(...)` (the sourced path).
    _hma_ce_install || { _hma_ce_log "apt-get install podman runc podman-compose failed"; return 1; }
    _hma_ce_configure || return 1
    image=$(_hma_ce_image) || { _hma_ce_log "building the Redis image failed"; return 1; }
    _hma_ce_service || return 1
    printf 'export DOCKER_HOST=%q\n' "unix://$HMA_CE_SOCKET"
    echo 'export TESTCONTAINERS_RYUK_DISABLED=true'
    echo 'export TESTCONTAINERS_CONNECTION_MODE=docker_host'
    printf 'export HMA_REDIS_TEST_IMAGE=%q\n' "$image"
    _hma_ce_log "podman $(podman version --format '{{.Client.Version}}') at unix://$HMA_CE_SOCKET," \
        "image $image, ready in $((SECONDS - start)) s"
}

_hma_ce_stop() {
    local pid
    pid=$(cat "$HMA_CE_DIR/service.pid" 2>/dev/null) || return 0
    kill "$pid" 2>/dev/null || true
    rm -f "$HMA_CE_DIR/service.pid"
}

if [ "${BASH_SOURCE[0]}" != "$0" ]; then
    # Sourced: set up in a subshell (its failures stay there), export here.
    if _hma_ce_env=$(_hma_ce_main); then
        eval "$_hma_ce_env"
        unset _hma_ce_env
        true
    else
        _hma_ce_log "FAILED: no container engine (the tests fall back to a local redis-server," \
            "except in CI)"
        unset _hma_ce_env
        false
    fi
elif [ "${1:-}" = stop ]; then
    _hma_ce_stop
else
    _hma_ce_main
fi
