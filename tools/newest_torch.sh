#!/usr/bin/env bash
# Does the package work on the newest torch the registry has? One command, one verdict line at the end.
#
#   bash tools/newest_torch.sh [--check-only] [--torch VERSION]
#
# 1. asks the registry for its newest torch (`pip index versions torch`; --torch picks a release instead);
# 2. builds .venv-newest-torch with it (wheels cached in ~/.cache/keras_dtensor_mixfix/wheels/torch-VERSION, as
#    .ci/run caches its own) and installs the package;
# 3. runs `python -m keras_dtensor_mixfix doctor`, with KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH=1 when that torch is
#    newer than the newest tested release: the self-check of every torch internal the package relies on;
# 4. unless --check-only: lint-imports and the whole suite. On a newer torch the suite runs in a scratch copy of
#    this checkout with the supported range moved to that release (NEWEST_TORCH in _torch/versions.py and
#    .ci/run, the range in the README), the change that would support it: the suite then tests the package,
#    not its gate.
#
# Not part of CI: on the day a release is published it downloads several GB. Exit status 0 when everything run
# passed. This machine's pip configuration caps torch at 2.14.1; PIP_CONSTRAINT=/dev/null lifts the cap here.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

CHECK_ONLY=0
TORCH=""
while [ $# -gt 0 ]; do
    case "$1" in
        --check-only) CHECK_ONLY=1 ;;
        --torch) TORCH="$2"; shift ;;
        -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

WHEELS="${KERAS_DTENSOR_MIXFIX_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/keras_dtensor_mixfix/wheels}"
VENV="$ROOT/.venv-newest-torch"
LOG="$ROOT/.newest-torch.log"
: > "$LOG"

verdict() {  # the one line, then exit
    echo "newest torch ${TORCH:-?}: $1"
    exit "$2"
}

if [ -z "$TORCH" ]; then
    TORCH=$(PIP_CONSTRAINT=/dev/null python3 -m pip index versions torch 2>>"$LOG" \
            | sed -n 's/^torch (\([^)]*\)).*/\1/p' | head -1)
    [ -n "$TORCH" ] || verdict "the registry did not answer (pip index versions torch; see $LOG)" 3
fi
echo "torch $TORCH: preparing $VENV (log: $LOG)"

if [ ! -f "$WHEELS/torch-$TORCH/.complete" ]; then
    mkdir -p "$WHEELS/torch-$TORCH"
    PIP_CONSTRAINT=/dev/null python3 -m pip download -q -d "$WHEELS/torch-$TORCH" "torch==$TORCH" >>"$LOG" 2>&1 \
        || verdict "could not download it (see $LOG)" 3
    touch "$WHEELS/torch-$TORCH/.complete"
fi
if [ "$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" != "$TORCH" ]; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    PIP_CONSTRAINT=/dev/null "$VENV/bin/pip" install -q --no-index --find-links "$WHEELS/torch-$TORCH" "torch==$TORCH" \
        >>"$LOG" 2>&1 || verdict "could not install it (see $LOG)" 3
fi
PIP_CONSTRAINT=/dev/null "$VENV/bin/pip" install -q -e "$ROOT[test]" >>"$LOG" 2>&1 \
    || verdict "could not install the package next to it (see $LOG)" 3

KIND=$("$VENV/bin/python" -c 'import sys
from keras_dtensor_mixfix._torch import versions
print(versions.classify(sys.argv[1]), "%d.%d" % versions.NEWEST_TORCH, "%d.%d" % versions.OLDEST_TORCH)' "$TORCH")
read -r KIND NEWEST_TESTED OLDEST_SUPPORTED <<< "$KIND"
case "$KIND" in
    supported) WHAT="in the supported range"; OPT_IN="" ;;
    newer) WHAT="newer than the newest tested release ($NEWEST_TESTED)"; OPT_IN="KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH=1" ;;
    *) verdict "not a release the package can support ($KIND)" 3 ;;
esac
echo "torch $TORCH is $WHAT"

echo "--- python -m keras_dtensor_mixfix doctor ${OPT_IN:+(with $OPT_IN)}"
doctor_status=0
env $OPT_IN "$VENV/bin/python" -m keras_dtensor_mixfix doctor > "$ROOT/.newest-torch-doctor.txt" 2>&1 || doctor_status=$?
grep -E '^  (ok  |FAIL) |self-check (passed|failed)|^  state:' "$ROOT/.newest-torch-doctor.txt" || true
if [ "$doctor_status" -ne 0 ]; then
    failed=$(sed -n 's/^  FAIL \([a-z_]*\):.*/\1/p' "$ROOT/.newest-torch-doctor.txt" | paste -sd, -)
    verdict "$WHAT; self-check FAILED (${failed:-doctor exited $doctor_status}; see .newest-torch-doctor.txt)" 1
fi
[ "$CHECK_ONLY" -eq 0 ] || verdict "$WHAT; self-check passed (suite not run: --check-only)" 0

SUITE_ROOT="$ROOT"
if [ "$KIND" = newer ]; then
    # A scratch copy of this checkout (tracked and new files) with the range moved to this release.
    SUITE_ROOT=$(mktemp -d "${TMPDIR:-/tmp}/mixfix-newest-torch.XXXXXX")
    trap 'rm -rf "$SUITE_ROOT"; PIP_CONSTRAINT=/dev/null "$VENV/bin/pip" install -q --no-deps -e "$ROOT" >/dev/null 2>&1 || true' EXIT
    git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$SUITE_ROOT"
    release=$(echo "$TORCH" | sed -n 's/^\([0-9]*\)\.\([0-9]*\).*/\1, \2/p')
    sed -i "s/^NEWEST_TORCH: Tuple\[int, int\] = (.*)/NEWEST_TORCH: Tuple[int, int] = ($release)/" \
        "$SUITE_ROOT/src/keras_dtensor_mixfix/_torch/versions.py"
    sed -i "s/^NEWEST_TORCH=\".*\"/NEWEST_TORCH=\"$TORCH\"/" "$SUITE_ROOT/.ci/run"
    sed -i "s/torch $OLDEST_SUPPORTED to $NEWEST_TESTED/torch $OLDEST_SUPPORTED to ${release/, /.}/g" "$SUITE_ROOT/README.md"
    PIP_CONSTRAINT=/dev/null "$VENV/bin/pip" install -q --no-deps -e "$SUITE_ROOT" >>"$LOG" 2>&1
    echo "--- suite in $SUITE_ROOT (the range moved to $release)"
fi
echo "--- lint-imports && python -m pytest (about 8 minutes; output in .newest-torch-suite.txt)"
suite_status=0
(cd "$SUITE_ROOT" && . "$VENV/bin/activate" && lint-imports && python -m pytest -q) > "$ROOT/.newest-torch-suite.txt" 2>&1 \
    || suite_status=$?
tail -3 "$ROOT/.newest-torch-suite.txt"
summary=$(grep -E '(passed|failed|error)' "$ROOT/.newest-torch-suite.txt" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
if [ "$suite_status" -ne 0 ]; then
    verdict "$WHAT; self-check passed, suite FAILED (${summary:-exit $suite_status}; see .newest-torch-suite.txt)" 1
fi
verdict "$WHAT; self-check passed, suite passed (${summary})" 0
