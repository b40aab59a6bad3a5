# shellcheck shell=bash
# Sourced by scripts/test and scripts/demo: the project's virtualenv.
#
#   ensure_venv EXTRAS [REQUIREMENTS...]
#                        creates $VENV (.venv, with $PYTHON, default python3)
#                        if missing and `pip install -e .[EXTRAS] -r REQ...`
#                        into it; skipped when the manifests, the extras and
#                        the requirements files did not change.
#   ensure_test_venv     the test suite's venv: ensure_venv $EXTRAS (default
#                        redis,postgres,etcd,prometheus: the published extras)
#                        plus requirements/{test,gates,bench,docs}.txt, the tools
#                        that are not published extras (scripts/test, .ci/run).

ROOT=${ROOT:-$PWD}
VENV=${VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}

say() { printf '%s: %s\n' "$(basename "$0")" "$*" >&2; }

apt_updated=0
apt_install() {
    if [ "$apt_updated" = 0 ]; then
        say "apt-get update"
        apt-get update -qq
        apt_updated=1
    fi
    say "apt-get install $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

ensure_venv() {
    local extras=$1
    shift
    local reqs=("$@") req_args=() req
    for req in "${reqs[@]}"; do req_args+=(-r "$req"); done
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating $VENV with $PYTHON"
        if ! "$PYTHON" -m venv "$VENV" 2>/dev/null; then
            # Debian's python3 needs python3-venv for `-m venv` (ensurepip)
            rm -rf "$VENV"
            if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
                apt_install python3-venv
                "$PYTHON" -m venv "$VENV"
            else
                say "ERROR: '$PYTHON -m venv' failed; install python3-venv"
                return 1
            fi
        fi
    fi
    export PIP_DISABLE_PIP_VERSION_CHECK=1
    local stamp=$VENV/.installed want spec=.
    [ -n "$extras" ] && spec=".[$extras]"
    want="$(cat setup.cfg pyproject.toml "${reqs[@]}" | cksum) $spec ${reqs[*]}"
    if [ -f "$stamp" ] && grep -qxF "$want" "$stamp"; then
        return 0
    fi
    say "pip install -e '$spec' ${req_args[*]} (log: $VENV/pip-install.log)"
    if ! "$VENV/bin/python" -m pip install -e "$spec" "${req_args[@]}" \
            >"$VENV/pip-install.log" 2>&1; then
        tail -n 40 "$VENV/pip-install.log" >&2
        say "ERROR: pip install failed; full log in $VENV/pip-install.log"
        return 1
    fi
    printf '%s\n' "$want" >>"$stamp"
}

TEST_REQUIREMENTS=(requirements/test.txt requirements/gates.txt requirements/bench.txt requirements/docs.txt)

ensure_test_venv() {
    ensure_venv "${EXTRAS:-redis,postgres,etcd,prometheus}" "${TEST_REQUIREMENTS[@]}"
}
