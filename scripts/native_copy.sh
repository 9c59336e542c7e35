# shellcheck shell=bash
# Sourced by scripts/asan.sh and scripts/c_mutants.sh: a copy of the work tree with its own build
# of the native extension, so the checkout's build is never touched. Tests run from the copy's
# root import the copy's hma_redis (the current directory comes first on sys.path).
#
#   native_copy DIR [C_FILE]   copy the tracked and new (not ignored) files into DIR (emptied
#                              first); with C_FILE, it replaces hma_redis/core/redis/_wire.c there
#   native_build DIR           build the extension in place in DIR with $NATIVE_CFLAGS and
#                              $NATIVE_LDFLAGS added; fails unless the .so was built

native_copy() {
    local dir=$1 c_file=${2:-}
    rm -rf "$dir"
    mkdir -p "$dir"
    git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} sh -c \
        '[ -f "$1" ] && mkdir -p "$2/$(dirname "$1")" && cp -p "$1" "$2/$1" || true' _ {} "$dir"
    if [[ -n "$c_file" ]]; then
        cp "$c_file" "$dir/hma_redis/core/redis/_wire.c"
    fi
}

native_build() {
    local dir=$1
    (
        cd "$dir"
        rm -f hma_redis/core/redis/_wire*.so
        CFLAGS="${NATIVE_CFLAGS:-}" LDFLAGS="${NATIVE_LDFLAGS:-}" \
            "$VENV_PYTHON" setup.py build_ext --inplace -q --build-temp build/native-temp \
            > build-native.log 2>&1 || true
        if ! ls hma_redis/core/redis/_wire*.so > /dev/null 2>&1; then
            echo "native_build: the extension did not build; the end of $dir/build-native.log:" >&2
            tail -n 30 build-native.log >&2
            return 1
        fi
    )
}
