#!/usr/bin/env bash
# Build what the integration tier needs while the default tier runs (.ci/run starts it first).
#
#   tools/integration-prep.sh      everything below, then "integration-prep [ N s] done in N s"
#
# Each part is what a test would otherwise build on first use, in the same place and by the same
# script, so a test finds it done (or, if a part failed here, builds it itself and reports why):
#   apt      Debian's podman set (tools/podman-setup.sh install), Slurm + munge, chromium + driver
#            + a CJK font (the site's Chinese pages),
#            in one apt transaction (apt holds one lock: several installs would only queue)
#   envs     the five framework venvs (tools/framework-envs.sh), built side by side: most of a cold
#            build is downloading wheels, and Horovod's compile gets the cores the downloads leave
#   base     the Debian base image's cache file (tools/podman-setup.sh base), after apt
# Every part runs under `nice`, so the default tier keeps the cores when both want them.
# Progress: a timestamped line when a part starts and ends, and every 60 s while one runs; each
# part's own output in $MINIDIST_PREP_LOG (default /tmp/minidist-integration-prep), one file each.
# Best effort: a failed part is reported, never fatal (the test that needs it fails with the reason).
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
LOG="${MINIDIST_PREP_LOG:-/tmp/minidist-integration-prep}"
T0=$SECONDS

say() { printf 'integration-prep [%4ds] %s\n' $((SECONDS - T0)) "$*"; }

mkdir -p "$LOG"
rm -f "$LOG"/*.status

part() {  # NAME CMD...: run CMD niced into $LOG/NAME.log, write $LOG/NAME.status
    local name=$1 t=$SECONDS rc; shift
    say "$name: started"
    ( renice -n 10 -p "$BASHPID" >/dev/null; "$@" ) >"$LOG/$name.log" 2>&1
    rc=$?
    if [[ $rc == 0 ]]; then say "$name: done in $((SECONDS - t)) s"
    else say "$name: FAILED (exit $rc) after $((SECONDS - t)) s; last lines of $LOG/$name.log:"
         tail -5 "$LOG/$name.log" | sed 's/^/    /'
    fi
    echo "$rc $((SECONDS - t))" >"$LOG/$name.status"
}

apt_packages() {
    [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null || { echo "no root or no apt-get: skipped"; return 0; }
    local want=(podman buildah podman-compose debootstrap runc netavark aardvark-dns iptables uidmap
                slurmctld slurmd slurm-client munge chromium chromium-driver fonts-wqy-microhei) need=() p
    for p in "${want[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
    [[ ${#need[@]} == 0 ]] && { echo "all installed"; return 0; }
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq -o DPkg::Lock::Timeout=300 &&
    apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=300 "${need[@]}"
}

framework_env() { "$ROOT/tools/framework-envs.sh" "$1"; }

base_image() {
    [[ $(id -u) == 0 ]] && command -v podman >/dev/null || { echo "no root or no podman: skipped"; return 0; }
    local dir; dir=$(mktemp -d /var/tmp/minidist-prep-podman.XXXXXX)
    eval "$("$ROOT/tools/podman-setup.sh" conf "$dir")"
    "$ROOT/tools/podman-setup.sh" base localhost/minidist-prep/base:bookworm
    local rc=$?
    podman rmi -a -f >/dev/null 2>&1; podman system reset -f >/dev/null 2>&1
    rm -rf "$dir"
    return $rc
}

say "building in the background; logs in $LOG"
part apt apt_packages &
pids=($!)
for n in deepspeed tensorflow paddle horovod accelerate; do
    part "env-$n" framework_env "$n" &
    pids+=($!)
done
wait "${pids[0]}"
part base base_image &
pids+=($!)
last=$SECONDS
while sleep 2; do
    running=()
    for f in apt env-deepspeed env-tensorflow env-paddle env-horovod env-accelerate base; do
        [[ -f $LOG/$f.status ]] || running+=("$f")
    done
    [[ ${#running[@]} == 0 ]] && break
    if (( SECONDS - last >= 60 )); then say "still building: ${running[*]}"; last=$SECONDS; fi
done
wait
failed=$(grep -lv '^0 ' "$LOG"/*.status 2>/dev/null | xargs -r -n1 basename | sed 's/.status//' | tr '\n' ' ')
say "done in $((SECONDS - T0)) s${failed:+ (failed: $failed— their tests build them again)}"
