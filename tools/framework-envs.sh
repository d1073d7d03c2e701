#!/usr/bin/env bash
# One cached virtual environment per framework of frameworks/ (course chapter 10, tests/integration/test_frameworks.py).
#
#   tools/framework-envs.sh NAME...         build what is missing, print "NAME DIR" for each
#   tools/framework-envs.sh --path NAME     print the directory only (built or not; builds nothing)
#   tools/framework-envs.sh all             deepspeed tensorflow paddle horovod accelerate
#
# The frameworks pin conflicting numpy/protobuf/torch, so each gets its own venv, built from
# frameworks/envs/NAME.txt. The folder's name carries a hash of that file, of RECIPE below and of
# the Python version: change a pin (or bump RECIPE after changing how an env is built) and the next
# call builds a fresh venv and deletes the stale one.
# torch DDP and FSDP2 need no env: they run in the project's own venv.
#
# Where: $MINIDIST_FRAMEWORK_ENVS, default ~/.cache/minidist-frameworks (outside the repository).
# Python: $PYTHON, default python3 (>= 3.10). A build holds a lock, so two tests never build the
# same env at once. Each env records its build time in DIR/.build_seconds.
#
# Horovod 0.28.1, the last release, does not build as published against current torch: its CMake
# files hard-code C++14 and torch's headers need C++17 (horovod/horovod#3996, fixed upstream, never
# released). The recipe below downloads the sdist from PyPI with pip, checks its sha256, changes
# the two `set(CMAKE_CXX_STANDARD 14)` lines to 17, builds at -O1 without debug info instead of
# RelWithDebInfo's -O3 -g, for torch + gloo only, CPU only even beside a CUDA torch and an nvcc
# (needs g++ and cmake; the slowest env to build).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PINS="$ROOT/frameworks/envs"
CACHE="${MINIDIST_FRAMEWORK_ENVS:-$HOME/.cache/minidist-frameworks}"
PY="${PYTHON:-python3}"
ALL="deepspeed tensorflow paddle horovod accelerate"
RECIPE=3   # bump when build() below changes what an env contains
HOROVOD_SDIST_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
export PIP_DISABLE_PIP_VERSION_CHECK=1

die() { echo "framework-envs: $*" >&2; exit 1; }

env_dir() {  # NAME -> cache dir keyed by pins + this script + python version
    local name=$1 key
    [[ -f "$PINS/$name.txt" ]] || die "unknown framework env '$name' (known: $ALL)"
    key=$( { cat "$PINS/$name.txt"; echo "$RECIPE"; "$PY" -c 'import sys; print(sys.version)'; } \
           | sha256sum | cut -c1-12)
    echo "$CACHE/$name-$key"
}

build_horovod() {  # DIR: patched sdist, torch + gloo only
    local dir=$1 src
    src=$(mktemp -d)
    "$dir/bin/pip" download -q --no-deps --no-binary :all: horovod==0.28.1 -d "$src"
    echo "$HOROVOD_SDIST_SHA256  $src/horovod-0.28.1.tar.gz" | sha256sum -c --quiet \
        || die "horovod-0.28.1.tar.gz: unexpected sha256 (not the published sdist)"
    tar -xzf "$src/horovod-0.28.1.tar.gz" -C "$src"
    local d="$src/horovod-0.28.1"
    # the patch: C++14 -> C++17 in the top-level and the torch extension's CMakeLists (exactly 2 lines)
    grep -q '^set(CMAKE_CXX_STANDARD 14)' "$d/CMakeLists.txt" || die "horovod: top-level patch site moved"
    grep -q '^    set(CMAKE_CXX_STANDARD 14)' "$d/horovod/torch/CMakeLists.txt" || die "horovod: torch patch site moved"
    sed -i 's/^set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$d/CMakeLists.txt"
    sed -i 's/^    set(CMAKE_CXX_STANDARD 14)/    set(CMAKE_CXX_STANDARD 17)/' "$d/horovod/torch/CMakeLists.txt"
    # build time: RelWithDebInfo compiles at -O3 with debug info; the course runs a tiny job on two
    # processes, so -O1 without -g (the build's cost is torch's headers, compiled once per file)
    grep -q '^string(REPLACE "-O2" "-O3" CMAKE_CXX_FLAGS_RELWITHDEBINFO' "$d/CMakeLists.txt" \
        || die "horovod: optimisation-flags patch site moved"
    sed -i 's/^string(REPLACE "-O2" "-O3" CMAKE_\(C\|CXX\)_FLAGS_RELWITHDEBINFO .*/set(CMAKE_\1_FLAGS_RELWITHDEBINFO "-O1 -DNDEBUG")/' \
        "$d/CMakeLists.txt"
    # CPU only, whatever torch and this machine carry: FindPytorch.cmake calls torch a CUDA build
    # when torch.version.cuda is set and torch finds a CUDA_HOME (any nvcc on PATH, or
    # /usr/local/cuda), and then compiles Horovod's CUDA ops; with PyPI's CUDA torch on a machine
    # whose CUDA toolkit has no runtime library that fails ("Could NOT find CUDAToolkit (missing:
    # CUDA_CUDART)"). The course's job is torch + gloo on CPU ranks.
    local cuda_probe='print(True if ((torch.version.cuda is not None) and (CUDA_HOME is not None)) else False)'
    grep -qF "$cuda_probe" "$d/cmake/Modules/FindPytorch.cmake" || die "horovod: CUDA-probe patch site moved"
    sed -i "s/$cuda_probe/print(False)/" "$d/cmake/Modules/FindPytorch.cmake"
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
    HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo HOROVOD_GPU_OPERATIONS= MAKEFLAGS=-j2 \
        "$dir/bin/pip" install -q --no-build-isolation --no-cache-dir "$d"
    rm -rf "$src"
    "$dir/bin/python" -c 'import horovod.torch as hvd; assert hvd.gloo_built(), "horovod built without gloo"'
}

build() {  # NAME DIR
    local name=$1 dir=$2 t0=$SECONDS
    echo "framework-envs: building $name in $dir (once; later calls reuse it)" >&2
    rm -rf "$dir"
    "$PY" -m venv "$dir"
    "$dir/bin/pip" install -q --upgrade pip >&2
    "$dir/bin/pip" install -q -r "$PINS/$name.txt" >&2
    if [[ $name == horovod ]]; then build_horovod "$dir" >&2; fi
    if [[ $name == deepspeed ]]; then
        # JIT-compile DeepSpeed's CPU shared-memory comm op now, into the env, not at first launch
        # (where two ranks would compile it under a lock a killed run can leave behind)
        DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$dir/torch_extensions" "$dir/bin/python" -c \
            'from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()' >&2
    fi
    echo $((SECONDS - t0)) > "$dir/.build_seconds"
    touch "$dir/.built"
    echo "framework-envs: $name built in $((SECONDS - t0)) s" >&2
}

ensure() {  # NAME: build unless built; remove stale builds of the same name
    local name=$1 dir
    dir=$(env_dir "$name")
    mkdir -p "$CACHE"
    (
        flock 9
        if [[ ! -f "$dir/.built" ]]; then
            for old in "$CACHE/$name"-*; do
                [[ -d $old && $old != "$dir" ]] && rm -rf "$old"
            done
            build "$name" "$dir"
        fi
    ) 9>"$CACHE/$name.lock"
    echo "$name $dir"
}

[[ $# -ge 1 ]] || { sed -n 2,6p "$0" >&2; exit 2; }
if [[ $1 == --path ]]; then
    [[ $# -eq 2 ]] || die "--path takes one NAME"
    env_dir "$2"
    exit 0
fi
names=("$@")
[[ ${names[*]} == all ]] && names=($ALL)
for n in "${names[@]}"; do ensure "$n"; done
